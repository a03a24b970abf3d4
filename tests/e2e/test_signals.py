"""A stop (Ctrl-C or SIGTERM) during the baseline prints one line, no traceback, and exits 130 or 143.

Each stop lands in a real study's running baseline: first a fake engine whose start takes a minute (fast), then the
real CLI on the real CPU engine (marker `engine`). Nothing finished is lost: the stopped trial is FAIL and marked
interrupted, and the next run resumes it.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import REPO, alive_pids, subprocess_env
from tests.support.fakes import polled_trials


def _running_trial(db, study_name, need_engine=False):
    for t in polled_trials(db.parent, study_name):
        if t.state == TrialState.RUNNING and (not need_engine or t.user_attrs.get("engine_processes")):
            return t
    return None


def _wait_running(proc, db, study_name, need_engine=False, timeout_s=240.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        t = _running_trial(db, study_name, need_engine)
        if t is not None:
            return t
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"no trial started running: {proc.communicate()[1][-3000:]}")


def _assert_one_clean_line(err, how):
    assert "Traceback" not in err, err
    assert "KeyboardInterrupt" not in err and "failed with" not in err, err
    last = err.strip().splitlines()[-1]
    assert last == f"interrupted ({how}): the running trial was stopped; run the same command again to resume", err


@pytest.mark.parametrize("sig,code,how", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_a_stop_during_the_baseline_prints_one_line(tmp_path, config_only_model, sig, code, how):
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.stop_helper", str(tmp_path), str(config_only_model)],
                            cwd=REPO, env=subprocess_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_running(proc, tmp_path / "s.db", "s", timeout_s=180)
        assert proc.stdout.readline().strip() == "engine starting"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    _assert_one_clean_line(err, how)
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db")
    [baseline] = study.trials
    assert baseline.state == TrialState.FAIL and baseline.user_attrs["interrupted"] == "Ctrl-C or SIGTERM"
    assert baseline.user_attrs["baseline"] is True


def test_a_second_sigterm_does_not_cut_the_shutdown_short(tmp_path, config_only_model):
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.stop_helper", str(tmp_path), str(config_only_model)],
                            cwd=REPO, env=subprocess_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_running(proc, tmp_path / "s.db", "s", timeout_s=180)
        proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    _assert_one_clean_line(err, "SIGTERM")


# A budget of 1: both stops land in the baseline, and the resume finishes it; a search trial after it would add an
# engine start and its replays and prove nothing more (tests/e2e/test_crash_engine.py resumes past the baseline).
# The embedded model named, as there: no demo probe (an engine start of its own) before the first stop; the probe
# is tests/e2e/test_e2e_engine.py's.
ENGINE_ARGS = ["--model", "tiny-llama-17m", "--num-requests", "20", "--input-len", "16:96", "--output-len", "4:12",
               "--ttft-p99", "150ms", "--budget", "1"]


@pytest.mark.engine
def test_sigterm_then_ctrl_c_during_the_real_baseline(tmp_path, model_cache, tiny_model):
    """`timeout`/`docker stop` during the baseline's engine start, then Ctrl-C during its replays, then resume."""
    db = tmp_path / "default.db"

    def start():
        return subprocess.Popen([sys.executable, "-m", "optimizer", *ENGINE_ARGS, "--studies-dir", str(tmp_path)],
                                cwd=REPO, env=subprocess_env(model_cache), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    for sig, code, how, need_engine in [(signal.SIGTERM, 143, "SIGTERM", False),
                                        (signal.SIGINT, 130, "Ctrl-C", True)]:
        proc = start()
        try:
            trial = _wait_running(proc, db, "default", need_engine=need_engine)
            if not need_engine:
                time.sleep(3)  # inside vLLM's engine start
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == code, err[-3000:]
        _assert_one_clean_line(err, how)
        stopped = optuna.load_study(study_name="default", storage=f"sqlite:///{db}").trials[trial.number]
        assert stopped.state == TrialState.FAIL and stopped.user_attrs.get("baseline") is True
        pids = [int(p) for p, _ in stopped.user_attrs.get("engine_processes", [])]
        assert not alive_pids(pids), "the stop shut the engine down"
    proc = start()
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name="default", storage=f"sqlite:///{db}")
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(finished) == 1 and finished[0].user_attrs.get("baseline") is True
    assert len(study.get_trials(states=(TrialState.FAIL,))) == 2
    all_pids = [int(p) for t in study.trials for p, _ in t.user_attrs.get("engine_processes", [])]
    assert not alive_pids(all_pids)


LEAKS_SHARED_MEMORY = """
import sys
from multiprocessing import shared_memory
if sys.argv[1] == "quiet":
    from optimizer.core.signals import quiet_resource_tracker
    quiet_resource_tracker()
shm = shared_memory.SharedMemory(create=True, size=64)  # left registered, as by an engine a stop ended
print(shm.name)
shm.close()
"""


@pytest.mark.parametrize("mode", ["quiet", "plain"])
def test_the_resource_tracker_cleans_up_a_stopped_engine_without_a_line_after_ours(tmp_path, mode):
    env = {k: v for k, v in subprocess_env(tmp_path).items() if k != "PYTHONWARNINGS"}
    out = subprocess.run([sys.executable, "-c", LEAKS_SHARED_MEMORY, mode], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    name = out.stdout.strip()
    assert not (Path("/dev/shm") / name).exists(), "the tracker still unlinks what was left"
    if mode == "quiet":
        assert out.stderr == "", out.stderr
    else:  # what a stopped run printed after its one line before the filter
        assert "leaked shared_memory objects" in out.stderr
