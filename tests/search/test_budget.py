"""The budget beside other workers (search/budget.py) and a cluster task's heartbeat (search/raycluster.py), by hand:
how many trials run at once, a worker that waits for another's trial before it stops, a heartbeat that beats while
its trial runs and stops after."""

import threading
import time

import optuna
import pytest
from optuna.trial import TrialState

from optimizer.search.attrs import ENGINE_PARAMS
from optimizer.search.budget import run_to_budget, trials_at_once
from optimizer.search.raycluster import beating, cpus_for


def study_with_layouts(*tps):
    study = optuna.create_study(directions=["maximize", "minimize"])
    for tp in tps:
        study.add_trial(optuna.trial.create_trial(values=[1.0, 1.0], user_attrs={
            ENGINE_PARAMS.key: {"tensor_parallel_size": tp}}))
    return study


def test_trials_at_once_are_the_gpus_over_the_mean_layout():
    assert trials_at_once(study_with_layouts(), 8, {}) == 8.0  # 1 GPU each before any trial
    assert trials_at_once(study_with_layouts(1, 1, 2, 4), 8, {}) == 4.0  # a mean of 2 GPUs a trial
    assert trials_at_once(study_with_layouts(4, 4), 8, {"pipeline_parallel_size": 2}) == 1.0  # 8 GPUs a trial
    assert trials_at_once(study_with_layouts(8), 4, {}) == 1.0  # never under one
    assert trials_at_once(study_with_layouts(1), 1, {}) == 1.0


def test_a_worker_at_the_budget_waits_for_another_workers_trial_then_stops():
    study = optuna.create_study(directions=["maximize", "minimize"])
    theirs = study.ask()  # another worker's trial, running
    ran = []

    def objective(trial):
        ran.append(trial.number)
        return 1.0, 1.0

    finish = threading.Timer(0.3, lambda: study.tell(theirs, [1.0, 1.0]))
    finish.start()
    t0 = time.monotonic()
    stop = run_to_budget(study, objective, budget=1, wait_running_s=10.0, poll_s=0.02)
    assert stop.ran == 0 and not ran  # the budget was theirs
    assert 0.25 <= time.monotonic() - t0 < 5.0  # it waited for their trial to end, no longer
    assert [t.state for t in study.trials] == [TrialState.COMPLETE]


def test_without_a_wait_a_worker_at_the_budget_stops_at_once():
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.ask()
    t0 = time.monotonic()
    assert run_to_budget(study, lambda t: (1.0, 1.0), budget=1).ran == 0
    assert time.monotonic() - t0 < 1.0


class BeatingStorage:
    def __init__(self, interval_s):
        self.interval_s, self.beats = interval_s, []

    def get_heartbeat_interval(self):
        return self.interval_s

    def record_heartbeat(self, trial_id):
        self.beats.append((trial_id, time.monotonic()))


def test_a_tasks_heartbeat_beats_while_its_trial_runs_and_stops_after():
    storage = BeatingStorage(0.02)
    with beating(storage, 7):
        time.sleep(0.15)
    n = len(storage.beats)
    assert n >= 3 and {t for t, _ in storage.beats} == {7}
    time.sleep(0.1)
    assert len(storage.beats) == n  # none after the trial


@pytest.mark.parametrize("interval_s", [None, 0])
def test_no_heartbeat_where_the_storage_keeps_none(interval_s):
    storage = BeatingStorage(interval_s)
    with beating(storage, 1):
        time.sleep(0.05)
    assert storage.beats == []


def test_a_trial_asks_for_a_core_per_gpu_never_more_than_a_node_with_its_gpus_has():
    nodes = [(8, 64), (4, 2), (0, 16)]
    assert cpus_for(1, nodes) == 1 and cpus_for(4, nodes) == 4 and cpus_for(8, nodes) == 8
    assert cpus_for(4, [(4, 2), (0, 16)]) == 2  # the head's cores are not the GPU node's
    assert cpus_for(8, [(4, 2)]) == 0  # no node has its GPUs: pruned before it is submitted
