"""A trial's measurement as the objective stores it (its RESULT attribute): the rate at the limits, the point it
chose, and the limit that bound it, made once from its rate search.

The limit that *bound* a trial is the one its rate could not pass: at the lowest rate tried above its best (the
rate it failed), the limit that probe's verdict rests on, with what was measured there ("TPOT P99 61 ms > 50 ms at
48.2 req/s"). A trial that met its limits nowhere is bound at its closest point; one that passed every rate it tried
is bound by nothing yet (its rate is a lower bound).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optimizer.config.limits import Limit, Limits
from optimizer.measurement.rate_search import CurvePoint, RateSearchResult
from optimizer.measurement.rerank import point_value_ms, worst_ratio

MEASUREMENT = "probes sized by evidence, pooled fit"  # how each stored trial was measured
MEASURED_BEFORE = "fixed-length replays"  # trials stored before have no such entry


@dataclass(frozen=True)
class Bound:
    """The limit that bound a trial, what was measured of it, and where."""

    limit: Limit
    measured_ms: float
    rate_rps: float | None  # None: at no Poisson rate (the burst)

    @property
    def text(self) -> str:
        """'TPOT P99 61 ms > 50 ms at 48.2 req/s'."""
        return self.limit.over_text(self.measured_ms, self.rate_rps if self.rate_rps is not None else math.inf)

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit.key, "measured_ms": None if not math.isfinite(self.measured_ms)
                else round(self.measured_ms, 3), "rate_rps": self.rate_rps, "text": self.text}


def values_at(p: CurvePoint, limits: Limits) -> dict[str, float]:
    """Each limit's statistic at the point, by key (NaN where not measured), as a stored point reads
    (measurement/rerank.py::point_value_ms)."""
    return {lim.key: point_value_ms(p.__dict__, lim, limits) for lim in limits}


def closest_point(points: Sequence[CurvePoint], limits: Limits) -> CurvePoint:
    """The point nearest to holding every limit: the lowest largest ratio of measured to limit."""
    return min(points, key=lambda p: worst_ratio(p.__dict__, limits))


def binding_limit(p: CurvePoint, limits: Limits) -> Limit:
    """The limit the point's verdict rests on, or (a point without one) the one it is furthest over."""
    found = next((lim for lim in limits if lim.key == p.binding), None)
    if found is not None:
        return found
    values = values_at(p, limits)
    return max(limits, key=lambda lim: values[lim.key] / lim.value_ms if math.isfinite(values[lim.key]) else -1.0)


def bound_by(search: RateSearchResult, limits: Limits) -> Bound | None:
    """The limit that bound the trial (see the module's docstring); None when nothing bound it."""
    if not search.points:
        return None
    if search.best is None:
        p = closest_point(search.points, limits)
    else:
        failed = search.failed_rate_rps
        above = [p for p in search.points if failed is not None and p.offered_rate_rps == failed and not p.feasible]
        if not above:
            return None
        p = above[0]
    lim = binding_limit(p, limits)
    rate = p.offered_rate_rps if math.isfinite(p.offered_rate_rps) else None
    return Bound(lim, values_at(p, limits)[lim.key], rate)


def trial_result(search: RateSearchResult, point: CurvePoint, limits: Limits) -> dict[str, Any]:
    """The trial's stored RESULT: its rate at the limits, its chosen point's numbers, and what bound it."""
    bound = bound_by(search, limits)
    values = values_at(point, limits)
    return {"measurement": MEASUREMENT if search.points and search.points[0].requests is not None
            else MEASURED_BEFORE,
            "limits": limits.key,
            "rate_at_limit": search.fit.to_dict() if search.fit is not None else None,
            "fit_limit": search.fit_limit,
            "first_guess_rps": search.first_guess_rps, "floor_rps": search.floor_rps,
            "requests": sum(p.requests or 0 for p in search.points),
            "feasible": search.feasible, "stopped_early": search.stopped_early, "flat": search.flat,
            "rate_rps": point.offered_rate_rps if math.isfinite(point.offered_rate_rps) else None,
            "failed_rate_rps": search.failed_rate_rps,
            "output_throughput_tok_s": point.output_throughput_tok_s,
            "request_throughput_rps": point.request_throughput_rps,
            "ttft_p50_ms": point.ttft_p50_ms, "ttft_p99_ms": point.ttft_p99_ms,
            "tpot_p99_ms": point.tpot_p99_ms, "requests_at_rate": point.requests,
            "over_limit_at_rate": point.over_limit, "answered_at_rate": point.completed,
            "behind_at_rate": point.requests is not None and point.completed > 0 and not point.sustained,
            "values_at_rate_ms": {k: (None if not math.isfinite(v) else round(v, 3)) for k, v in values.items()},
            "bound_by": bound.to_dict() if bound is not None else None}


def bound_text(result: Mapping[str, Any]) -> str | None:
    """The stored trial's binding limit in words ('TPOT P99 61 ms > 50 ms at 48.2 req/s'); None without one."""
    bound = result.get("bound_by")
    return bound.get("text") if isinstance(bound, Mapping) else None
