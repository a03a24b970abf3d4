"""A study under a TTFT and a TPOT limit together, on the simulator: the search, Optuna's constraints, the trial lines
and the ranking all see both limits."""

import pytest

from optimizer.config.limits import parse_limits
from optimizer.measurement.rerank import point_value_ms
from optimizer.search.attrs import CURVE, RESULT
from optimizer.search.dashboard import DASHBOARD_CONSTRAINTS_ATTR
from optimizer.search.progress import describe
from optimizer.search.score import feasible, scored_best_first
from tests.support.fakes import config_only_model_in, make_config, run_study

TTFT_MS, TPOT_MS = 30.0, 12.0  # on the simulator's demo model, the TPOT limit binds vLLM's defaults


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """(both limits, TTFT alone): the same budget and seed."""
    out = []
    for limits in (parse_limits(f"{TTFT_MS}ms", f"{TPOT_MS}ms"), parse_limits(f"{TTFT_MS}ms")):
        tmp = tmp_path_factory.mktemp("limits")
        config = make_config(tmp, config_only_model_in(tmp), limits=limits, budget=6)
        out.append((run_study(tmp, config), config))
    return out


def test_each_limit_is_a_constraint_optuna_and_the_dashboard_see(studies):
    (study, _), _ = studies
    for t in study.trials:
        assert {"ttft_p99_over_limit", "tpot_p99_over_limit"} <= set(t.constraints), t.constraints
        assert len(t.system_attrs[DASHBOARD_CONSTRAINTS_ATTR]) == 2
        assert feasible(t) == all(v <= 0 for v in (t.constraints["ttft_p99_over_limit"],
                                                    t.constraints["tpot_p99_over_limit"]))
    # Optuna's own best trials respect both limits
    assert study.best_trials and all(feasible(t) for t in study.best_trials)


def test_the_trial_lines_name_the_limit_that_bound_each_trial(studies):
    (study, _), _ = studies
    lines = [describe(t) for t in study.trials]
    bound = [RESULT.of(t).get("bound_by") for t in study.trials]
    assert any(b and b["limit"] == "tpot:p99" for b in bound), bound
    for line, b in zip(lines, bound):
        if b:
            assert b["text"] in line, line
            assert b["text"].startswith(("TTFT P99 ", "TPOT P99 ")) and " > " in b["text"] and " req/s" in b["text"]
    baseline = lines[0]
    assert "TTFT P99 " in baseline and "TPOT P99 " in baseline  # both statistics at its rate


def test_the_ranking_holds_both_limits_and_costs_rate_against_ttft_alone(studies):
    (both, both_config), (alone, alone_config) = studies
    ranked = scored_best_first(both)
    assert ranked
    for trial, r in ranked:
        for lim in both_config.limits:  # each chosen point is within each limit, or passed its verdict at both
            within = point_value_ms(r.point, lim, both_config.limits) <= lim.value_ms
            assert within or (r.point.get("limits_key") == both_config.limits.key and r.point["feasible"]), trial.number
    # the baseline's rate under both limits is below its rate under TTFT alone: the TPOT limit binds it
    rate_both = RESULT.of(both.trials[0])["rate_rps"]
    rate_alone = RESULT.of(alone.trials[0])["rate_rps"]
    assert rate_both < rate_alone
    # and every probe of it is stored with its part of the verdict on each limit
    for p in CURVE.of(both.trials[0]):
        assert [d["key"] for d in p["limits"]] == ["ttft:p99", "tpot:p99"] and p["binding"] in ("ttft:p99", "tpot:p99")
