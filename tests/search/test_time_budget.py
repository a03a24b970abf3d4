"""A time budget (`--budget 8h`) beside the trial budget; the demo sized by a probe; time left in the progress bar."""

import pytest
from optuna.trial import TrialState

from optimizer.cli.main import main
from optimizer.cli.run import budget_settings, build_parser, resolve_config
from optimizer.config.model import DEMO_LADDER, DEFAULT_MODEL_NAME, model_info
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec
from optimizer.core.errors import UsageError
from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.engines.simulated import SimulatedEngine
from optimizer.search.attrs import STUDY_DEMO_SCALE
from optimizer.search.progress import clock_text
from optimizer.search.split import plan
from optimizer.search.progress import Tally
from optimizer.search.runner import budget_text, prepare, run_status, start_estimate
from optimizer.search.budget import run_to_budget, time_left_for
from optimizer.search.study import open_study, storage_for
from tests.support.fakes import SimEngine, make_config


def test_time_left_by_hand():
    assert time_left_for(None, 30.0, 1000.0) == ""  # no deadline
    assert time_left_for(1100.0, 30.0, 1000.0) == ""  # 100 s left, 30 s needed
    assert time_left_for(1100.0, None, 1000.0) == ""  # nothing known yet: the first trial runs
    assert "takes ~130 s and 100 s are left" in time_left_for(1100.0, 130.0, 1000.0)
    assert "deadline has passed" in time_left_for(1000.0, None, 1000.0)
    # the confirmation's time is kept: 30 s of trial and 60 s of confirmation runs do not fit into 80 s
    assert "~60 s of them kept for the confirmation" in time_left_for(1080.0, 30.0, 1000.0, reserve_s=60.0)
    assert time_left_for(1100.0, 30.0, 1000.0, reserve_s=60.0) == ""


def test_budget_flags():
    import time

    trials = budget_settings(["40"])
    assert trials == {"budget": 40}
    timed = budget_settings(["8h"])
    assert timed["budget"] is None and timed["time_budget_s"] == 8 * 3600
    assert abs(timed["deadline_unix_s"] - (time.time() + 8 * 3600)) < 5
    both = budget_settings(["40", "90min"])
    assert both["budget"] == 40 and both["time_budget_s"] == 5400
    for bad in (["0"], ["-3"], ["8 hours"], ["many"], ["8x"]):
        with pytest.raises(UsageError, match="--budget"):
            budget_settings(bad)


def test_bad_time_budget_on_the_command_line(tmp_path, capsys):
    code = main(["--ttft-p99", "150ms", "--budget", "8 parsecs", "--studies-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--budget 40 or --budget 8h" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_study_needs_some_budget(tmp_path):
    with pytest.raises(ValueError, match="--budget N"):
        StudyConfig(study_name="s", storage_url="sqlite:///x.db", ttft_p99_ms=1.0, budget=None, model="m")


def test_no_trial_starts_past_the_deadline(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=None, deadline_unix_s=1100.0)
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None)
    clock = iter([1000.0, 1040.0, 1080.0, 1120.0])  # read once before each trial
    stop = run_to_budget(prepared.study, prepared.objective, None, deadline_unix_s=1100.0,
                         trial_estimate_s=lambda: 30.0, now_unix_s=lambda: next(clock))
    assert stop.ran == 2 and "takes ~30 s and 20 s are left" in stop.reason
    assert len(prepared.study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == 2
    # the trial budget still ends a study that has time left
    again = run_to_budget(prepared.study, prepared.objective, 3, deadline_unix_s=10**12,
                          trial_estimate_s=lambda: 30.0)
    assert again.ran == 1 and again.reason == ""


def test_a_resume_keeps_the_stored_deadline_unless_a_new_one_is_given(tmp_path, config_only_model):
    url = f"sqlite:///{tmp_path}/s.db"
    stored = StudyConfig(study_name="s", storage_url=url, ttft_p99_ms=150.0, budget=40, deadline_unix_s=1234.0,
                         time_budget_s=600.0, model=str(config_only_model), dummy_weights=True, device="cpu")
    open_study(stored, storage_for(url))

    def resumed(*argv):
        config, _ = resolve_config(build_parser().parse_args(["--storage", url, "--study", "s", *argv]))
        return config

    assert resumed("--budget", "50").deadline_unix_s == 1234.0 and resumed("--budget", "50").budget == 50
    extended = resumed("--budget", "2h")
    assert extended.deadline_unix_s > 1234.0 and extended.time_budget_s == 7200 and extended.budget is None
    assert "until " in budget_text(extended) and "(2.0h)" not in budget_text(stored)
    assert budget_text(stored).startswith("40 trials or until ") and "whichever comes first" in budget_text(stored)


def test_clock_text_by_hand():
    assert [clock_text(s) for s in (42, 125, 3725)] == ["42s", "2m05s", "1h02m"]


def test_the_probe_chooses_a_smaller_demo_on_a_slow_machine(tmp_path, model_cache):
    """A machine whose prefill is 0.4 ms per prompt token (the 17M model's 256-token prompt: ~100 ms, as bf16
    emulated on AVX2): the demo gets the smallest shape, stored with the study."""
    slow = StepTimeModel(fixed_s=0.005, prefill_token_s=4e-4)
    big = model_info(DEMO_LADDER[0].config, "sim")
    config = StudyConfig(study_name="demo", storage_url=f"sqlite:///{tmp_path}/demo.db", ttft_p99_ms=150.0,
                         budget=3, model=DEFAULT_MODEL_NAME, model_is_default=True, demo_probe=True, device="cpu",
                         workload=WorkloadSpec(**CPU_DEMO_WORKLOAD), engine_args={"enforce_eager": True})
    said: list[str] = []
    prepared = prepare(config, tmp_path, say=said.append, engine_factory=lambda: SimulatedEngine(big, slow),
                       memory_probe=lambda: None)
    assert prepared.config.model == DEMO_LADDER[-1].name
    stored = STUDY_DEMO_SCALE.of(prepared.study)
    assert stored["scale"]["model"] == DEMO_LADDER[-1].name and stored["probe"]["prefill_ms"] > 100
    assert any(s.startswith(f"demo scale: {DEMO_LADDER[-1].name}: ") for s in said)
    assert not any("estimated" in s for s in said)  # the one estimate is the run's, as its progress display starts
    assert not list(tmp_path.rglob("probe.engine.json"))  # its engine's record is gone with the engine
    # a resume keeps the choice and does not probe again
    said.clear()
    again = prepare(prepared.config, tmp_path, say=said.append, engine_factory=lambda: SimulatedEngine(big),
                    memory_probe=lambda: None)
    assert again.config.model == DEMO_LADDER[-1].name and not any(s.startswith("probe") for s in said)


def test_the_run_starts_with_the_probes_estimate_of_the_whole_study(tmp_path, model_cache):
    """One estimate at the start, and the progress display's is the same: 9 search trials and 15 confirmation runs
    (--budget 24) at the probe's estimate per trial add up to the probe's estimate of the study."""
    config = StudyConfig(study_name="demo", storage_url=f"sqlite:///{tmp_path}/demo.db", ttft_p99_ms=150.0,
                         budget=24, model=DEFAULT_MODEL_NAME, model_is_default=True, demo_probe=True, device="cpu",
                         workload=WorkloadSpec(**CPU_DEMO_WORKLOAD), engine_args={"enforce_eager": True})
    prepared = prepare(config, tmp_path, say=lambda *a: None,
                       engine_factory=lambda: SimulatedEngine(model_info(DEMO_LADDER[0].config, "sim")),
                       memory_probe=lambda: None)
    split = plan(config.budget, config.confirm)
    tally = Tally(split.search_budget, split.runs)
    status = run_status(prepared, tally)
    estimated_s = STUDY_DEMO_SCALE.of(prepared.study)["scale"]["estimated_s"]
    assert (status.done, status.total) == (0, 24) and status.left_s(status.at_s) == pytest.approx(estimated_s)
    assert start_estimate(status, tally) == (f"estimated time: ~{clock_text(estimated_s)} for 9 search trials and "
                                             f"15 confirmation runs")
