"""Repeated measurements of one config: replays at its best rate, and a confirmation that steps the rate
down when the repeats miss the limit."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from optimizer.measurement.rate_search import CurvePoint, RateSearchResult
from optimizer.config.limits import Limits
from optimizer.measurement.rerank import merge_repeats, qualifies, rank_curve


# When the repeats' medians at the best rate miss the limit: measure again this much lower, at most this often.
REPEAT_STEP_DOWN = 0.85


REPEAT_STEP_DOWNS = 3


async def confirm_best(result: RateSearchResult, replay_at: Callable[[float], Any], repeats: int,
                       limits: Limits) -> None:
    """The best rate again, cold, `repeats` - 1 times: how much of the number is noise. When the medians there
    miss the limit, the search's one pass was a lucky replay: step down (REPEAT_STEP_DOWN) and measure again there,
    so that a config that holds the limit at some rate (vLLM's defaults, measured 3 times) is not declared
    infeasible by one unlucky repeat. Every replay goes to `result.repeats`, in the order it ran."""
    assert result.best is not None
    rate = result.best.offered_rate_rps
    for step in range(REPEAT_STEP_DOWNS + 1):
        if step:
            rate *= REPEAT_STEP_DOWN
            first = CurvePoint.of(await replay_at(rate), limits)
            result.repeats.append(first)
            if not first.feasible:
                continue
        for _ in range(repeats - 1):
            result.repeats.append(CurvePoint.of(await replay_at(rate), limits))
        if with_repeats(result, limits).best is not None:
            return


async def measure_fixed_load(replay_at: Callable[[float], Any], rate_rps: float, limits: Limits,
                             spec: Any, repeats: int = 1) -> RateSearchResult:
    """Replays at a load the workload fixes (closed-loop clients: `rate_rps` inf; a trace at its own
    timestamps: its rate), no rate search; `repeats` - 1 more when the first is feasible. A closed loop keeps pace
    by construction, so it is sustained when every request completed, and its point carries the request rate the
    clients reached on the first replay (its repeats carry the same, so that they merge as one load)."""
    import dataclasses

    async def probe(label_rps: float | None = None) -> CurvePoint:
        metrics = await replay_at(rate_rps)
        point = CurvePoint.of(metrics, limits)
        if math.isinf(rate_rps):
            point = dataclasses.replace(point, offered_rate_rps=label_rps or metrics.request_throughput_rps)
        return point

    first = await probe()
    result = RateSearchResult(points=[first], best=first if first.feasible else None)
    if result.best is not None:
        result.repeats = [await probe(first.offered_rate_rps) for _ in range(repeats - 1)]
    return result


def with_repeats(search: RateSearchResult, limits: Limits) -> RateSearchResult:
    """The search with every rate's replays merged into their medians, and the trial's best chosen again as
    `optimize report` ranks stored curves (rerank: repeats merged, highest qualifying rate): if the medians at the
    first best rate miss the limit, a lower rate whose medians met it is the answer, and none makes the trial
    infeasible."""
    by_rate: dict[float, list[CurvePoint]] = {}
    for p in [*search.points, *search.repeats]:
        by_rate.setdefault(p.offered_rate_rps, []).append(p)
    merged: dict[float, CurvePoint] = {}
    for rate, group in by_rate.items():
        if len(group) == 1:
            merged[rate] = group[0]
            continue
        m = merge_repeats([asdict(p) for p in group])[0]
        fields = {k: int(round(m[k])) if isinstance(v, int) and not isinstance(v, bool) else m[k]
                  for k, v in asdict(group[0]).items()}
        merged[rate] = CurvePoint(**{**fields, "feasible": qualifies(m, limits)})
    searched = {p.offered_rate_rps for p in search.points}
    points = [merged[p.offered_rate_rps] for p in search.points]
    points += [merged[r] for r in by_rate if r not in searched]  # rates only the step-down measured
    dicts = [asdict(p) for p in points]
    chosen = rank_curve(dicts, limits)
    best = None
    if chosen.answerable:
        best = next(p for p, d in zip(points, dicts) if d is chosen.point)
    return RateSearchResult(points=points, best=best, stopped_early=search.stopped_early, repeats=search.repeats,
                            flat=search.flat)
