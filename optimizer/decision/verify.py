"""`optimize verify`: measure the best configs again under other traffic before anyone deploys them.

Each candidate (the recommendation and the next best feasible trials) runs on a fresh engine at the rate it was
recommended for, under variants of the study's workload: other arrival seeds, burstier arrivals (gamma, as
`vllm bench serve --burstiness 0.5`) and a surge of long prompts. The worst case of each limit's statistic is
compared with that limit. Among the candidates within a small throughput margin of the best, the most robust one is
recommended: it holds every limit under every variant, with the most headroom (the lowest largest ratio of measured
to limit, over the limits and the variants), and on a tie the lower memory fraction (the last percent of
`gpu_memory_utilization` is what goes out of memory under bursts).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from optimizer.config.limits import Limit, Limits
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.clock import Clock, MonotonicClock
from optimizer.core.units import format_ms
from optimizer.decision.tables import limit_column
from optimizer.measurement.engine import EngineFactory
from optimizer.measurement.engine_watch import WatchedEngine
from optimizer.measurement.metrics import summarize
from optimizer.measurement.rate_search import CurvePoint
from optimizer.measurement.replay import replay
from optimizer.measurement.rerank import point_value_ms, worst_ratio
from optimizer.measurement.workload import build_workload
from optimizer.search.attrs import ENGINE_CONFIG, ENGINE_PARAMS
from optimizer.search.measured import measurement_of

BURSTY_SHAPE = 0.5
SURGE_FRACTION = 0.3


@dataclass(frozen=True)
class Variant:
    name: str
    workload: WorkloadSpec


def variants(spec: WorkloadSpec, max_model_len: int, seeds: int) -> list[Variant]:
    """The study's workload under other seeds, burstier arrivals and a surge of long prompts."""
    out = [Variant(f"seed {spec.seed + k}", spec.model_copy(update={"seed": spec.seed + k})) for k in range(1, seeds + 1)]
    out.append(Variant(f"bursty (gamma {BURSTY_SHAPE})", spec.model_copy(update={"burstiness": BURSTY_SHAPE})))
    if not spec.trace:
        long_max = max(spec.input_len_max, min(2 * spec.input_len_max, max_model_len - spec.output_len_max))
        long_min = max(spec.input_len_min, (spec.input_len_max + long_max) // 2)
        # one name for every config, so that the report has one column per variant (the range fits each config)
        out.append(Variant(f"long prompts ({SURGE_FRACTION:.0%})",
                           spec.model_copy(update={"long_prompt_fraction": SURGE_FRACTION,
                                                   "long_input_len_min": long_min, "long_input_len_max": long_max})))
    return out


@dataclass(frozen=True)
class Verified:
    """One candidate under every variant."""

    trial_number: int
    throughput_tok_s: float
    rate_rps: float | None
    gpu_memory_utilization: float | None
    points: dict[str, dict[str, Any]]  # variant -> CurvePoint as a dict
    error: str = ""

    def worst_ms(self, limit: Limit, limits: Limits) -> float:
        """`limit`'s statistic under the worst variant (inf after an error, with no variant measured, or where a
        variant did not measure it)."""
        values = [point_value_ms(p, limit, limits) for p in self.points.values()]
        if not values or self.error:
            return math.inf
        return max(v if math.isfinite(v) else math.inf for v in values)

    def worst_ratio(self, limits: Limits) -> float:
        """The headroom left under the worst variant: the largest ratio of measured to limit over the variants and
        the limits (1: at a limit; inf after an error)."""
        ratios = [worst_ratio(p, limits) for p in self.points.values()]
        return max(ratios) if ratios and not self.error else math.inf

    def missed(self, limits: Limits) -> list[Limit]:
        """The limits its worst variant is over."""
        return [lim for lim in limits if self.worst_ms(lim, limits) > lim.value_ms]

    def holds(self) -> bool:
        return not self.error and bool(self.points) and all(p["feasible"] for p in self.points.values())

    def to_dict(self, limits: Limits) -> dict[str, Any]:
        """The result as plain data: each limit's worst case by its key ('tpot:p99': ms; None where not measured)."""
        worst = {lim.key: self.worst_ms(lim, limits) for lim in limits}
        return {**asdict(self), "worst_ms": {k: v if math.isfinite(v) else None for k, v in worst.items()},
                "holds": self.holds()}


def robust_choice(results: list[Verified], margin: float, limits: Limits) -> Verified | None:
    """Pure: among candidates within `margin` of the best throughput, the one that holds every limit under every
    variant with the most headroom (the lowest worst ratio of measured to limit); ties go to the lower memory
    fraction. None if none holds."""
    if not results:
        return None
    best = max(r.throughput_tok_s for r in results)
    close = [r for r in results if r.throughput_tok_s >= (1 - margin) * best and r.holds()]
    if not close:
        return None
    return min(close, key=lambda r: (round(r.worst_ratio(limits), 3), r.gpu_memory_utilization or 0.0,
                                     -r.throughput_tok_s))


async def verify_trial(trial: FrozenTrial, config: StudyConfig, engine_factory: EngineFactory, vocab_size: int,
                       seeds: int, log_path: Path, clock: Clock | None = None) -> Verified:
    """Start the trial's config once and replay every variant at its recommended rate, cold each time."""
    clock = clock or MonotonicClock()
    params = dict(ENGINE_PARAMS.of(trial))
    resolved = ENGINE_CONFIG.of(trial)
    m = measurement_of(trial)
    rate = m.rate_rps if m is not None else None
    rate_rps = math.inf if rate is None else float(rate)
    common = dict(trial_number=trial.number, throughput_tok_s=float(trial.values[0]), rate_rps=rate,
                  gpu_memory_utilization=resolved.get("gpu_memory_utilization"))
    engine = WatchedEngine(engine_factory())
    points: dict[str, dict[str, Any]] = {}

    async def measure() -> None:
        await engine.start(params, log_path)
        warm = build_workload(config.workload, vocab_size).warmup
        if warm:
            await replay(engine, warm, [0.0] * len(warm), clock)
        for v in variants(config.workload, int(resolved.get("max_model_len") or config.workload.max_total_len),
                          seeds):
            workload = build_workload(v.workload, vocab_size)
            await engine.reset_prefix_cache()
            records = await replay(engine, workload.requests, workload.arrivals_s(rate_rps), clock)
            point = CurvePoint.of(summarize(records, rate_rps), config.limits)
            points[v.name] = point.to_dict()

    try:
        await engine.guard(measure())  # an engine death ends it at once, not after the rest of its schedule
    except Exception as exc:  # a config that cannot even run its own traffic again is not robust
        return Verified(**common, points=points, error=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        await engine.shutdown()
    return Verified(**common, points=points)


def values_heading(limits: Limits) -> str:
    """What each variant's cell of `report_rows` holds: 'each variant: TTFT P99 / TPOT P99, against TTFT P99 <= 150ms,
    TPOT P99 <= 50ms'."""
    return f"each variant: {' / '.join(lim.name for lim in limits)}, against {limits.text}"


def _ms(value_ms: float) -> str:
    return f"{value_ms:.0f}" if math.isfinite(value_ms) else "n/a"


def report_rows(results: list[Verified], limits: Limits, chosen: Verified | None) -> list[dict[str, Any]]:
    """One row per candidate: each variant's statistics ('80/41ms ok', in the order of `limits`; a miss names the
    limits it is over), the worst of each limit (`worst_tpot_p99`), and the verdict."""
    rows = []
    for r in results:
        row: dict[str, Any] = {"trial": r.trial_number, "output_tok_s": round(r.throughput_tok_s, 1),
                               "rate_rps": "burst" if r.rate_rps is None else round(r.rate_rps, 2)}
        for name, p in r.points.items():
            values = [point_value_ms(p, lim, limits) for lim in limits]
            over = [lim.name for lim, v in zip(limits, values) if not v <= lim.value_ms]
            missed = "MISS" if len(limits) == 1 or not over else f"MISS {', '.join(over)}"
            mark = "ok" if p["feasible"] else (missed if p["sustained"] else "not sustained")
            row[name] = f"{'/'.join(_ms(v) for v in values)}ms {mark}"
        for lim in limits:
            worst = r.worst_ms(lim, limits)
            row[f"worst_{limit_column(lim, limits).removesuffix('_ms')}"] = "error" if r.error else f"{_ms(worst)}ms"
        over = ", ".join(f"{lim.name} {format_ms(lim.value_ms)}" for lim in r.missed(limits))
        row["verdict"] = ("recommended" if chosen is r else "holds" if r.holds() else
                          f"fails ({r.error})" if r.error else f"misses {over}" if over else
                          "falls behind under a variant")
        rows.append(row)
    return rows
