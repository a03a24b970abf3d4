"""Pure: when a probe's requests settle its verdict at the limit, and when the engine falls behind.

A probe replays the study's requests at one Poisson rate, one after another, until its verdict is settled. Each
request is *over* the limit (its first token came later than the limit after it was sent, or it is still waiting
past the limit, or it failed) or *within* it. TTFT P99 <= limit is the same statement as "at most 1% of requests
are over", so a probe's question is a question on a count: with k over among n resolved requests, is the fraction
over below 1% or above it? A binomial test answers it (MLPerf LoadGen's early stopping asks the same of the count
over its latency bound):

- **pass** when P(Binomial(n, 0.01) <= k) <= alpha_look: so few over would be rare if 1% or more were over;
- **fail** when P(Binomial(n, 0.01) >= k) <= alpha_look: so many over would be rare if at most 1% were over.

The test looks at n = 25, 50, 100, ... (doubling) up to the probe's cap, each look at alpha_look = alpha / looks
(Bonferroni): whichever look settles it, the verdict holds at 1 - alpha (95%). Passing with none over needs 459
requests at the default looks (MLPerf's 99% bound asks 459 too); failing takes a few dozen when most are over.

Far below the limit a probe need not send hundreds: at a look of at least FAR_MIN_REQUESTS requests, none over, the
slowest below FAR_FRACTION x the limit, and an exponential tail fitted to the top decile
(`stability.exponential_tail`) putting under FAR_TAIL_SHARE of requests over the limit, it passes "far below".
Near the limit only the count decides. No pass is vouched for before the probe has sent for STEADY_E2E x the
longest end-to-end latency it has seen: until the engine's batch has turned over a few times, a probe far past
capacity sees only the first tokens of a batch that is still filling (a few dozen requests at 4x the demo's
capacity all came within the limit on the simulator, while 4000 at 2x had 96% over). Nor before it has sent for
its slowest first token / STEADY_DRIFT: an engine a share e past its capacity queues e x the time sent, which its
slowest first token bounds, so that only then does a pass vouch that the rate is within STEADY_DRIFT of capacity.
(A real trial passed "far below" at 131 req/s after 52 requests in 0.34 s, its slowest first token 65 ms; the same
config failed at 138 and held 99-107 req/s in its confirmation rounds: its 133 req/s led the study, and every later
trial failed at its lower bound, 123 req/s, and at 0.9 of that, and stopped.)

**Falling behind** is judged on the arrivals' own window, never on the last request's drain: the backlog (requests
sent without a first token yet) at the latest send against the backlog halfway through the sends. A queue that keeps
pace has a backlog that stays put; one that grows by more than BEHIND_SHARE of what was sent in between (and at
least BEHIND_MIN_REQUESTS requests) is falling behind, and the probe fails. A long last request only decodes: it
has its first token, and the drain after the last send is not looked at.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from optimizer.measurement.stability import exponential_tail

EXCESS_SHARE = 0.01  # P99: at most 1% of requests over the limit
FIRST_LOOK_REQUESTS = 25
FAR_MIN_REQUESTS = 50
FAR_FRACTION = 0.5
FAR_TAIL_SHARE = EXCESS_SHARE / 10
BEHIND_SHARE = 0.1
BEHIND_MIN_REQUESTS = 10
# Requests over the limit come in clusters (a burst of arrivals delays the requests behind it together): overs
# fewer than this many requests apart in send order are one cluster, of at most CLUSTER_MAX requests (a queue that
# stays over the limit is not one event, however long).
CLUSTER_GAP = 4
CLUSTER_MAX = 10
STEADY_E2E = 5
STEADY_DRIFT = 0.05  # a pass vouches for a rate within 5% of capacity: sent for at least slowest TTFT / 0.05

PASS, FAIL, UNSETTLED = "pass", "fail", "unsettled"


class Sent(Protocol):
    """What the evidence reads of a request record (`metrics.RequestRecord` has it)."""

    index: int
    sent_s: float
    first_token_s: float | None
    chunk_times_s: list[float]
    ok: bool
    error: str


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed in log space (exact; k and n up to a few thousands)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
             for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def looks(cap: int, first: int = FIRST_LOOK_REQUESTS) -> list[int]:
    """The request counts at which a probe of at most `cap` requests looks: first, 2 x first, ..., and the cap."""
    out, n = [], first
    while n < cap:
        out.append(n)
        n *= 2
    return [*out, cap]


def count_verdict(n: int, k: int, alpha_look: float, share: float = EXCESS_SHARE,
                  alpha_fail: float | None = None) -> str:
    """PASS, FAIL or UNSETTLED for k over the limit among n requests, the pass side tested at `alpha_look`, the
    fail side at `alpha_fail` (default the same)."""
    if n <= 0:
        return UNSETTLED
    if binomial_cdf(k, n, share) <= alpha_look:
        return PASS
    if k > 0 and 1.0 - binomial_cdf(k - 1, n, share) <= (alpha_look if alpha_fail is None else alpha_fail):
        return FAIL
    return UNSETTLED


def far_below(values_ms: Sequence[float], limit_ms: float, share: float = EXCESS_SHARE) -> bool:
    """Enough values, none near the limit, and the fitted tail puts almost none over it (a tenth of the `share`
    the limit allows)."""
    if len(values_ms) < FAR_MIN_REQUESTS or max(values_ms) > FAR_FRACTION * limit_ms:
        return False
    tail = exponential_tail(values_ms)
    if tail is None:  # no spread in the top decile: no tail to extrapolate, only the count can tell
        return False
    u, beta, tail_share = tail
    return tail_share * math.exp(-(limit_ms - u) / beta) <= share * (FAR_TAIL_SHARE / EXCESS_SHARE)


@dataclass(frozen=True)
class Counted:
    """A probe's requests as known at one moment."""

    resolved: int  # requests whose side of the limit is known
    over: int  # of them, over the limit
    values_ms: tuple[float, ...]  # the measured values of the resolved (TTFT: of those with a first token)
    pending: int  # sent, neither a first token yet nor past the limit
    clusters: int = 0  # runs of requests over the limit, in send order (CLUSTER_GAP apart, CLUSTER_MAX long)
    sending_s: float = 0.0  # from the first send to the moment (or to the last send, for a finished probe)
    longest_e2e_s: float = 0.0  # the longest end-to-end latency of the requests finished by then
    over_indices: tuple[int, ...] = ()  # the workload indices of the requests over the limit
    limit_ms: float = math.inf  # the limit they were counted against

    @property
    def steady(self) -> bool:
        """Sent for at least STEADY_E2E x the longest request's life: the engine's batch has turned over several
        times, so what a pass rests on is the engine's steady state, not its filling up (a short probe far past
        capacity sees only first tokens while the batch fills); and for at least the slowest first token (at most the
        limit: one stall far past it is an over the count weighs, not a queue) / STEADY_DRIFT: a queue growing by that
        share of the time sent would have shown in it."""
        slowest_s = min(max(self.values_ms, default=0.0), self.limit_ms) / 1000.0
        return self.sending_s >= max(STEADY_E2E * self.longest_e2e_s, slowest_s / STEADY_DRIFT)

    @property
    def independent_fraction(self) -> float:
        """clusters / over: the runs estimator of the extremal index. Overs that come in clusters of three carry the
        evidence of one: the test and the fit count n x this and the clusters (1 with none over)."""
        return self.clusters / self.over if self.over else 1.0


def count(records: Sequence[Sent], now_s: float, limit_ms: float) -> Counted:
    """Which requests are over the limit at `now_s` (records' clock; `records` in send order). A first token after
    `now_s` is not known yet (the simulator's records hold the future; a live replay's do not)."""
    limit_s = limit_ms / 1000.0
    resolved = over = pending = clusters = size = 0
    last_over = -CLUSTER_GAP - 1
    first_s, last_s, longest_s = math.inf, -math.inf, 0.0
    ttfts: list[float] = []
    over_at: list[int] = []
    for i, r in enumerate(records):
        if r.sent_s > now_s:
            continue
        first_s, last_s = min(first_s, r.sent_s), max(last_s, r.sent_s)
        if r.ok and r.chunk_times_s and r.chunk_times_s[-1] <= now_s:
            longest_s = max(longest_s, r.chunk_times_s[-1] - r.sent_s)
        known = r.first_token_s is not None and r.first_token_s <= now_s
        if known:
            ttft = r.first_token_s - r.sent_s  # type: ignore[operator]
            resolved += 1
            ttfts.append(ttft * 1000.0)
            is_over = ttft > limit_s
        elif now_s - r.sent_s > limit_s or (r.error and r.first_token_s is None):
            resolved += 1
            is_over = True
        else:
            pending += 1
            continue
        if is_over:
            over += 1
            over_at.append(r.index)
            if i - last_over > CLUSTER_GAP or size >= CLUSTER_MAX:
                clusters, size = clusters + 1, 0
            size += 1
            last_over = i
    if not math.isfinite(first_s):
        sending_s = 0.0
    else:  # a finished probe (now inf) sent until its last send
        sending_s = (last_s if math.isinf(now_s) else now_s) - first_s
    return Counted(resolved, over, tuple(ttfts), pending, clusters, sending_s, longest_s, tuple(over_at), limit_ms)


def backlog_at(records: Sequence[Sent], t_s: float) -> int:
    """Requests sent by `t_s` without a first token by then."""
    return sum(1 for r in records if r.sent_s <= t_s and (r.first_token_s is None or r.first_token_s > t_s))


def falls_behind(records: Sequence[Sent], now_s: float | None = None) -> bool:
    """The backlog at the latest send (by `now_s`) grew from the one halfway through the sends by more than
    BEHIND_SHARE of the requests sent in between, and by at least BEHIND_MIN_REQUESTS."""
    sends = sorted(r.sent_s for r in records if now_s is None or r.sent_s <= now_s)
    if len(sends) < 2 * BEHIND_MIN_REQUESTS:
        return False
    mid_s, end_s = sends[len(sends) // 2], sends[-1]
    between = len(sends) - 1 - len(sends) // 2
    growth = backlog_at(records, end_s) - backlog_at(records, mid_s)
    return growth >= max(BEHIND_MIN_REQUESTS, BEHIND_SHARE * between)
