"""Inside one trial: the highest Poisson rate the engine sustains with TTFT P99 within the limit.

What people do by hand with `vllm bench serve`: first an unlimited-rate burst for the ceiling, then lower
rates until the latency curve is under the limit, then a few bisection steps between the last rate that
failed and the first that passed. Every replay becomes one point of the trial's rate -> latency curve.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from optimizer.config.settings import RateSearchSpec
from optimizer.measurement.metrics import ReplayMetrics


@dataclass(frozen=True)
class CurvePoint:
    """One replay, summarized for the trial's stored curve."""

    offered_rate_rps: float
    sent_rate_rps: float
    achieved_rate_rps: float
    output_throughput_tok_s: float
    request_throughput_rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    itl_p99_ms: float
    e2e_p99_ms: float
    completed: int
    failed: int
    sustained: bool
    feasible: bool
    total_input_tokens: int | None = None  # prompt tokens of the completed requests (None in curves stored before)

    @classmethod
    def of(cls, m: ReplayMetrics, limit_ms: float, sustain_ratio: float) -> CurvePoint:
        sustained = m.sustained(sustain_ratio)
        return cls(
            offered_rate_rps=m.offered_rate_rps,
            sent_rate_rps=m.sent_rate_rps,
            achieved_rate_rps=m.achieved_rate_rps,
            output_throughput_tok_s=m.output_throughput_tok_s,
            request_throughput_rps=m.request_throughput_rps,
            ttft_p50_ms=m.ttft.p50_ms,
            ttft_p99_ms=m.ttft.p99_ms,
            tpot_p99_ms=m.tpot.p99_ms,
            itl_p99_ms=m.itl.p99_ms,
            e2e_p99_ms=m.e2e.p99_ms,
            completed=m.completed,
            failed=m.failed,
            sustained=sustained,
            feasible=sustained and m.ttft.p99_ms <= limit_ms,
            total_input_tokens=m.total_input_tokens,
        )

    def to_dict(self) -> dict:
        # JSON has no infinity: a burst is stored with rate null
        d = dict(self.__dict__)
        for k in ("offered_rate_rps", "sent_rate_rps", "achieved_rate_rps"):
            if not math.isfinite(d[k]):
                d[k] = None
        return d


@dataclass
class RateSearchResult:
    points: list[CurvePoint] = field(default_factory=list)
    best: CurvePoint | None = None
    stopped_early: bool = False  # the descent reached the incumbent's floor without a feasible rate
    repeats: list[CurvePoint] = field(default_factory=list)  # more replays at the best point's rate

    @property
    def feasible(self) -> bool:
        return self.best is not None

    @property
    def failed_rate_rps(self) -> float | None:
        """The lowest Poisson rate tried above the best that missed the limit: with the best's rate, the bracket
        the rate at the limit lies in (None: nothing above it was tried, or there is no best)."""
        if self.best is None or not math.isfinite(self.best.offered_rate_rps):
            return None
        above = [p.offered_rate_rps for p in self.points
                 if self.best.offered_rate_rps < p.offered_rate_rps < math.inf and not p.feasible]
        return min(above, default=None)

    def violation_ms(self, limit_ms: float) -> float:
        """How far the closest point missed the limit (0 when feasible): the constraint Optuna learns from."""
        if self.best is not None:
            return 0.0
        misses = [p.ttft_p99_ms - limit_ms for p in self.points if not math.isnan(p.ttft_p99_ms)]
        return max(min(misses, default=limit_ms), 1.0)


# Lowering the rate must cut TTFT P99 below this fraction of the previous rate's to be worth going on.
FLOOR_RATIO = 0.9
INCUMBENT_FLOOR = 0.9  # below 90% of the incumbent's rate a config cannot win: stop descending
FLAT_STEPS_TO_STOP = 2  # P99 is noisy: one flat step is not proof

ReplayAt = Callable[[float], Awaitable[ReplayMetrics]]


async def find_max_rate(replay_at: ReplayAt, limit_ms: float, spec: RateSearchSpec,
                        incumbent_rate_rps: float | None = None) -> RateSearchResult:
    """Search rates with at most `spec.max_replays` replays; `replay_at(rate)` runs one cold replay.

    With an incumbent (the best feasible rate of the study so far), the descent tries that floor,
    `INCUMBENT_FLOOR` x the incumbent's rate, once and stops below it: every trial replays the same requests, so a config that meets the limit only
    there serves less than the incumbent and cannot become the recommendation. The trial then ends infeasible
    with `stopped_early` set, and saves the slowest replays of all.
    """
    result = RateSearchResult()
    floor_rps = spec.min_rate_rps
    if incumbent_rate_rps is not None and math.isfinite(incumbent_rate_rps):
        floor_rps = max(floor_rps, INCUMBENT_FLOOR * incumbent_rate_rps)

    async def probe(rate: float) -> CurvePoint:
        point = CurvePoint.of(await replay_at(rate), limit_ms, spec.sustain_ratio)
        result.points.append(point)
        return point

    burst = await probe(math.inf)
    if burst.feasible:  # even everything at once meets the limit: nothing offers more
        result.best = burst
        return result
    ceiling = burst.request_throughput_rps
    if not ceiling > 0:
        return result
    hi, lo = ceiling, None  # a Poisson stream at the burst's pace is at best borderline: start below it
    rate = ceiling * spec.step_down
    if incumbent_rate_rps is not None and floor_rps > spec.min_rate_rps:
        if ceiling < floor_rps:  # even its burst pace is below what the incumbent sustains
            result.stopped_early = True
            return result
        if rate < incumbent_rate_rps < ceiling:
            rate = incumbent_rate_rps  # the one question that matters: does it hold where the incumbent does?
    previous: CurvePoint | None = None
    flat_steps = 0
    while len(result.points) < spec.max_replays and rate >= floor_rps:
        point = await probe(rate)
        if point.feasible:
            lo = point
            break
        flat = previous is not None and point.sustained and point.ttft_p99_ms > FLOOR_RATIO * previous.ttft_p99_ms
        flat_steps = flat_steps + 1 if flat else 0
        if flat_steps >= FLAT_STEPS_TO_STOP:
            break  # latency no longer falls with load: the limit is below what this config does unloaded
        previous = point
        hi = rate
        if floor_rps > spec.min_rate_rps and rate > floor_rps and rate * spec.step_down < floor_rps:
            rate = floor_rps  # the incumbent's floor itself, once, before giving up: P99 is noisy near the knee
        else:
            rate *= spec.step_down
    if lo is None:
        result.stopped_early = rate < floor_rps and floor_rps > spec.min_rate_rps
        return result
    for _ in range(spec.refine_steps):
        if len(result.points) >= spec.max_replays or hi / lo.offered_rate_rps < 1.05:
            break
        mid = (lo.offered_rate_rps + hi) / 2
        point = await probe(mid)
        if point.feasible:
            lo = point
        else:
            hi = mid
    result.best = lo
    return result


# The confirmation resolves each config's rate at the limit until the rate it passed and the rate it failed are
# within this fraction of each other.
BRACKET_PRECISION = 0.03
BRACKET_STEP = 1.15  # from the starting rate, up (it passed) or down (it failed) by this factor until it turns
BRACKET_MAX_REPLAYS = 12
BURST_START = 0.85  # a burst that misses the limit now: the Poisson rate to start from, as a share of its pace


async def bisect_rate(replay_at: ReplayAt, limit_ms: float, spec: RateSearchSpec, start_rps: float,
                      failed_rps: float | None = None, precision: float = BRACKET_PRECISION,
                      max_replays: int = BRACKET_MAX_REPLAYS) -> RateSearchResult:
    """The rate at the limit, finely: start where an earlier search put it (`start_rps`, and the rate it failed,
    `failed_rps`, when known), step by BRACKET_STEP until the limit is crossed, then bisect (geometric middle)
    until the rate passed and the rate failed are within `precision` of each other, in at most `max_replays`.

    A `start_rps` of inf (the earlier search met the limit even with a burst) replays the burst first: when it
    meets the limit again there is nothing higher to find. The result's best point is the highest rate passed
    (None when no rate down to `spec.min_rate_rps` did); its curve holds the rate failed above it."""
    result = RateSearchResult()

    async def probe(rate: float) -> CurvePoint:
        point = CurvePoint.of(await replay_at(rate), limit_ms, spec.sustain_ratio)
        result.points.append(point)
        return point

    if math.isinf(start_rps):
        burst = await probe(math.inf)
        if burst.feasible:
            result.best = burst
            return result
        start_rps = burst.request_throughput_rps * BURST_START
        if not start_rps > 0:
            return result
    lo: CurvePoint | None = None
    hi: float | None = None
    point = await probe(start_rps)
    if point.feasible:
        lo = point
        rate = failed_rps if failed_rps is not None and failed_rps > start_rps else start_rps * BRACKET_STEP
        while len(result.points) < max_replays:
            point = await probe(rate)
            if not point.feasible:
                hi = rate
                break
            lo, rate = point, rate * BRACKET_STEP
    else:
        hi, rate = start_rps, start_rps / BRACKET_STEP
        while len(result.points) < max_replays and rate >= spec.min_rate_rps:
            point = await probe(rate)
            if point.feasible:
                lo = point
                break
            hi, rate = rate, rate / BRACKET_STEP
    while lo is not None and hi is not None and hi / lo.offered_rate_rps > 1 + precision \
            and len(result.points) < max_replays:
        mid = math.sqrt(lo.offered_rate_rps * hi)
        point = await probe(mid)
        if point.feasible:
            lo = point
        else:
            hi = mid
    result.best = lo
    return result
