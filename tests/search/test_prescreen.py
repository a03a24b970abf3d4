"""Pre-screen: simulated trials in study NAME.sim, then their best and least certain configs queued first."""

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.search.attrs import PRESCREEN, STUDY_PRESCREEN
from optimizer.search.prescreen import choose, perturbed
from optimizer.search.runner import prepare, run
from optimizer.search.score import goodput
from tests.support import fakes, synthetic
from tests.support.fakes import SimEngine


def make_config(tmp_path, model, **kw):
    """The shared short study, with a budget of 8 and a pre-screen of 10 simulated trials."""
    return fakes.make_config(tmp_path, model, **{"budget": 8, "prescreen": 10, **kw})


def fake_trial(number, x, value, feasible=True, baseline=False):
    return create_trial(params={"x": x}, distributions={"x": IntDistribution(0, 100)}, values=[value, 10.0],
                        user_attrs={**synthetic.stored(feasible=feasible), **({"baseline": True} if baseline else {})})


def test_choose_takes_the_top_then_the_most_optimistic_of_the_rest():
    trials = [fake_trial(0, 0, 500.0, baseline=True), fake_trial(1, 1, 100.0), fake_trial(2, 2, 90.0),
              fake_trial(3, 3, 80.0), fake_trial(4, 4, 70.0), fake_trial(5, 5, 999.0, feasible=False),
              fake_trial(6, 1, 100.0)]  # a duplicate of trial 1
    # under two perturbed models: x=3 is 80 +- 0 (sure), x=4 is 70 +- 30 (unsure): optimistic 80 vs 100
    picks = choose(trials, top_k=2, unsure_k=1, evaluate_under=lambda ps: [[80.0, 40.0], [80.0, 100.0]])
    assert [(p.params, p.reason) for p in picks] == [({"x": 1}, "top"), ({"x": 2}, "top"), ({"x": 4}, "unsure")]
    assert picks[2].optimistic_tok_s == pytest.approx(70.0 + 30.0) and picks[2].spread == pytest.approx(30 / 70)
    assert goodput(trials[5]) == 0.0  # infeasible: never picked, whatever its throughput


def test_perturbed_time_models_are_deterministic_and_around_the_nominal():
    a, b = perturbed(StepTimeModel(), 4, seed=3), perturbed(StepTimeModel(), 4, seed=3)
    assert a == b and len(set(a)) == 4
    assert all(m.engine_start_s == StepTimeModel().engine_start_s for m in a)  # only the step terms move


def test_prescreen_queues_what_it_says_after_the_baseline_and_once(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model)
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None)
    storage = prepared.study._storage
    sim = optuna.load_study(study_name="s.sim", storage=storage)
    assert len(sim.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == 10
    record = STUDY_PRESCREEN.of(prepared.study)
    picks = record["picks"]
    assert record["sim_trials"] == 10 and 1 <= len(picks) <= 5
    assert any(p["reason"] == "top" for p in picks)
    waiting = prepared.study.get_trials(states=(TrialState.WAITING,))
    assert waiting[0].user_attrs.get("baseline") is True  # vLLM's defaults stay first
    assert [t.system_attrs["fixed_params"] for t in waiting[1:]] == [p["params"] for p in picks]
    assert [PRESCREEN.of(t) for t in waiting[1:]] == [p["reason"] for p in picks]
    best_sim = max(goodput(t) for t in sim.trials if not t.user_attrs.get("baseline"))  # never picked: queued first
    assert picks[0]["sim_goodput_tok_s"] == pytest.approx(best_sim)

    again = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None)
    assert len(again.study.get_trials(states=(TrialState.WAITING,))) == len(waiting)  # not queued twice
    study = run(again, quiet=True)
    ran = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(ran) == config.budget
    assert [t.params for t in ran[1:1 + len(picks)]] == [p["params"] for p in picks]


def test_a_second_worker_that_pre_screens_the_same_study_queues_no_pick_twice(tmp_path, config_only_model):
    """Two workers that start one study together both find it not pre-screened yet: both run the pre-screen,
    on the same simulated study, and the second's picks are already queued."""
    from optimizer.search.prescreen import run_prescreen

    config = make_config(tmp_path, config_only_model)
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None)
    waiting = prepared.study.get_trials(states=(TrialState.WAITING,))
    STUDY_PRESCREEN.set(prepared.study, None)  # as the second worker saw it, before the first's mark
    o = prepared.objective
    picks = run_prescreen(prepared.study, prepared.study._storage, config, o.space, o.workload, o.model,
                          StepTimeModel(), config.prescreen, logs_dir=tmp_path / "second")
    assert picks  # it chose again, the same configs ...
    after = prepared.study.get_trials(states=(TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"] for t in after] == [t.system_attrs["fixed_params"] for t in waiting]


def test_the_pre_screen_waits_for_another_workers_running_simulated_trials():
    from optimizer.search.budget import wait_while_running

    study = optuna.create_study()
    running = study.ask()
    clock = [0.0]

    def sleep(s):
        clock[0] += s
        if clock[0] == 3:
            study.tell(running, 1.0)

    wait_while_running(study, timeout_s=60, poll_s=1.0, now=lambda: clock[0], sleep=sleep)
    assert clock[0] == 3.0 and study.trials[0].state == TrialState.COMPLETE
    stuck = optuna.create_study()
    stuck.ask()
    clock[0] = 0.0
    wait_while_running(stuck, timeout_s=10, poll_s=1.0, now=lambda: clock[0],
                       sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    assert clock[0] == 10.0  # a worker that died mid-trial is not waited for forever


def test_cli_flags_become_study_settings(tmp_path):
    from optimizer.cli.run import build_parser, explicit_settings
    from optimizer.core.errors import UsageError

    cal = tmp_path / "cal.json"
    StepTimeModel().save(cal)
    out = explicit_settings(build_parser().parse_args(["--prescreen", "50", "--calibration", str(cal)]))
    assert out["prescreen"] == 50 and out["calibration"] == str(cal.resolve())
    with pytest.raises(UsageError, match="optimize calibrate"):
        explicit_settings(build_parser().parse_args(["--calibration", str(tmp_path / "missing.json")]))
    with pytest.raises(UsageError, match="--prescreen"):
        explicit_settings(build_parser().parse_args(["--prescreen", "0"]))
