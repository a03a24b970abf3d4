"""verify: variants of the workload, the robust choice (hand-made cases), and a run on the fake engine."""

import asyncio
import math

from optimizer.config.limits import Limit, Limits
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.decision.verify import Verified, report_rows, robust_choice, values_heading, variants, verify_trial
from optimizer.search.confirmed import recommended
from tests.support.fake_engine import FakeEngine
from tests.support.fakes import make_config, run_study

TTFT = Limits.ttft_p99(150.0)
TTFT_TPOT = Limits(items=(Limit(metric="ttft", stat="p99", value_ms=150.0), Limit(metric="tpot", stat="p99",
                                                                                   value_ms=50.0)))


def point(ttft, feasible=True):
    return {"ttft_p99_ms": ttft, "feasible": feasible, "sustained": True, "stats": {"ttft": {"p99": ttft}}}


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
    assert robust_choice([best, close_but_robust, far], 0.05, TTFT) is close_but_robust
    assert robust_choice([best, close_but_robust, far], 0.0, TTFT) is best


def test_a_config_that_misses_under_a_variant_is_not_chosen():
    fragile, steady = v(1, 100.0, 160.0, holds=False), v(2, 99.0, 120.0)
    assert robust_choice([fragile, steady], 0.05, TTFT) is steady
    assert robust_choice([fragile], 0.05, TTFT) is None
    rows = report_rows([fragile, steady], TTFT, steady)
    assert rows[0]["bursty"] == "160ms MISS" and rows[0]["worst_ttft_p99"] == "160ms"
    assert rows[0]["verdict"] == "misses TTFT P99 150ms" and rows[1]["verdict"] == "recommended"


def test_ties_go_to_the_lower_memory_fraction():
    hot, cool = v(1, 100.0, 90.0, mem=0.94), v(2, 100.0, 90.0, mem=0.86)
    assert robust_choice([hot, cool], 0.05, TTFT) is cool


def test_with_two_limits_the_headroom_is_the_worst_ratio_and_a_miss_names_its_limit():
    """TTFT P99 <= 150ms and TPOT P99 <= 50ms: #1 has TTFT headroom but its TPOT is at 48 ms (ratio 0.96); #2 is
    at 120 ms TTFT (0.8) and 30 ms TPOT: #2 is the more robust. #3 goes over the TPOT limit in its burst."""
    def two(n, tput, ttft, tpot, feasible=True):
        stats = {"ttft": {"p99": ttft}, "tpot": {"p99": tpot}}
        return Verified(trial_number=n, throughput_tok_s=tput, rate_rps=5.0, gpu_memory_utilization=0.9,
                        points={"seed 1": {**point(ttft / 2), "stats": {"ttft": {"p99": ttft / 2},
                                                                       "tpot": {"p99": tpot / 2}}},
                                "bursty": {**point(ttft, feasible), "stats": stats}})

    tpot_bound, balanced, over = two(1, 100.0, 60.0, 48.0), two(2, 99.0, 120.0, 30.0), two(3, 101.0, 60.0, 61.0, False)
    assert tpot_bound.worst_ratio(TTFT_TPOT) == 0.96 and balanced.worst_ratio(TTFT_TPOT) == 0.8
    assert robust_choice([tpot_bound, balanced, over], 0.05, TTFT_TPOT) is balanced
    assert robust_choice([tpot_bound, balanced, over], 0.05, TTFT) is tpot_bound  # TTFT alone: the most headroom
    rows = report_rows([over, balanced], TTFT_TPOT, balanced)
    assert rows[0]["bursty"] == "60/61ms MISS TPOT P99" and rows[0]["seed 1"] == "30/30ms ok"
    assert rows[0]["worst_ttft_p99"] == "60ms" and rows[0]["worst_tpot_p99"] == "61ms"
    assert rows[0]["verdict"] == "misses TPOT P99 50ms"
    assert values_heading(TTFT_TPOT) == "each variant: TTFT P99 / TPOT P99, against TTFT P99 <= 150ms, TPOT P99 <= 50ms"
    assert over.to_dict(TTFT_TPOT)["worst_ms"] == {"ttft:p99": 60.0, "tpot:p99": 61.0}


def test_verify_on_the_fake_engine(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=3)
    study = run_study(tmp_path, config)
    best = recommended(study)
    result = asyncio.run(verify_trial(best, config, FakeEngine, 16000, seeds=1, log_path=tmp_path / "v.log"))
    assert result.trial_number == best.number and not result.error
    names = list(result.points)
    assert names[:2] == ["seed 1", "bursty (gamma 0.5)"] and names[2].startswith("long prompts") and len(names) == 3
    assert all(p["completed"] == config.workload.num_requests for p in result.points.values())
    assert all(math.isfinite(result.worst_ms(lim, config.limits)) for lim in config.limits)
    assert all(p["limits_key"] == config.limits.key for p in result.points.values())  # judged at the study's limits
