"""Pure: re-rank a finished study for other latency limits from its stored curves, without rerunning anything.

Every trial stores each replay of its rate search as one curve point, with every metric's statistics. For a set of
limits, a point judged at those very limits answers by its verdict; at other limits, it qualifies when its rate was
sustained and each limit's statistic is within it; the trial's answer is the qualifying point with the
highest offered rate (a burst, stored with rate None, counts as the highest), and its throughput is that point's
output tokens/s. Only measured points can answer, so each answer says how far it can be trusted (`Answer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from optimizer.config.limits import Limit, Limits
from optimizer.measurement.noise import coefficient_of_variation, median

Point = Mapping[str, Any]


class Answer(str, Enum):
    """How far the stored points answer one trial for one limit."""

    CEILING = "ceiling"  # the burst qualifies: no arrival pattern offers more
    MEASURED = "measured"  # a higher Poisson rate was tried and missed: the best rate lies in between
    LOWER_BOUND = "lower bound"  # no higher Poisson rate was tried: the true best may be higher
    NO_POINT = "no stored point"  # no stored replay meets the limit; an untried lower rate might
    NOT_RUN = "cannot run"  # the trial stored no curve (it was pruned before measuring)

    @property
    def answerable(self) -> bool:
        return self in (Answer.CEILING, Answer.MEASURED, Answer.LOWER_BOUND)


def rate_key_rps(point: Point) -> float:
    """The point's offered rate for ordering: a burst (rate None) is infinite."""
    rate = point.get("offered_rate_rps")
    return math.inf if rate is None else float(rate)



def as_limits(limits: Limits | float) -> Limits:
    """A float is a TTFT P99 limit in milliseconds."""
    return limits if isinstance(limits, Limits) else Limits.ttft_p99(float(limits))


def point_value_ms(point: Point, limit: Limit, limits: Limits | None = None) -> float:
    """The limit's statistic at a stored point: from its stats, else from the limit's own part of its verdict; under
    goodput, each metric's stored percentile at the goodput share (`Limits.stat_of`)."""
    stat = limit.stat if limits is None else limits.stat_of(limit)
    value = ((point.get("stats") or {}).get(limit.metric) or {}).get(stat)
    if value is None:
        part = next((d for d in point.get("limits") or () if d.get("key") == limit.key), None)
        value = None if part is None else part.get("value_ms")
    return math.nan if value is None else float(value)


def judged_at(point: Point, limits: Limits) -> bool:
    """The point's verdict was settled at exactly these limits."""
    return point.get("verdict") is not None and point.get("limits_key") == limits.key


def qualifies(point: Point, limits: Limits | float) -> bool:
    """A point judged at these limits answers by its verdict (the counts over each: measurement/probe_rule.py); at
    other limits, sustained and each limit's statistic within it (a statistic the point did not store, or a NaN
    from a replay with no completion, never qualifies)."""
    limits = as_limits(limits)
    if judged_at(point, limits):
        return bool(point.get("feasible"))
    if not point.get("sustained"):
        return False
    return all(point_value_ms(point, lim, limits) <= lim.value_ms for lim in limits)


def worst_ratio(point: Point, limits: Limits) -> float:
    """The largest ratio of measured to limit over the limits (inf where one is not measured)."""
    ratios = [point_value_ms(point, lim, limits) / lim.value_ms for lim in limits]
    return max(ratios) if all(math.isfinite(r) for r in ratios) else math.inf


@dataclass(frozen=True)
class Ranked:
    """One trial's answer for one limit."""

    answer: Answer
    point: Point | None = None  # the chosen qualifying point
    next_rate_rps: float | None = None  # MEASURED: the lowest tried Poisson rate above the chosen one (it missed)
    closest: Point | None = None  # NO_POINT: the stored point nearest to holding every limit
    latency_ms: float = math.nan  # the first limit's statistic at the chosen point: the front's latency axis

    @property
    def answerable(self) -> bool:
        return self.answer.answerable

    @property
    def output_throughput_tok_s(self) -> float:
        return float(self.point["output_throughput_tok_s"]) if self.point is not None else math.nan

    @property
    def ttft_p99_ms(self) -> float:
        return float(self.point["ttft_p99_ms"]) if self.point is not None else math.nan

    @property
    def rate_rps(self) -> float | None:
        """The chosen offered rate in requests/s; None for a burst or when there is no answer."""
        return None if self.point is None else self.point.get("offered_rate_rps")


def _median_of(values: Sequence[Any]) -> float | None:
    found = [float(v) for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return median(found) if found else None


def merge_repeats(curve: Sequence[Point]) -> list[Point]:
    """Replays at the same offered rate (a trial's repeats) become one point: the median of each number, sustained
    when most were, with `replays` (how many) and `output_throughput_cv` (their coefficient of variation)."""
    groups: dict[Any, list[Point]] = {}
    for p in curve:
        groups.setdefault(p.get("offered_rate_rps"), []).append(p)
    out: list[Point] = []
    for rate, points in groups.items():
        if len(points) == 1:
            out.append(points[0])
            continue
        merged: dict[str, Any] = dict(points[0])
        for key, value in points[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "offered_rate_rps":
                values = [float(p[key]) for p in points if isinstance(p.get(key), (int, float))
                          and not math.isnan(p[key])]
                merged[key] = median(values) if values else math.nan
        if all(isinstance(p.get("stats"), Mapping) for p in points):  # each statistic: the median of the replays'
            merged["stats"] = {metric: {stat: _median_of([p["stats"].get(metric, {}).get(stat) for p in points])
                                        for stat in stats} for metric, stats in points[0]["stats"].items()}
        for key in ("sustained", "feasible"):
            if key in points[0]:
                merged[key] = 2 * sum(bool(p.get(key)) for p in points) > len(points)
        merged["replays"] = len(points)
        merged["output_throughput_cv"] = coefficient_of_variation([float(p["output_throughput_tok_s"])
                                                                   for p in points])
        out.append(merged)
    return out


def rank_curve(curve: Sequence[Point] | None, limits: Limits | float) -> Ranked:
    """The trial's best point for `limits`, and how far the stored points vouch for it. Repeated replays at one
    rate count as one point, their medians (`merge_repeats`)."""
    limits = as_limits(limits)
    if not curve:
        return Ranked(Answer.NOT_RUN)
    curve = merge_repeats(curve)
    good = [p for p in curve if qualifies(p, limits)]
    if not good:
        finite = [p for p in curve if math.isfinite(worst_ratio(p, limits))]
        closest = min(finite, key=lambda p: worst_ratio(p, limits), default=None)
        return Ranked(Answer.NO_POINT, closest=closest)
    best = max(good, key=lambda p: (rate_key_rps(p), p["output_throughput_tok_s"]))
    latency = point_value_ms(best, limits.first, limits)
    rate = rate_key_rps(best)
    if math.isinf(rate):
        return Ranked(Answer.CEILING, point=best, latency_ms=latency)
    # The burst is not a Poisson rate: it bounds throughput but does not bracket the best sustainable rate.
    above = [rate_key_rps(p) for p in curve if rate < rate_key_rps(p) < math.inf]
    if not above:
        return Ranked(Answer.LOWER_BOUND, point=best, latency_ms=latency)
    return Ranked(Answer.MEASURED, point=best, next_rate_rps=min(above), latency_ms=latency)


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """(throughput, latency at the first limit): `a` is at least as good in both and better in one."""
    return a[0] >= b[0] and a[1] <= b[1] and a != b


def pareto_front(ranked: Mapping[int, Ranked]) -> list[int]:
    """Keys of the answerable entries no other answerable entry dominates, highest throughput first."""
    pts = {k: (r.output_throughput_tok_s, r.latency_ms if math.isfinite(r.latency_ms) else r.ttft_p99_ms)
           for k, r in ranked.items() if r.answerable}
    front = [k for k, p in pts.items() if not any(dominates(q, p) for j, q in pts.items() if j != k)]
    return sorted(front, key=lambda k: (-pts[k][0], pts[k][1], k))


def recommend(ranked: Mapping[int, Ranked]) -> int | None:
    """The key of the answerable entry with the highest throughput (ties: lower latency, then lower key)."""
    front = pareto_front(ranked)
    return front[0] if front else None
