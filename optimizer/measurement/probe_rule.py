"""Pure: one probe's verdict on every latency limit of the study at once, settled by sequential looks.

Each limit is tested on its own count (measurement/evidence.py for the test, measurement/limit_counts.py for what
is counted): a percentile limit by the binomial test on the share over its value, a mean limit by a normal interval
on the mean. The probe's verdict is joint:

- **pass** only when every limit passes (each at the look's alpha). This is an intersection-union test: a rate
  that breaks any one limit passes only if that limit's own test passes wrongly, so the chance that a bad rate
  passes stays at most alpha (5%) however many limits there are, with no correction.
- **fail** when any limit fails at alpha / m (m limits: Bonferroni), so the chance that a good rate fails stays at
  most alpha too; and when the engine falls behind its arrivals, as before.
- otherwise unsettled, and the probe sends on.

The limit a verdict rests on is its *binding* limit: the one that failed (the furthest over, if several), or, for a
pass, the one closest to its value. Its counts are the probe's counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from optimizer.config.limits import Limit, Limits
from optimizer.measurement.evidence import (EXCESS_SHARE, FAIL, FIRST_LOOK_REQUESTS, PASS, UNSETTLED, Counted, Sent,
                                            count, count_verdict, falls_behind, far_below, looks)
from optimizer.measurement.limit_counts import MeanTest, count_goodput, count_limit, statistic_ms

GOODPUT = "goodput"  # the key of a goodput study's one criterion


@dataclass(frozen=True)
class Criterion:
    """What one limit (or goodput's joint per-request test) counts, and at what share or mean."""

    key: str
    limit_ms: float  # inf for goodput (each request against its own limits)
    share: float  # the share over the limit allowed; NaN for a mean
    stat: str
    counter: Callable[[Sequence[Sent], float], Counted]

    @classmethod
    def of_limits(cls, limits: Limits) -> list[Criterion]:
        if limits.goodput_pct is not None:
            return [cls(GOODPUT, math.inf, limits.goodput_share, "goodput",
                        lambda records, now_s: count_goodput(records, now_s, limits))]
        return [cls(lim.key, lim.value_ms, lim.share, lim.stat, _counter(lim)) for lim in limits]


def _counter(limit: Limit) -> Callable[[Sequence[Sent], float], Counted]:
    return lambda records, now_s: count_limit(records, now_s, limit)


@dataclass(frozen=True)
class LimitEvidence:
    """One limit's part of a probe's evidence."""

    key: str
    verdict: str
    requests: int  # resolved against it (ITL: gaps)
    over_limit: int
    independent_fraction: float = 1.0
    over_indices: tuple[int, ...] = ()
    value_ms: float = math.nan  # the limit's statistic over the probe's measured values (NaN: none; goodput)
    far: bool = False
    within: bool = False  # the best guess when unsettled: at most the allowed share over (a mean within)
    ratio: float = math.nan  # how near the limit: share over / share allowed, or mean / limit (1 = at the limit)
    share: float = math.nan  # the share over it allows (NaN: a mean limit)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["over_indices"] = list(self.over_indices)
        d["independent_fraction"] = round(self.independent_fraction, 3)
        for k in ("value_ms", "ratio", "share"):
            d[k] = None if not math.isfinite(d[k]) else round(d[k], 4)
        return d


@dataclass(frozen=True)
class Evidence:
    """One probe's verdict and what it rests on; the counts are those of its binding limit."""

    verdict: str  # PASS, FAIL or UNSETTLED (the cap came first)
    requests: int  # resolved requests
    over_limit: int
    behind: bool  # the backlog grew over the arrivals' window
    settled_at: int | None  # the look that settled it (None: unsettled)
    far: bool = False  # passed far below the limit, on the fitted tail
    independent_fraction: float = 1.0  # Counted.independent_fraction: clusters / over
    over_indices: tuple[int, ...] = ()  # which requests (workload indices) were over
    limits: tuple[LimitEvidence, ...] = field(default=())  # every limit's part, in the study's order
    binding: str | None = None  # the key of the limit the verdict rests on

    @property
    def over_share(self) -> float:
        return self.over_limit / self.requests if self.requests else math.nan

    @property
    def passes(self) -> bool:
        """Within every limit: settled so, or unsettled, keeping pace and each limit's best guess within."""
        if self.verdict != UNSETTLED:
            return self.verdict == PASS
        if self.behind or self.requests <= 0:
            return False
        if not self.limits:
            return self.over_share <= EXCESS_SHARE
        return all(lim.within for lim in self.limits)


def _judge_one(cr: Criterion, c: Counted, alpha_look: float, m: int, final: bool) -> LimitEvidence:
    """One criterion at a look: its verdict (pass at alpha_look, fail at alpha_look / m)."""
    far = False
    if cr.stat == "mean":
        test, strict = MeanTest.of(c.values_ms, alpha_look), MeanTest.of(c.values_ms, alpha_look / m)
        verdict = PASS if test.passes(cr.limit_ms) else FAIL if strict.fails(cr.limit_ms) else UNSETTLED
        mean = statistic_ms(c.values_ms, "mean")
        within, ratio = bool(c.values_ms) and mean <= cr.limit_ms, mean / cr.limit_ms if c.values_ms else math.nan
    else:
        f = c.independent_fraction
        verdict = count_verdict(round(c.resolved * f), c.clusters, alpha_look, cr.share, alpha_look / m)
        far = verdict == UNSETTLED and c.over == 0 and far_below(c.values_ms, cr.limit_ms, cr.share)
        share = c.over / c.resolved if c.resolved else math.nan
        within, ratio = c.resolved > 0 and share <= cr.share, share / cr.share if c.resolved else math.nan
    value = statistic_ms(c.values_ms, cr.stat) if final and cr.key != GOODPUT else math.nan
    return LimitEvidence(cr.key, verdict, c.resolved, c.over, c.independent_fraction, c.over_indices, value, far,
                         within, ratio, cr.share)


def _binding(parts: Sequence[LimitEvidence], failed: bool) -> LimitEvidence:
    """The limit a verdict rests on: of those that failed (all, when none did), the one nearest or furthest over."""
    pool = [p for p in parts if p.verdict == FAIL] or list(parts) if failed else list(parts)
    return max(pool, key=lambda p: p.ratio if math.isfinite(p.ratio) else -math.inf)


class ProbeRule:
    """The sequential test of one probe on every limit: called with the records so far and the time, it says when
    to stop sending (`__call__` -> True); `evidence` is the verdict on the records at the end. A float `limits` is
    a TTFT P99 limit in milliseconds."""

    def __init__(self, limits: Limits | float, cap: int, alpha: float = 0.05, first_look: int = FIRST_LOOK_REQUESTS):
        self.limits = limits if isinstance(limits, Limits) else Limits.ttft_p99(float(limits))
        self.criteria = Criterion.of_limits(self.limits)
        ttft = self.limits.get("ttft")
        self.ttft_limit_ms = ttft.value_ms if ttft is not None else math.inf  # what first tokens are counted against
        self.cap = cap
        self.looks = looks(cap, min(first_look, cap))
        self.alpha_look = alpha / len(self.looks)
        self._next = 0  # index of the next look
        self.settled: Evidence | None = None
        self.settled_s: float | None = None  # when, on the records' clock

    @property
    def waiting_limit_s(self) -> float:
        """The shortest limit a request that waits (for its first or last token) is over once past."""
        waits = [lim.value_ms for lim in self.limits if lim.metric in ("ttft", "e2e")]
        return min(waits, default=math.inf) / 1000.0

    def kept(self, records: Sequence[Sent], withdrawn: str) -> list[Sent]:
        """The probe's requests once it stopped: those withdrawn before their first token (error `withdrawn`) only
        when they had already waited past a TTFT or E2E limit (they count as over); the rest were never judged."""
        if self.settled_s is None:
            return list(records)
        limit_s = self.waiting_limit_s
        return [r for r in records if r.error != withdrawn or self.settled_s - r.sent_s > limit_s]

    def __call__(self, records: Sequence[Sent], now_s: float) -> bool:
        if self.settled is not None:
            return True
        while self._next < len(self.looks) - 1:  # the cap's look is taken on the finished records
            if len(records) < self.looks[self._next]:  # cheap: fewer sent than the look needs resolved
                return False
            base = count(records, now_s, self.ttft_limit_ms)
            if base.resolved < self.looks[self._next]:
                return False
            self._next += 1
            found = self._judge(records, base, now_s, self.looks[self._next - 1])
            if found is not None:
                self.settled, self.settled_s = found, now_s
                return True
        return False

    def _parts(self, records: Sequence[Sent], now_s: float, final: bool) -> list[LimitEvidence]:
        m = len(self.criteria)
        return [_judge_one(cr, cr.counter(records, now_s), self.alpha_look, m, final) for cr in self.criteria]

    def _judge(self, records: Sequence[Sent], base: Counted, now_s: float | None, look: int) -> Evidence | None:
        behind = falls_behind(records, now_s)
        parts = self._parts(records, math.inf if now_s is None else now_s, now_s is None)
        if behind or any(p.verdict == FAIL for p in parts):
            verdict = FAIL
        elif all(p.verdict == PASS or p.far for p in parts):
            verdict = PASS if base.steady else UNSETTLED  # too soon to vouch for a pass: the batch may be filling
        else:
            verdict = UNSETTLED
        if verdict == UNSETTLED:
            return None
        b = _binding(parts, verdict == FAIL)
        far = verdict == PASS and any(p.far and p.verdict != PASS for p in parts)
        return Evidence(verdict, b.requests, b.over_limit, behind, look, far, 1.0 if far else b.independent_fraction,
                        (), tuple(parts), b.key)

    def evidence(self, records: Sequence[Sent]) -> Evidence:
        """The verdict on every record of the finished probe (all resolved, in send order): the settled one, or the
        cap's look; every limit's counts are those of all its records."""
        base = count(records, math.inf, self.ttft_limit_ms)
        found = self.settled or self._judge(records, base, None, len(records))
        parts = self._parts(records, math.inf, True)
        if found is None:
            b = _binding(parts, False)
            return Evidence(UNSETTLED, b.requests, b.over_limit, falls_behind(records), None, False,
                            b.independent_fraction, b.over_indices, tuple(parts), b.key)
        b = next(p for p in parts if p.key == found.binding)
        return Evidence(found.verdict, b.requests, b.over_limit, found.behind, found.settled_at, found.far,
                        b.independent_fraction, b.over_indices, tuple(parts), b.key)
