"""Studies that survive the night, on the real CPU engine: SIGKILL mid-trial, Ctrl-C, then resume."""

import signal
import subprocess
import sys
import time

import pytest
from optuna.trial import TrialState

from tests.conftest import REPO, alive_pids, subprocess_env
from tests.support.fakes import load, polled_trials

pytestmark = pytest.mark.engine

# the embedded model named, so that no probe runs before the trials these tests interrupt
ARGS = ["--model", "tiny-llama-17m", "--num-requests", "20", "--input-len", "16:96", "--output-len", "4:12",
        "--ttft-p99", "150ms"]


def start(cache, studies, *args):
    return subprocess.Popen([sys.executable, "-m", "optimizer", *ARGS, *args, "--studies-dir", str(studies)],
                            cwd=REPO, env=subprocess_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for_engine(studies, proc, trial_number, timeout_s=240):
    """Wait until trial `trial_number` runs with its engine processes on record; return their PIDs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        for t in polled_trials(studies):
            if t.number == trial_number and t.state == TrialState.RUNNING and t.user_attrs.get("engine_config"):
                return [int(pid) for pid, _ in t.user_attrs["engine_processes"]]
        time.sleep(0.5)
    raise AssertionError("the trial never got its engine running")


def kill_and_check_recovery(tmp_path, model_cache, proc, trial_number):
    """SIGKILL `proc` while trial `trial_number` runs; resume; return the resumed process and the retry trial."""
    orphans = wait_for_engine(tmp_path, proc, trial_number)
    proc.kill()
    proc.wait()
    assert alive_pids(orphans), "a SIGKILLed optimize leaves its engine running: that is what recovery must clean"
    resumed = start(model_cache, tmp_path)  # the stored config: no flags repeated
    deadline = time.monotonic() + 120
    while load(tmp_path).trials[trial_number].state == TrialState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive_pids(orphans), "the resumed run ends the killed run's engine processes by PID"
    study = load(tmp_path)
    killed = study.trials[trial_number]
    assert killed.state == TrialState.FAIL and killed.user_attrs["interrupted"] == "its optimize process died"
    retry = next(t for t in study.trials if t.user_attrs.get("retry_of") == trial_number)
    assert retry.params == killed.params
    return resumed, retry


def test_two_sigkills_and_a_ctrl_c_then_resume_lose_nothing(tmp_path, model_cache, tiny_model):
    # 1. SIGKILL in the middle of the first trial (the baseline), resume; SIGKILL its retry too, resume again.
    # A budget of 2 is the least that reaches every step: the baseline (killed twice), then one searched trial
    # (Ctrl-C'd, then retried by the resume); each trial more would only add an engine start and its replays.
    proc = start(model_cache, tmp_path, "--budget", "2")
    proc, retry = kill_and_check_recovery(tmp_path, model_cache, proc, 0)
    assert retry.user_attrs.get("baseline") is True  # the baseline is queued again, not lost
    proc, retry = kill_and_check_recovery(tmp_path, model_cache, proc, retry.number)
    assert retry.user_attrs.get("baseline") is True

    # 2. Ctrl-C during the trial after the baseline: exit 130 within seconds, engine shut down.
    running = wait_for_engine(tmp_path, proc, retry.number + 1)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert time.monotonic() - t0 < 60
    assert "run the same command again to resume" in err
    assert not alive_pids(running)
    study = load(tmp_path)
    interrupted = study.trials[retry.number + 1]
    assert interrupted.state == TrialState.FAIL and interrupted.user_attrs["interrupted"] == "Ctrl-C or SIGTERM"

    # 3. Resume to the end: exactly the budget of finished trials, one baseline, nothing left running.
    proc = start(model_cache, tmp_path)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    study = load(tmp_path)
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(finished) == 2
    assert sum(bool(t.user_attrs.get("baseline")) for t in finished) == 1
    assert any(t.user_attrs.get("retry_of") == interrupted.number for t in finished)
    assert len(study.get_trials(states=(TrialState.FAIL,))) == 3  # two kills and one Ctrl-C, nothing else
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    all_pids = [int(p) for t in study.trials for p, _ in t.user_attrs.get("engine_processes", [])]
    assert not alive_pids(all_pids)
