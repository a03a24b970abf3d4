import optuna
import pytest
from optuna.trial import create_trial

from optimizer.config.limits import Limit, Limits
from optimizer.search.attrs import STUDY_CONFIG
from optimizer.search.objective import CONSTRAINT
from optimizer.search.study import DIRECTIONS
from tests.support import synthetic

# TTFT P99 <= 100ms and TPOT P99 <= 50ms
TWO_LIMITS = Limits(items=(Limit(metric="ttft", stat="p99", value_ms=100.0),
                           Limit(metric="tpot", stat="p99", value_ms=50.0)))


@pytest.fixture
def syn(tmp_path):
    """The synthetic study (tests/support/synthetic.py) in `tmp_path`: (study, config, tmp_path)."""
    study, config = synthetic.build(tmp_path)
    return study, config, tmp_path


def two_limit_point(rate_rps, ttft_p99_ms, tpot_p99_ms, judged_at="ttft:p99=100"):
    """A stored probe with every statistic, its verdict settled at `judged_at` (not TWO_LIMITS: it is judged on its
    statistics), sustained."""
    p = synthetic.point(rate_rps, ttft_p99_ms, burst_rps=10.0)
    return {**p, "tpot_p99_ms": tpot_p99_ms, "stats": {"ttft": {"p99": ttft_p99_ms, "p50": ttft_p99_ms / 2},
                                                       "tpot": {"p99": tpot_p99_ms}},
            "verdict": "pass" if p["feasible"] else "fail", "limits_key": judged_at}


@pytest.fixture
def two_limits(tmp_path):
    """A study tuned for TTFT P99 <= 100ms and TPOT P99 <= 50ms, by hand:

        trial 0 (baseline)  4.2/s TTFT 98ms TPOT 30ms | 4.8 150ms 35ms          -> 4.2/s, 420 tok/s
        trial 1             5.0/s 50ms 40ms | 6.0/s 60ms 61ms (over TPOT only)  -> 5.0/s, 500 tok/s

    At TTFT P99 alone #1 holds 6.0/s (600 tok/s). Returns (study, config, tmp_path)."""
    config = synthetic.make_config(tmp_path, "two").model_copy(update={"limits": TWO_LIMITS})
    study = optuna.create_study(study_name="two", storage=config.storage_url, directions=DIRECTIONS)
    STUDY_CONFIG.set(study, config.model_dump_json())
    pt = two_limit_point
    curves = {0: [pt(4.2, 98, 30.0), pt(4.8, 150, 35.0)], 1: [pt(5.0, 50, 40.0), pt(6.0, 60, 61.0)]}
    results = {0: {"rate_rps": 4.2, "ttft:p99": 98.0, "tpot:p99": 30.0, "bound": ("ttft:p99", 150.0, 4.8),
                   "text": "TTFT P99 150 ms > 100 ms at 4.8 req/s"},
               1: {"rate_rps": 5.0, "ttft:p99": 50.0, "tpot:p99": 40.0, "bound": ("tpot:p99", 61.0, 6.0),
                   "text": "TPOT P99 61 ms > 50 ms at 6.0 req/s"}}
    for n, c in curves.items():
        r = results[n]
        best = next(p for p in c if p["offered_rate_rps"] == r["rate_rps"])
        key, measured, rate = r["bound"]
        result = {"feasible": True, "limits": TWO_LIMITS.key, "rate_rps": r["rate_rps"],
                  **{k: best[k] for k in ("output_throughput_tok_s", "request_throughput_rps", "ttft_p50_ms",
                                          "ttft_p99_ms", "tpot_p99_ms")},
                  "values_at_rate_ms": {"ttft:p99": r["ttft:p99"], "tpot:p99": r["tpot:p99"]},
                  "bound_by": {"limit": key, "measured_ms": measured, "rate_rps": rate, "text": r["text"]}}
        params = synthetic.PARAMS[1] if n else {}
        attrs = {**synthetic.stored(c, **result), "engine_params": params,
                 "engine_config": {**synthetic.BASELINE_ENGINE, **params}, **({"baseline": True} if n == 0 else {})}
        study.add_trial(create_trial(values=[best["output_throughput_tok_s"], best["ttft_p99_ms"]], params=params,
                                     distributions={k: synthetic.DISTRIBUTIONS[k] for k in params},
                                     user_attrs=attrs, constraints={CONSTRAINT: 0.0}))
    return study, config, tmp_path
