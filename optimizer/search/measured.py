"""A trial's measurement: one typed value (`TrialMeasurement`), made once by its objective from its rate search and
read by every later stage through one reader (`measurement_of`): the rate at the limits with its interval, the point
it chose, each limit's value there, the limit that bound it, and every probe of its curve. It is stored as two trial
attributes (search/attrs.py: RESULT, and CURVE for the probes) with a schema version; a trial stored by an older
optimizer, without it, is refused in one line rather than half read.

The limit that *bound* a trial is the one its rate could not pass: at the lowest rate tried above its best (the
rate it failed), the limit that probe's verdict rests on, with what was measured there ("TPOT P99 61 ms > 50 ms at
48.2 req/s"). A trial that met its limits nowhere is bound at its closest point; one that passed every rate it tried
is bound by nothing yet (its rate is a lower bound).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from optimizer.config.limits import Limit, Limits
from optimizer.core.errors import UsageError
from optimizer.measurement.rate_fit import RateAtLimit
from optimizer.measurement.rate_search import CurvePoint, RateSearchResult
from optimizer.measurement.rerank import point_value_ms, worst_ratio
from optimizer.search.attrs import CURVE, RESULT, HasUserAttrs

MEASUREMENT = "probes sized by evidence, pooled fit"  # how a trial was measured: a rate search
FIXED_LENGTH = "fixed-length replays"  # ... or replays of the full workload at a rate the workload fixes


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

    def to_dict_fields(self) -> dict[str, Any]:
        """As StoredBound's fields."""
        return {"limit_key": self.limit.key, "measured_ms": None if not math.isfinite(self.measured_ms)
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


SCHEMA = 2  # the stored form of a trial's measurement; trials stored before it carry none (version 1)


class OlderSchemaError(UsageError):
    """A trial stored in a form of its measurement this optimizer does not read (an older one's, or a newer's)."""


def older_schema_line(what: str, found: object) -> str:
    if isinstance(found, int) and found > SCHEMA:
        return (f"{what} was stored by a newer optimizer (trial measurement schema {found}; this optimizer reads "
                f"schema {SCHEMA}): upgrade this optimizer to read it")
    return (f"{what} was stored by an older optimizer (trial measurement schema {found or 1}; this optimizer reads "
            f"schema {SCHEMA}): start a new study under another --study name, or read this one with the optimizer "
            f"that made it")


@dataclass(frozen=True)
class StoredBound:
    """The limit that bound a trial, as stored: its key, what was measured, where, and in words."""

    limit_key: str
    measured_ms: float | None
    rate_rps: float | None
    text: str


@dataclass(frozen=True)
class TrialMeasurement:
    """One trial's measurement, made once by its objective (`of_search`) and read by every stage after it through
    `measurement_of`: its rate at the limits with its interval, the point it chose and each limit's value there, the
    limit that bound it, and its curve (every probe: its rate, every metric's statistics, its verdict and counts)."""

    limits_key: str | None
    feasible: bool
    rate_rps: float | None  # the chosen point's offered rate (None: a burst)
    failed_rate_rps: float | None  # the lowest rate tried above it that failed
    rate_at_limit: RateAtLimit | None  # the pooled fit of every probe, with its 95% interval
    fit_limit: str | None  # the key of the limit whose fit it is
    first_guess_rps: float | None
    floor_rps: float | None
    requests: int  # every request its probes resolved
    stopped_early: bool
    flat: bool
    output_throughput_tok_s: float
    request_throughput_rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    values_at_rate_ms: dict[str, float | None]  # each limit's statistic at the chosen point, by key
    requests_at_rate: int | None  # the counts of its probe at the chosen rate
    over_limit_at_rate: int | None
    answered_at_rate: int | None
    behind_at_rate: bool
    bound: StoredBound | None
    curve: tuple[dict[str, Any], ...] = ()  # every replay in the order run (search/attrs.py CURVE)
    gpus: int | None = None  # where the study's layouts differ: the GPUs its layout takes
    method: str = MEASUREMENT
    schema: int = SCHEMA

    @classmethod
    def of_search(cls, search: RateSearchResult, point: CurvePoint, limits: Limits,
                  curve: Sequence[dict[str, Any]] = ()) -> TrialMeasurement:
        """The measurement of a finished rate search, at its chosen point."""
        found = bound_by(search, limits)
        values = values_at(point, limits)
        finite = (lambda v: v if v is not None and math.isfinite(v) else None)
        return cls(
            limits_key=limits.key, feasible=search.feasible,
            rate_rps=finite(point.offered_rate_rps), failed_rate_rps=search.failed_rate_rps,
            rate_at_limit=search.fit, fit_limit=search.fit_limit,
            first_guess_rps=search.first_guess_rps, floor_rps=search.floor_rps,
            requests=sum(p.requests or 0 for p in search.points), stopped_early=search.stopped_early,
            flat=search.flat, output_throughput_tok_s=point.output_throughput_tok_s,
            request_throughput_rps=point.request_throughput_rps, ttft_p50_ms=point.ttft_p50_ms,
            ttft_p99_ms=point.ttft_p99_ms, tpot_p99_ms=point.tpot_p99_ms,
            values_at_rate_ms={k: (None if not math.isfinite(v) else round(v, 3)) for k, v in values.items()},
            requests_at_rate=point.requests, over_limit_at_rate=point.over_limit, answered_at_rate=point.completed,
            behind_at_rate=point.requests is not None and point.completed > 0 and not point.sustained,
            bound=None if found is None else StoredBound(**found.to_dict_fields()),
            curve=tuple(curve),
            method=MEASUREMENT if search.points and search.points[0].requests is not None else FIXED_LENGTH)

    def to_stored(self) -> dict[str, Any]:
        """The RESULT attribute (search/attrs.py): every field but the curve, which is stored as CURVE."""
        d = {k: v for k, v in self.__dict__.items()
             if k not in ("curve", "bound", "rate_at_limit", "method", "limits_key")}
        d["measurement"], d["limits"] = self.method, self.limits_key
        d["rate_at_limit"] = None if self.rate_at_limit is None else self.rate_at_limit.to_dict()
        d["bound_by"] = None if self.bound is None else {
            "limit": self.bound.limit_key, "measured_ms": self.bound.measured_ms, "rate_rps": self.bound.rate_rps,
            "text": self.bound.text}
        return d

    @classmethod
    def from_stored(cls, result: Mapping[str, Any], curve: Sequence[dict[str, Any]]) -> TrialMeasurement:
        """The measurement as RESULT and CURVE hold it (of the current SCHEMA: `measurement_of` checks)."""
        fit, bound = result.get("rate_at_limit"), result.get("bound_by")
        return cls(
            limits_key=result.get("limits"), feasible=bool(result.get("feasible")), rate_rps=result.get("rate_rps"),
            failed_rate_rps=result.get("failed_rate_rps"),
            rate_at_limit=None if not fit else RateAtLimit.from_dict(fit), fit_limit=result.get("fit_limit"),
            first_guess_rps=result.get("first_guess_rps"), floor_rps=result.get("floor_rps"),
            requests=int(result.get("requests") or 0), stopped_early=bool(result.get("stopped_early")),
            flat=bool(result.get("flat")),
            output_throughput_tok_s=_float(result.get("output_throughput_tok_s")),
            request_throughput_rps=_float(result.get("request_throughput_rps")),
            ttft_p50_ms=_float(result.get("ttft_p50_ms")), ttft_p99_ms=_float(result.get("ttft_p99_ms")),
            tpot_p99_ms=_float(result.get("tpot_p99_ms")),
            values_at_rate_ms=dict(result.get("values_at_rate_ms") or {}),
            requests_at_rate=result.get("requests_at_rate"), over_limit_at_rate=result.get("over_limit_at_rate"),
            answered_at_rate=result.get("answered_at_rate"), behind_at_rate=bool(result.get("behind_at_rate")),
            bound=None if not isinstance(bound, Mapping) else StoredBound(
                str(bound.get("limit")), bound.get("measured_ms"), bound.get("rate_rps"), str(bound.get("text"))),
            curve=tuple(curve), gpus=result.get("gpus"), method=str(result.get("measurement") or MEASUREMENT),
            schema=int(result["schema"]))

    @property
    def fit(self) -> RateAtLimit | None:
        """The pooled fit's rate at the limits, where the trial met them at some rate."""
        return self.rate_at_limit if self.feasible else None

    @property
    def rate_interval_rps(self) -> tuple[float, float] | None:
        """The rate at the limits as its 95% interval (low, high; high inf for a lower bound); None where it has no
        fit (measured by fixed-length replays, or the limits met nowhere)."""
        return None if self.rate_at_limit is None else (self.rate_at_limit.low_rps, self.rate_at_limit.high_rps)

    @property
    def bound_text(self) -> str | None:
        """Its binding limit in words ('TPOT P99 61 ms > 50 ms at 48.2 req/s'); None without one."""
        return None if self.bound is None else self.bound.text

    def replays_at(self, rate_rps: float | None) -> int:
        """How many of its replays ran at `rate_rps` (None: the burst)."""
        return sum(1 for p in self.curve if p.get("offered_rate_rps") == rate_rps)

    def with_gpus(self, gpus: int) -> TrialMeasurement:
        return replace(self, gpus=gpus)


def _float(v: Any) -> float:
    return math.nan if v is None else float(v)


def write_measurement(trial: HasUserAttrs, m: TrialMeasurement) -> None:
    """Store the trial's measurement, once, by its objective: its curve (CURVE), then the rest (RESULT), which marks
    it whole: a trial stopped between the two writes reads as one that stored none."""
    CURVE.set(trial, list(m.curve))
    RESULT.set(trial, m.to_stored())


def measurement_of(trial: HasUserAttrs) -> TrialMeasurement | None:
    """The one reader of a trial's stored measurement; None where it stored none (it could not run, or ended before
    its measurement). A trial stored by an older optimizer raises OlderSchemaError, one line that names its version."""
    result = RESULT.of(trial)
    if not result:  # none, or its curve alone: stopped before its measurement was whole
        return None
    if result.get("schema") != SCHEMA:
        number = getattr(trial, "number", None)
        raise OlderSchemaError(older_schema_line("trial" if number is None else f"trial #{number}",
                                                 result.get("schema")))
    return TrialMeasurement.from_stored(result, CURVE.of(trial))


def check_schema(study: Any, trials: Sequence[Any] | None = None) -> None:
    """Refuse, in one line, a study whose trials an older optimizer stored (OlderSchemaError)."""
    for t in study.get_trials(deepcopy=False) if trials is None else trials:
        result = RESULT.of(t)
        if result and result.get("schema") != SCHEMA:
            raise OlderSchemaError(older_schema_line(f"study {study.study_name!r}", result.get("schema")))
