"""Repeats: a trial replays its best rate again; its numbers are the medians, stored as curve points the report
merges the same way. On the simulated engine: fast and deterministic."""

import math

from optimizer.config import StudyConfig, WorkloadSpec
from optimizer.engines.simulated import SimulatedEngine
from optimizer.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.objective import BASELINE_REPEATS
from optimizer.rerank import merge_repeats
from optimizer.runner import prepare, run
from optimizer.study import is_baseline


def test_trials_repeat_their_best_rate_and_the_baseline_at_least_three_times(tmp_path, config_only_model):
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
        want = max(2, BASELINE_REPEATS) if is_baseline(t) else 2
        assert len(at_rate) == want, (t.number, t.user_attrs["curve"])
        merged = next(p for p in merge_repeats(t.user_attrs["curve"]) if p["offered_rate_rps"] == rate)
        assert merged["replays"] == want
        assert math.isclose(t.values[0], merged["output_throughput_tok_s"])  # the trial's value is the median
        checked += 1
    assert checked >= 2
