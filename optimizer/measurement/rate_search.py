"""Inside one trial: the rate at which TTFT P99 meets the limit, bracketed by probes sized by evidence.

What people do by hand with `vllm bench serve`, without its blind spots: from a first guess (the incumbent's rate,
or the pace of a short burst; a confirmation run's earlier rounds), Poisson probes step up while they pass and down
while they fail, by BRACKET_STEP (from a prior, finer steps that widen to it), until the limit is crossed; nothing
caps the search from above. Then the bracket is bisected (geometric middle)
until the rate passed and the rate failed are within `precision` of each other, or, once they are within
FIT_BRACKET, the pooled fit's interval is (optimizer/measurement/rate_fit.py; `bisected_enough`; a confirmation run
bisects to `precision` whatever the fit says: RUN_FIT_BRACKET). Each probe sends
requests until its verdict at the limit is settled (optimizer/measurement/evidence.py): a few dozen far from the
limit, up to the workload's request count near it.
Every probe becomes one point of the trial's rate -> latency curve, with its request count and the count over.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from typing import Any

from optimizer.config.limits import Limit, Limits
from optimizer.config.settings import RateSearchSpec
from optimizer.measurement.evidence import FAIL
from optimizer.measurement.probe_rule import GOODPUT, Evidence
from optimizer.measurement.metrics import ReplayMetrics
from optimizer.measurement.rate_fit import ProbeCount, RateAtLimit, fit_rate_at_limit


def _limits(limits: Limits | float) -> Limits:
    return limits if isinstance(limits, Limits) else Limits.ttft_p99(float(limits))


def replay_stats(m: ReplayMetrics) -> dict[str, dict[str, float | None]]:
    """Every metric's statistics of one replay, JSON-safe, by metric and statistic name."""
    return {"ttft": m.ttft.stats(), "tpot": m.tpot.stats(), "itl": m.itl.stats(), "e2e": m.e2e.stats()}


def limit_value_ms(stats: dict[str, dict[str, float | None]], limit: Limit, limits: Limits | None = None) -> float:
    """The limit's statistic in a replay's `stats` (NaN when not stored: a percentile it does not hold); under
    goodput, the metric's stored percentile at the goodput share (`Limits.stat_of`)."""
    stat = limit.stat if limits is None else limits.stat_of(limit)
    value = (stats.get(limit.metric) or {}).get(stat)
    return math.nan if value is None else float(value)


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
    total_input_tokens: int | None = None  # prompt tokens of the completed requests
    # a probe sized by evidence (None for replays of a fixed length)
    requests: int | None = None  # requests resolved: their side of the limit known
    over_limit: int | None = None  # of them, over the TTFT limit
    verdict: str | None = None  # evidence.PASS, FAIL or UNSETTLED (the cap came first)
    effective_fraction: float | None = None  # clusters / requests over the limit (evidence.Counted), 1 with none
    limit_ms: float | None = None  # the TTFT limit its verdict was settled at
    over_indices: list[int] | None = None  # the workload indices of its requests over the limit
    # every metric's statistics; each limit's part of the verdict (None for replays of a fixed length)
    stats: dict[str, dict[str, float | None]] | None = None  # {"tpot": {"p99": 41.2, "mean": ...}, ...}
    limits: list[dict[str, Any]] | None = None  # probe_rule.LimitEvidence.to_dict() of each limit, in order
    binding: str | None = None  # the key of the limit its verdict rests on ("tpot:p99")
    limits_key: str | None = None  # Limits.key of the limits it was judged at

    @classmethod
    def of(cls, m: ReplayMetrics, limits: Limits | float) -> CurvePoint:
        """A replay of a fixed length: feasible when it kept pace and each limit's statistic is within it (under
        goodput, each metric's percentile at the goodput share)."""
        limits = _limits(limits)
        sustained = m.sustained
        stats = replay_stats(m)
        values = {lim.key: limit_value_ms(stats, lim, limits) for lim in limits}
        binding = max(limits, key=lambda lim: values[lim.key] / lim.value_ms if math.isfinite(values[lim.key])
                      else math.inf)
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
            feasible=sustained and all(values[lim.key] <= lim.value_ms for lim in limits),
            total_input_tokens=m.total_input_tokens,
            stats=stats,
            binding=binding.key if limits.goodput_pct is None else GOODPUT,
            limits_key=limits.key,
        )

    @classmethod
    def of_probe(cls, m: ReplayMetrics, ev: Evidence, limits: Limits | float) -> CurvePoint:
        """A probe sized by evidence: feasible when its verdict passes (or, unsettled at the cap, when each limit's
        share over was within what it allows and it kept pace)."""
        limits = _limits(limits)
        point = cls.of(m, limits)
        ttft = limits.get("ttft", "p99")
        return cls(**{**point.__dict__, "sustained": m.completed > 0 and not ev.behind, "feasible": ev.passes,
                      "requests": ev.requests, "over_limit": ev.over_limit, "verdict": ev.verdict,
                      "effective_fraction": round(ev.independent_fraction, 3),
                      "limit_ms": ttft.value_ms if ttft is not None and len(limits) == 1 else None,
                      "over_indices": list(ev.over_indices), "limits": [p.to_dict() for p in ev.limits],
                      "binding": ev.binding})

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
    fit: RateAtLimit | None = None  # the rate at the limit, pooled over every probe (None: none passed)
    first_guess_rps: float | None = None  # where the search started, when a short burst's pace guessed it
    floor_rps: float | None = None  # the incumbent's floor: below it the search stopped (None: no floor)
    flat: bool = False  # the descent stopped: TTFT P99 did not fall as the rate fell (`latency_is_flat`)
    fit_limit: str | None = None  # the key of the limit whose fit is the rate at the limit (None: one TTFT limit)

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

    def violations(self, limits: Limits) -> dict[str, float]:
        """Each limit's constraint, as Optuna learns from it: how far the trial's point missed it, as a share of the
        limit (measured / limit - 1; <= 0 within it). A feasible trial: each limit's slack at its best point. An
        infeasible one: at its point closest to holding every limit (the lowest largest ratio), where at least one
        is positive (a point that missed on its count, its statistic within, counts a small miss on its binding
        limit)."""
        def ratios(p: CurvePoint) -> dict[str, float]:
            stats = p.stats or {"ttft": {"p99": p.ttft_p99_ms}}
            return {lim.key: limit_value_ms(stats, lim, limits) / lim.value_ms - 1 for lim in limits}

        if self.best is not None:
            return {k: min(v, 0.0) if math.isfinite(v) else 0.0 for k, v in ratios(self.best).items()}
        each = [(ratios(p), p) for p in self.points]
        scored = [(max(r.values()), r, p) for r, p in each if all(math.isfinite(v) for v in r.values())]
        if not scored:
            return {lim.key: CANNOT_MEASURE for lim in limits}
        _, found, point = min(scored, key=lambda t: t[0])
        if max(found.values()) <= 0:
            key = point.binding if point.binding in found else next(iter(found))
            found[key] = MISSED_ON_COUNT
        return found


CANNOT_MEASURE = 100.0  # the constraint of a limit no replay measured (no request completed): 100 x over it
MISSED_ON_COUNT = 0.01  # a point that missed its verdict with its statistic within: 1% over, so Optuna sees a miss


INCUMBENT_FLOOR = 0.9  # below 90% of the incumbent's rate a config cannot win: stop descending
BRACKET_STEP = 1.25  # from the first guess, up (it passed) or down (it failed) by this factor until it turns
BRACKET_PRECISION = 0.03  # bisect until passed and failed are within 3%, or the fit's interval is within +-3%
# ... and the fit's interval ends the bisection only once passed and failed are within 6% (two halvings of a
# BRACKET_STEP). Inside a wider bracket the fit puts the root where the curve's assumed shape does, with no probe
# near it: in one real study a run with 0 of 1000 over at 69.4 req/s and 10% over at 77.6 stopped
# at 76.5, where the same config's other rounds found 69.3-72. Over 95 confirmation runs of six real studies, the 40
# whose rate passed and rate failed were more than 6% apart when they stopped (11.8% or 25%: one halving of a step,
# or none) lay 4.5% (root mean square) from their config's median, the 55 within 6% 3.1% (benchmarks/stop_rule.py).
FIT_BRACKET = 0.06
# A confirmation run bisects to BRACKET_PRECISION whatever its fit says: the fit's root inside a wider bracket lies
# near its failed end (0.82 of the way in log over 120 runs of eleven real studies: a probe far past the limit, none
# between), so a run whose probe just under the crossing happened to pass reads 4-5% higher than one whose probe
# failed. On one engine and one draw, vLLM's defaults passed 78.2 req/s with 0 of 1000 over in one search and
# failed it with 29-203 of 800-1000 in three others, and read 81.5-81.8 against 77.3-77.8.
# The rounds compare these rates; the search only ranks its trials by them and keeps FIT_BRACKET.
RUN_FIT_BRACKET = 0.0

ProbeAt = Callable[[float], Awaitable[CurvePoint]]
# A descent in which nothing passed stops once a rate FLAT_DESCENT below the highest one tried still has at least
# FLAT_SHARE of its TTFT P99, while at both only a tail was over the limit (at most TAIL_SHARE of their requests): a
# tail that does not fall with the load is not queueing (a lone prefill past the limit, a server's own stalls), and
# lower rates only take longer to say so (a probe near 1% over runs to its cap). A queue is told apart by its share:
# past capacity most requests after the crossing are over, and a probe settles after a few dozen of them.
FLAT_DESCENT = BRACKET_STEP ** 2
FLAT_SHARE = 0.8
TAIL_SHARE = 0.1


def part_value_ms(p: CurvePoint, key: str | None) -> float:
    """The point's statistic for the limit `key` (None, or a point without that limit's part: its TTFT P99)."""
    part = next((d for d in p.limits or () if d["key"] == key), None) if key is not None else None
    if part is None or part.get("value_ms") is None:
        return p.ttft_p99_ms if key is None or key == "ttft:p99" else math.nan
    return float(part["value_ms"])


def latency_is_flat(points: list[CurvePoint]) -> bool:
    """Pure: no probe passed; the latest, at least FLAT_DESCENT below the highest rate tried, kept at least
    FLAT_SHARE of that rate's value of the limit it missed; and at both, at most TAIL_SHARE of the requests were over
    the limit."""
    if not points or any(p.feasible for p in points):
        return False

    def tail_only(p: CurvePoint) -> bool:
        return (math.isfinite(p.offered_rate_rps) and math.isfinite(part_value_ms(p, p.binding)) and bool(p.requests)
                and p.over_limit is not None and p.over_limit <= TAIL_SHARE * p.requests)

    measured = [p for p in points if math.isfinite(p.offered_rate_rps)]
    top, last = max(measured, key=lambda p: p.offered_rate_rps, default=None), points[-1]
    if top is None or not (tail_only(top) and tail_only(last)):
        return False
    return (top.offered_rate_rps >= FLAT_DESCENT * last.offered_rate_rps * (1 - 1e-3)  # rates stored rounded
            and part_value_ms(last, top.binding) >= FLAT_SHARE * part_value_ms(top, top.binding))


def probe_counts(points: list[CurvePoint], key: str | None = None) -> list[ProbeCount]:
    """The probes of a curve as the fit reads them, for the limit `key` (None: each probe's binding limit; points
    without counts, from fixed-length replays, are left out).

    A probe that fell behind counts every request it resolved as over: its queue grew over the arrivals, so at that
    rate the share over heads to 1 however few were over when its verdict stopped it. Its count alone (one over of
    202, say) would tell the fit the rate is safe, leave the interval open above, and put the rate at the limit above
    a rate the search saw fail."""
    def counts(p: CurvePoint) -> tuple[int | None, int | None, float, list[int] | None]:
        part = next((d for d in p.limits or () if d["key"] == key), None) if key is not None else None
        if part is None:
            return p.requests, p.over_limit, p.effective_fraction or 1.0, p.over_indices
        return part["requests"], part["over_limit"], part["independent_fraction"] or 1.0, part["over_indices"]

    out = []
    for p in points:
        requests, over, fraction, indices = counts(p)
        if not requests or over is None or not math.isfinite(p.offered_rate_rps):
            continue
        if p.verdict == FAIL and not p.sustained:
            out.append(ProbeCount(p.offered_rate_rps, requests, requests, fraction,
                                  None if indices is None else tuple(range(requests))))
        else:
            out.append(ProbeCount(p.offered_rate_rps, requests, over, fraction,
                                  None if indices is None else tuple(indices)))
    return out


def limit_shares(points: list[CurvePoint]) -> dict[str, float]:
    """The counted limits of a curve's probes and the share over each allows (a mean limit has no count)."""
    out: dict[str, float] = {}
    for p in points:
        for d in p.limits or ():
            if d.get("share") is not None:
                out.setdefault(d["key"], float(d["share"]))
    return out


def fit_at_limits(points: list[CurvePoint], **kwargs: Any) -> tuple[RateAtLimit | None, str | None]:
    """The rate at which every counted limit holds: each limit's pooled fit (rate_fit.py), and the lowest of them,
    with the key of the limit it belongs to (its interval: the lowest of each end). Probes without per-limit parts
    (probe_rule.Evidence of one count) fit that count."""
    shares = limit_shares(points)
    if not shares:  # probes without per-limit parts: their one count; mean limits alone: no count
        return (None, None) if any(p.limits for p in points) else (fit_rate_at_limit(probe_counts(points), **kwargs),
                                                                    None)
    fits = {key: fit_rate_at_limit(probe_counts(points, key), share=share, **kwargs) for key, share in shares.items()}
    if any(f is None for f in fits.values()):  # a limit met at no rate: no rate holds them all
        return None, next(k for k, f in fits.items() if f is None)
    found = {k: f for k, f in fits.items() if f is not None}
    key = min(found, key=lambda k: (found[k].rate_rps, math.isinf(found[k].high_rps)))
    low = min(f.low_rps for f in found.values())
    high = min(f.high_rps for f in found.values())
    best = found[key]
    return RateAtLimit(best.rate_rps, min(low, best.rate_rps), max(high, best.rate_rps), best.requests,
                       best.probes), key


def bisected_enough(points: list[CurvePoint], passed_rps: float, failed_rps: float,
                    precision: float = BRACKET_PRECISION, fit_bracket: float = FIT_BRACKET) -> bool:
    """Pure: whether a bisection between the highest rate passed and the lowest rate failed may stop: they are within
    `precision` of each other, or within `fit_bracket` and the pooled fit of `points` has an interval within
    +-`precision` (`fit_bracket` inf: the fit alone). While
    searching, the fit's is the counts' own precision: the profile interval without the bootstrap or a
    re-measurement's share (both widen it once, at the end; no count of requests takes the re-measurement's share
    away)."""
    if failed_rps <= passed_rps * (1 + precision):
        return True
    if failed_rps > passed_rps * (1 + fit_bracket):
        return False
    found, _ = fit_at_limits(points, resamples=0, remeasure_cv=0.0)
    return found is not None and found.half_width <= precision


def widened(step: float) -> float:
    """Pure: a step widened after steps that did not cross the limit: squared, up to BRACKET_STEP (a step of
    BRACKET_STEP or more stays as it is). From a prior's 5.9%: 12.1%, then 25%."""
    return step if step >= BRACKET_STEP else min(step * step, BRACKET_STEP)


async def search_rate(probe_at: ProbeAt, spec: RateSearchSpec, start_rps: float,
                      floor_rps: float | None = None, failed_rps: float | None = None,
                      precision: float = BRACKET_PRECISION, fit_bracket: float = FIT_BRACKET,
                      step: float = BRACKET_STEP) -> RateSearchResult:
    """The rate at the limit, from `start_rps`, in at most `spec.max_replays` probes; `probe_at(rate)` runs one.

    With `floor_rps` (0.9 x the incumbent's lower bound: search/incumbent.py), the descent probes the floor once and
    stops below it: a config that meets the limit only there cannot win, and the trial ends `stopped_early`. A
    descent whose TTFT P99 does not fall with the rate stops too (`latency_is_flat`), marked `flat`.
    `failed_rps`, when known (a confirmation run's: its search trial's failed rate, or just over its prior), is where
    the first step up goes. `step` is the factor of the first step up or down: BRACKET_STEP from a guess, finer from a
    prior as close as a confirmation's earlier rounds (search/confirm.py::prior_spec); from the third probe on each
    step the same way squares it, up to BRACKET_STEP (`widened`), so a rate that moved far since the prior is still
    reached within the probes, and a tail that does not fall with the load is still told (`latency_is_flat`). The
    result's best point is the highest rate that passed; its fit pools every probe."""
    result = RateSearchResult(floor_rps=floor_rps)
    lo: float | None = None  # the highest rate passed
    hi: float | None = None  # the lowest rate failed
    rate = start_rps
    while len(result.points) < spec.max_replays and rate >= spec.min_rate_rps:
        point = await probe_at(rate)
        result.points.append(point)
        if point.feasible:
            lo = rate if lo is None else max(lo, rate)
        else:
            hi = rate if hi is None else min(hi, rate)
        if lo is None:  # nothing passed yet: down, to the floor at the lowest, while the tail falls with the load
            if floor_rps is not None and rate <= floor_rps * (1 + 1e-9):
                result.stopped_early = True
                break
            if latency_is_flat(result.points):
                result.flat = True
                break
            rate = rate / step if floor_rps is None else max(rate / step, floor_rps)
        elif hi is None:  # everything passed so far: up, nothing caps it
            rate = failed_rps if failed_rps is not None and failed_rps > lo and len(result.points) == 1 \
                else lo * step
        elif bisected_enough(result.points, lo, hi, precision, fit_bracket):
            break
        else:
            rate = math.sqrt(lo * hi)
            continue
        if len(result.points) >= 2:  # a step that did not cross the limit: the next one the same way is wider
            step = widened(step)
    passed = [p for p in result.points if p.feasible]
    result.best = max(passed, key=lambda p: p.offered_rate_rps, default=None)
    result.fit, result.fit_limit = fit_at_limits(result.points)
    return result
