"""Repeats: a trial replays its best rate again; its numbers are the medians, stored as curve points the report
merges the same way. On the simulated engine: fast and deterministic."""

import math

from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.engines.simulated import SimulatedEngine
from optimizer.measurement.rerank import merge_repeats
from optimizer.search.runner import prepare, run


def test_trials_repeat_their_best_rate_as_asked_the_baseline_too(tmp_path, config_only_model):
    config = StudyConfig(study_name="r", storage_url=f"sqlite:///{tmp_path}/r.db", ttft_p99_ms=1000.0, budget=4,
                         model=str(config_only_model), dummy_weights=True, device="cpu", repeats=2, seed=1,
                         workload=WorkloadSpec(num_requests=60, warmup_requests=2, input_len_min=32,
                                               input_len_max=256, output_len_min=16, output_len_max=64))
    info = model_info(DEFAULT_MODEL_CONFIG, "sim")
    study = run(prepare(config, tmp_path, say=lambda *a: None, engine_factory=lambda: SimulatedEngine(info),
                        memory_probe=lambda: None), quiet=True)
    checked = 0
    for t in study.trials:
        if not t.user_attrs.get("result", {}).get("feasible"):
            continue
        rate = t.user_attrs["result"]["rate_rps"]
        at_rate = [p for p in t.user_attrs["curve"] if p["offered_rate_rps"] == rate]
        want = 2  # a rate search's baseline needs no more: its fit gives its interval (BASELINE_REPEATS: fixed loads)
        assert len(at_rate) == want, (t.number, t.user_attrs["curve"])
        merged = next(p for p in merge_repeats(t.user_attrs["curve"]) if p["offered_rate_rps"] == rate)
        assert merged["replays"] == want
        assert math.isclose(t.values[0], merged["output_throughput_tok_s"])  # the trial's value is the median
        checked += 1
    assert checked >= 2


def _metrics(rate_rps, ttft_p99_ms):
    from optimizer.measurement.metrics import Distribution, ReplayMetrics

    d = Distribution(ttft_p99_ms / 2, ttft_p99_ms / 2, ttft_p99_ms, ttft_p99_ms)
    return ReplayMetrics(offered_rate_rps=rate_rps, achieved_rate_rps=rate_rps, sent_rate_rps=rate_rps,
                         completed=100, failed=0, duration_s=10.0, request_throughput_rps=rate_rps,
                         output_throughput_tok_s=100 * rate_rps, total_token_throughput_tok_s=300 * rate_rps,
                         ttft=d, tpot=d, itl=d, e2e=d)


def test_repeats_that_miss_step_the_rate_down_until_the_medians_hold():
    """The search passed 20/s once (a lucky replay); both repeats there miss 150 ms. 17/s (0.85x) holds in 2 of 3:
    the trial is feasible at 17/s with its medians, not infeasible."""
    import asyncio

    from optimizer.search.repeats import REPEAT_STEP_DOWN, confirm_best, with_repeats
    from optimizer.measurement.rate_search import CurvePoint, RateSearchResult

    first = CurvePoint.of(_metrics(20.0, 140.0), 150.0)
    result = RateSearchResult(points=[CurvePoint.of(_metrics(float("inf"), 900.0), 150.0), first], best=first)
    script = {20.0: [400.0, 300.0], 20.0 * REPEAT_STEP_DOWN: [120.0, 200.0, 130.0]}
    asked = []

    async def replay_at(rate):
        asked.append(rate)
        return _metrics(rate, script[rate].pop(0))

    asyncio.run(confirm_best(result, replay_at, 3, 150.0))
    assert asked == [20.0, 20.0, 17.0, 17.0, 17.0]
    merged = with_repeats(result, 150.0)
    assert merged.best is not None and merged.best.offered_rate_rps == 17.0 and merged.best.ttft_p99_ms == 130.0


def test_repeats_that_hold_measure_nothing_more():
    import asyncio

    from optimizer.search.repeats import confirm_best
    from optimizer.measurement.rate_search import CurvePoint, RateSearchResult

    first = CurvePoint.of(_metrics(20.0, 140.0), 150.0)
    result = RateSearchResult(points=[first], best=first)
    asked = []

    async def replay_at(rate):
        asked.append(rate)
        return _metrics(rate, 145.0)

    asyncio.run(confirm_best(result, replay_at, 3, 150.0))
    assert asked == [20.0, 20.0]
