"""Study logic on the simulated engine: budget, baseline once, resume, pruning, constraints, recommendation.

The simulator (optimizer/engines/simulated.py) serves each replay in virtual time, so these whole studies run in
well under a second each and give the same result every time; the real engine has its own tests (marker `engine`).
"""

import optuna
import pytest
from optuna.trial import TrialState

from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.config.settings import FloatRange, SpaceSpec, StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core import failures
from optimizer.core.errors import OptimizerError
from optimizer.decision.decide import decide
from optimizer.decision.export import export
from optimizer.decision.report import summary_text
from optimizer.engines.simulated import SimulatedEngine
from optimizer.search.objective import CONSTRAINT
from optimizer.search.runner import prepare, run
from optimizer.search.score import recommended


def make_config(tmp_path, model, **kw):
    base = dict(study_name="s", storage_url=f"sqlite:///{tmp_path}/s.db", ttft_p99_ms=30.0, budget=3,
                model=str(model), dummy_weights=True, device="cpu",
                workload=WorkloadSpec(num_requests=40, warmup_requests=2, input_len_min=64, input_len_max=256,
                                      output_len_min=2, output_len_max=6))
    return StudyConfig(**{**base, **kw})


class SimEngine(SimulatedEngine):
    """The simulator for the architecture of `config_only_model` (its own memory: 24 GiB, 90% usable)."""

    def __init__(self):
        super().__init__(model_info({**DEFAULT_MODEL_CONFIG, "max_position_embeddings": 1024}, "sim"))


def run_study(tmp_path, config, engine=SimEngine):
    # the simulated engine has its own memory limit: this machine's memory must not decide these tests
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=engine, memory_probe=lambda: None)
    return run(prepared, quiet=True)


def test_runs_to_budget_with_the_baseline_first_and_once(tmp_path, config_only_model):
    study = run_study(tmp_path, make_config(tmp_path, config_only_model))
    trials = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(trials) == 3
    assert trials[0].user_attrs.get("baseline") is True and trials[0].params == {}
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1
    for t in trials:
        assert t.state == TrialState.COMPLETE
        curve = t.user_attrs["curve"]
        assert curve[0]["offered_rate_rps"] is None  # the burst comes first
        assert t.constraints[CONSTRAINT] == (0.0 if t.user_attrs["result"]["feasible"] else
                                             t.constraints[CONSTRAINT]) >= 0
        assert t.values[0] > 0
    assert trials[0].user_attrs["result"]["feasible"] and len(trials[0].user_attrs["curve"]) >= 2
    best = recommended(study)
    assert best is not None
    assert best.values[0] == max(t.values[0] for t in trials if t.user_attrs["result"]["feasible"])


def test_resume_adds_trials_without_repeating(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model)
    first = run_study(tmp_path, config)
    done = {t.number: t.datetime_complete for t in first.trials}
    study = run_study(tmp_path, config.model_copy(update={"budget": 5}))
    assert len(study.trials) == 5
    assert {t.number: t.datetime_complete for t in study.trials[:3]} == done
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1
    assert run_study(tmp_path, config.model_copy(update={"budget": 5})).trials == study.trials  # nothing left


def test_out_of_memory_is_pruned_with_reason_and_violated_constraint(tmp_path, config_only_model):
    space = SpaceSpec(ranges={"gpu_memory_utilization": FloatRange(low=0.95, high=0.99)})
    study = run_study(tmp_path, make_config(tmp_path, config_only_model, space=space, budget=3))
    searched = [t for t in study.trials if not t.user_attrs.get("baseline")]
    assert searched and all(t.state == TrialState.PRUNED for t in searched)
    for t in searched:
        assert t.user_attrs["pruned_reason"] == failures.OUT_OF_MEMORY
        assert t.constraints[CONSTRAINT] > 0


def test_invalid_combination_is_pruned_before_any_engine_starts(tmp_path, config_only_model):
    starts = []

    class Counting(SimEngine):
        async def start(self, params, log_path=None):
            starts.append(params)
            return await super().start(params, log_path)

    space = SpaceSpec(fixed={"max_num_seqs": 64, "max_num_batched_tokens": 32})
    study = run_study(tmp_path, make_config(tmp_path, config_only_model, space=space, budget=2), engine=Counting)
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert len(pruned) == 2  # the baseline keeps the fixed values too
    assert all(t.user_attrs["pruned_reason"] == failures.INVALID_CONFIG for t in pruned)
    assert "must be >= max_num_seqs" in pruned[0].user_attrs["pruned_detail"]
    assert starts == []


def test_an_impossible_limit_leaves_no_recommendation(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, ttft_p99_ms=0.001, budget=2)
    study = run_study(tmp_path, config)
    assert all(t.constraints[CONSTRAINT] > 0 for t in study.trials)
    assert recommended(study) is None
    assert "No trial met the limit" in summary_text(study, config)
    with pytest.raises(OptimizerError, match="Relax the limit"):
        export(None, config, tmp_path, str(config_only_model))


def test_summary_names_gain_and_changes(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=4)
    study = run_study(tmp_path, config)
    text = summary_text(study, config)
    d = decide(study, config)
    assert "vLLM defaults" in text and "recommended" in text
    if d.best.number != d.baseline.number:
        assert "changed from vLLM's defaults" in text
        assert d.gain_pct is not None and f"{d.gain_pct:+.1f}%" in text


def test_sampler_sees_pruned_trials_as_infeasible(tmp_path, config_only_model):
    space = SpaceSpec(ranges={"gpu_memory_utilization": FloatRange(low=0.5, high=0.99)})
    study = run_study(tmp_path, make_config(tmp_path, config_only_model, space=space, budget=6))
    for t in study.get_trials(states=(TrialState.PRUNED,)):
        assert t.params["gpu_memory_utilization"] > 0.9
    assert isinstance(study.sampler, optuna.samplers.TPESampler)


def test_a_second_live_worker_on_sqlite_is_refused(tmp_path, config_only_model):
    import socket
    import subprocess

    import psutil

    from optimizer.core.errors import UsageError
    from optimizer.search.study import open_study, storage_for

    config = make_config(tmp_path, config_only_model)
    storage = storage_for(config.storage_url)
    study = open_study(config, storage)
    other = subprocess.Popen(["sleep", "30"])
    try:
        trial = study.ask()  # the queued baseline, now RUNNING on behalf of the other process
        trial.set_user_attr("worker", {"host": socket.gethostname(), "pid": other.pid,
                                       "create_time": psutil.Process(other.pid).create_time()})
        with pytest.raises(UsageError, match="SQLite is not for parallel workers"):
            open_study(config, storage)
    finally:
        other.kill()
        other.wait()
    reopened = open_study(config, storage)  # its worker is gone: the trial is recovered and queued again
    assert reopened.trials[0].state == TrialState.FAIL
    assert any(t.user_attrs.get("retry_of") == 0 and t.user_attrs.get("baseline") for t in reopened.trials)


def test_a_hung_engine_becomes_a_pruned_timeout_and_the_study_goes_on(tmp_path, config_only_model):
    import asyncio

    class Hangs(SimEngine):
        async def start(self, params, log_path=None):
            if "max_num_seqs" in params:  # the baseline (vLLM's defaults) starts; searched trials hang
                await asyncio.sleep(3600)
            return await super().start(params, log_path)

    config = make_config(tmp_path, config_only_model, budget=2, trial_timeout_s=3.0)
    study = run_study(tmp_path, config, engine=Hangs)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert study.trials[1].user_attrs["pruned_reason"] == failures.TIMEOUT
