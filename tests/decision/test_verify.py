"""verify: variants of the workload, the robust choice (hand-made cases), and a run on the fake engine."""

import asyncio
import math

from optimizer.config.workload_spec import WorkloadSpec
from optimizer.decision.verify import Verified, robust_choice, variants, verify_trial
from tests.support.fake_engine import FakeEngine
from optimizer.search.confirmed import recommended
from tests.support.fakes import make_config, run_study


def point(ttft, feasible=True):
    return {"ttft_p99_ms": ttft, "feasible": feasible, "sustained": True}


def v(n, tput, worst, mem=0.9, holds=True):
    return Verified(trial_number=n, throughput_tok_s=tput, rate_rps=5.0, gpu_memory_utilization=mem,
                    points={"seed 1": point(worst / 2), "bursty": point(worst, holds)})


def test_variants_of_the_workload():
    spec = WorkloadSpec(input_len_min=32, input_len_max=256, output_len_min=16, output_len_max=64, seed=7)
    names = [x.name for x in variants(spec, max_model_len=2048, seeds=2)]
    assert names == ["seed 8", "seed 9", "bursty (gamma 0.5)", "long prompts (30%)"]
    surge_wide = variants(spec, max_model_len=2048, seeds=1)[-1].workload
    assert (surge_wide.long_input_len_min, surge_wide.long_input_len_max) == (384, 512)
    surge = variants(spec, max_model_len=300, seeds=1)[-1].workload
    assert surge.long_input_len_max == 256  # never longer than the config's max_model_len allows


def test_most_robust_within_the_margin_wins():
    best, close_but_robust, far = v(1, 100.0, 140.0), v(2, 97.0, 90.0), v(3, 80.0, 40.0)
    assert robust_choice([best, close_but_robust, far], margin=0.05) is close_but_robust
    assert robust_choice([best, close_but_robust, far], margin=0.0) is best


def test_a_config_that_misses_under_a_variant_is_not_chosen():
    fragile, steady = v(1, 100.0, 160.0, holds=False), v(2, 99.0, 120.0)
    assert robust_choice([fragile, steady], margin=0.05) is steady
    assert robust_choice([fragile], margin=0.05) is None


def test_ties_go_to_the_lower_memory_fraction():
    hot, cool = v(1, 100.0, 90.0, mem=0.94), v(2, 100.0, 90.0, mem=0.86)
    assert robust_choice([hot, cool], margin=0.05) is cool


def test_verify_on_the_fake_engine(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=3)
    study = run_study(tmp_path, config)
    best = recommended(study)
    result = asyncio.run(verify_trial(best, config, FakeEngine, 16000, seeds=1, log_path=tmp_path / "v.log"))
    assert result.trial_number == best.number and not result.error
    names = list(result.points)
    assert names[:2] == ["seed 1", "bursty (gamma 0.5)"] and names[2].startswith("long prompts") and len(names) == 3
    assert all(p["completed"] == config.workload.num_requests for p in result.points.values())
    assert math.isfinite(result.worst_ttft_p99_ms)
