"""Pure: one probe's requests counted against one latency limit at a moment, for every metric a limit can name.

`evidence.count` counts first tokens (TTFT); here the other metrics, with the definitions of `vllm bench serve`:

- **E2E**: a finished request's send-to-last-token; one still running past the limit is over already.
- **TPOT**: a finished request's (E2E - TTFT) / (output tokens - 1); a request of one output token has none (as in
  vLLM), so it is not counted.
- **ITL**: every gap between consecutive chunks, pooled over the requests: the unit counted is the gap. A request's
  gaps over the limit are one cluster of evidence (`evidence.CLUSTER_MAX` at most), as a burst's TTFTs are: they
  share one cause. A chunk still awaited past the limit is a gap over it already.
- **Goodput** (per-request limits): a request is over when it misses any limit (one known miss settles it), within
  when it meets every one.

A failed request is over every limit it was meant to meet. What is not known yet at the moment is pending.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from optimizer.config.limits import Limit, Limits
from optimizer.measurement.evidence import CLUSTER_GAP, CLUSTER_MAX, Counted, Sent, count


def _finished(r: Sent, now_s: float) -> bool:
    return r.ok and bool(r.chunk_times_s) and r.chunk_times_s[-1] <= now_s


def _failed(r: Sent) -> bool:
    return bool(r.error) and not r.ok


def request_value_s(r: Sent, metric: str, now_s: float) -> tuple[float | None, bool]:
    """(value in seconds or None, resolved by waiting): the request's `metric` as known at `now_s`; a value of
    None with resolved False is pending (or, for TPOT of a one-token request, never measured)."""
    if metric == "ttft":
        if r.first_token_s is not None and r.first_token_s <= now_s:
            return r.first_token_s - r.sent_s, False
        return None, False
    if not _finished(r, now_s):
        return None, False
    e2e = r.chunk_times_s[-1] - r.sent_s
    if metric == "e2e":
        return e2e, False
    tokens = getattr(r, "output_tokens", len(r.chunk_times_s))
    if metric == "tpot" and tokens > 1 and r.first_token_s is not None:
        return (e2e - (r.first_token_s - r.sent_s)) / (tokens - 1), False
    return None, False


def _waited_past(r: Sent, metric: str, now_s: float, limit_s: float) -> bool:
    """Known over by waiting: no first token (TTFT) or no last token (E2E) yet, past the limit."""
    if metric == "ttft":
        return (r.first_token_s is None or r.first_token_s > now_s) and now_s - r.sent_s > limit_s
    if metric == "e2e":
        return not _finished(r, now_s) and not _failed(r) and now_s - r.sent_s > limit_s
    return False


class _Clusters:
    """Overs in send order, CLUSTER_GAP apart at most and CLUSTER_MAX long, counted as one cluster each."""

    def __init__(self) -> None:
        self.count, self.size, self.last = 0, 0, -CLUSTER_GAP - 1

    def add(self, position: int) -> None:
        if position - self.last > CLUSTER_GAP or self.size >= CLUSTER_MAX:
            self.count, self.size = self.count + 1, 0
        self.size += 1
        self.last = position


def count_request_metric(records: Sequence[Sent], now_s: float, metric: str, limit_ms: float) -> Counted:
    """TTFT, E2E or TPOT, one value per request, counted against `limit_ms` at `now_s`."""
    base = count(records, now_s, math.inf if metric != "ttft" else limit_ms)
    if metric == "ttft":
        return base
    limit_s = limit_ms / 1000.0
    resolved = over = pending = 0
    values: list[float] = []
    over_at: list[int] = []
    clusters = _Clusters()
    for i, r in enumerate(records):
        if r.sent_s > now_s:
            continue
        value, _ = request_value_s(r, metric, now_s)
        if value is not None:
            resolved += 1
            values.append(value * 1000.0)
            is_over = value > limit_s
        elif _failed(r) or _waited_past(r, metric, now_s, limit_s):
            resolved += 1
            is_over = True
        else:
            if not _finished(r, now_s):
                pending += 1
            continue
        if is_over:
            over += 1
            over_at.append(r.index)
            clusters.add(i)
    return Counted(resolved, over, tuple(values), pending, clusters.count, base.sending_s, base.longest_e2e_s,
                   tuple(over_at), limit_ms)


def count_itl(records: Sequence[Sent], now_s: float, limit_ms: float) -> Counted:
    """ITL: every gap between chunks known at `now_s`, and a chunk awaited past the limit, counted as gaps."""
    base = count(records, now_s, math.inf)
    limit_s = limit_ms / 1000.0
    resolved = over = clusters = 0
    values: list[float] = []
    over_at: list[int] = []
    for r in records:
        if r.sent_s > now_s or not r.chunk_times_s:
            continue
        times = [t for t in r.chunk_times_s if t <= now_s]
        gaps = [b - a for a, b in zip(times, times[1:])]
        values.extend(g * 1000.0 for g in gaps)
        late = bool(times) and not _finished(r, now_s) and not _failed(r) and now_s - times[-1] > limit_s
        n_over = sum(1 for g in gaps if g > limit_s) + late  # a chunk late already is a gap over the limit
        resolved += len(gaps) + late
        if n_over:
            over += n_over
            over_at.extend([r.index] * n_over)
            clusters += math.ceil(n_over / CLUSTER_MAX)
    return Counted(resolved, over, tuple(values), 0, clusters, base.sending_s, base.longest_e2e_s, tuple(over_at),
                   limit_ms)


def count_goodput(records: Sequence[Sent], now_s: float, limits: Limits) -> Counted:
    """Goodput: a request is over when it misses any of `limits` (per request), within when it meets every one."""
    base = count(records, now_s, math.inf)
    resolved = over = pending = 0
    over_at: list[int] = []
    clusters = _Clusters()
    for i, r in enumerate(records):
        if r.sent_s > now_s:
            continue
        known_over, all_known = _failed(r), True
        for lim in limits:
            value, _ = request_value_s(r, lim.metric, now_s)
            if value is not None:
                known_over |= value * 1000.0 > lim.value_ms
            elif _waited_past(r, lim.metric, now_s, lim.value_ms / 1000.0):
                known_over = True
            elif not (lim.metric == "tpot" and _finished(r, now_s)):  # a one-token request has no TPOT to miss
                all_known = False
        if known_over:
            resolved, over = resolved + 1, over + 1
            over_at.append(r.index)
            clusters.add(i)
        elif all_known:
            resolved += 1
        else:
            pending += 1
    return Counted(resolved, over, (), pending, clusters.count, base.sending_s, base.longest_e2e_s, tuple(over_at),
                   math.inf)


def count_limit(records: Sequence[Sent], now_s: float, limit: Limit) -> Counted:
    """`records` counted against one percentile or mean `limit` at `now_s` (for the mean: its known values)."""
    if limit.metric == "itl":
        return count_itl(records, now_s, limit.value_ms)
    return count_request_metric(records, now_s, limit.metric, limit.value_ms)


def statistic_ms(values_ms: Sequence[float], stat: str) -> float:
    """A statistic of values, as `vllm bench serve` computes it (numpy's linear percentile); NaN without values."""
    if not values_ms:
        return math.nan
    if stat == "mean":
        return sum(values_ms) / len(values_ms)
    q = float(stat[1:]) / 100.0
    ordered = sorted(values_ms)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class MeanTest:
    """A mean limit's test on the values known: pass when the mean's upper confidence bound is within the limit,
    fail when its lower bound is past it (a normal interval on n values)."""

    n: int
    mean_ms: float
    half_width_ms: float

    @classmethod
    def of(cls, values_ms: Sequence[float], alpha: float) -> MeanTest:
        n = len(values_ms)
        if n < 2:
            return cls(n, math.nan, math.inf)
        mean = sum(values_ms) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in values_ms) / (n - 1))
        return cls(n, mean, NormalDist().inv_cdf(1 - alpha) * sd / math.sqrt(n))

    def passes(self, limit_ms: float) -> bool:
        return self.mean_ms + self.half_width_ms <= limit_ms

    def fails(self, limit_ms: float) -> bool:
        return self.mean_ms - self.half_width_ms > limit_ms
