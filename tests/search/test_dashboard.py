"""optuna-dashboard sees the study's feasibility: every trial carries its constraint in the list form the
dashboard reads, checked through optuna-dashboard's own WSGI app on a study the tool ran (simulated engine)."""

import json
import wsgiref.util

import pytest
from optuna.trial import TrialState

from optimizer.search.dashboard import DASHBOARD_CONSTRAINTS_ATTR
from optimizer.search.objective import CONSTRAINT
from optimizer.search.score import feasible
from tests.support.fakes import make_config, run_study


@pytest.fixture
def study(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=6, ttft_p99_ms=12.0)
    return run_study(tmp_path, config), config


def test_every_finished_trial_stores_its_constraint_as_the_list_the_dashboard_reads(study):
    study, _ = study
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(finished) == 6
    for t in finished:
        assert t.system_attrs[DASHBOARD_CONSTRAINTS_ATTR] == [t.constraints[CONSTRAINT]]
    assert any(feasible(t) for t in finished) and not all(feasible(t) for t in finished)


def _dominates(a, b):  # throughput up, TTFT P99 down
    return a[0] >= b[0] and a[1] <= b[1] and a != b


def test_the_dashboards_api_shows_the_feasible_trials_and_front(study):
    dashboard = pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed (extra `test`)")
    study, config = study
    app = dashboard.wsgi(config.storage_url)

    def get(path):
        environ = {}
        wsgiref.util.setup_testing_defaults(environ)
        environ["PATH_INFO"] = path
        status = []
        body = b"".join(app(environ, lambda s, h, exc_info=None: status.append(s)))
        assert status[0].startswith("200"), (path, status, body[:500])
        return json.loads(body)

    studies = get("/api/studies")["study_summaries"]
    study_id = next(s["study_id"] for s in studies if s["study_name"] == config.study_name)
    detail = get(f"/api/studies/{study_id}")
    trials = {t["number"]: t for t in detail["trials"]}
    shown_feasible = {n for n, t in trials.items()
                      if t["state"] == "Complete" and t["constraints"] and all(c <= 0 for c in t["constraints"])}
    assert shown_feasible == {t.number for t in study.trials if feasible(t)}
    assert shown_feasible and len(shown_feasible) < len(trials)
    values = {n: tuple(trials[n]["values"]) for n in shown_feasible}
    front = {n for n in shown_feasible if not any(_dominates(values[m], values[n]) for m in shown_feasible)}
    assert front == {t.number for t in study.best_trials}  # Optuna's own feasible Pareto front
