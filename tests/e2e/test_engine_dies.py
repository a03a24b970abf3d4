"""The engine dies, on the real CPU engine: SIGKILL its engine core in each phase of a trial (start, warm-up,
prefix-cache reset, replay, stats collection, between replays, shutdown), placed there by the watch's test hook.

The trial ends PRUNED as `engine_died` within seconds, naming the phase and the process, with the engine log's tail;
none of its processes is left; the next trial starts its own engine and runs normally; the study ends with its budget
and exit code 0. A death at shutdown leaves the measured trial as it is.
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from optuna.trial import TrialState

from optimizer.core import failures
from optimizer.core.errors import EngineDiedError
from optimizer.decision.report import summary_text
from optimizer.measurement.engine_watch import BETWEEN, PAUSE_ENV, REPLAY, RESET, SHUTDOWN, START, STATS, WARM_UP
from optimizer.core.processes import log_tail
from tests.conftest import REPO, alive_pids, subprocess_env
from tests.support.fakes import SimEngine, load, make_config, run_study

ARGS = ["--model", "tiny-llama-7m", "--num-requests", "40", "--input-len", "16:96", "--output-len", "16:32",
        "--ttft-p99", "150ms"]
KILLED_IN = [START, WARM_UP, RESET, REPLAY, STATS, BETWEEN]  # the trial is pruned; SHUTDOWN: it is complete


def engine_core(pids):
    """The engine core among a trial's recorded processes (vLLM names it EngineCore)."""
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                return pid
        except psutil.NoSuchProcess:
            pass
    return None


def kill_in_phase(tmp_path, model_cache, phase, extra=()):
    """`optimize` on the real CPU engine, its baseline's engine core SIGKILLed in `phase`: the run holds there
    (engine_watch.PAUSE_ENV) until the kill, so that it lands in that phase every time. Returns the study, the
    killed PID, when it was killed (wall clock) and the run's output."""
    pause = tmp_path / "pause.json"
    env = {**subprocess_env(model_cache), PAUSE_ENV: f"{phase}:{pause}"}
    proc = subprocess.Popen([sys.executable, "-m", "optimizer", *ARGS, *extra, "--studies-dir", str(tmp_path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not pause.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        time.sleep(0.1)  # the file is written whole before the run waits; read it once it is there
        killed = engine_core(json.loads(pause.read_text())["pids"])
        assert killed is not None, f"no EngineCore among {pause.read_text()}"
        killed_at = time.time()
        os.kill(killed, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return load(tmp_path), killed, killed_at, out + err


def assert_pruned_for_death(died, phase, killed, killed_at, output):
    assert died.state == TrialState.PRUNED, output[-3000:]
    assert died.user_attrs["pruned_reason"] == failures.ENGINE_DIED
    assert f"the engine died during the {phase}" in died.user_attrs["pruned_detail"]
    assert str(killed) in died.user_attrs["pruned_detail"]  # names the process that is gone
    assert died.user_attrs["log_excerpt"].strip(), "the engine log's tail is stored with the trial"
    assert not alive_pids([int(p) for p, _ in died.user_attrs["engine_processes"]]), "a process of it is left"
    assert "Traceback" not in output, output[-3000:]  # vLLM's own traceback went to the trial's log
    assert "engine_died" in output  # the trial's line says why it could not run
    to_pruned_s = died.datetime_complete.timestamp() - killed_at
    print(f"killed in the {phase}: engine core {killed}; PRUNED {to_pruned_s:.1f} s after the kill")
    assert to_pruned_s < 30, f"PRUNED {to_pruned_s:.1f} s after the kill"  # the engine's shutdown included


@pytest.mark.engine
@pytest.mark.parametrize("phase", [p for p in KILLED_IN if p != REPLAY])
def test_sigkill_of_the_engine_core_in_each_phase_prunes_the_trial_within_seconds(tmp_path, model_cache, tiny_model,
                                                                                  phase):
    study, killed, killed_at, output = kill_in_phase(tmp_path, model_cache, phase, ["--budget", "1"])
    assert_pruned_for_death(study.trials[0], phase, killed, killed_at, output)
    assert len(study.trials) == 1


@pytest.mark.engine
def test_sigkill_of_the_engine_core_mid_replay_prunes_the_trial_and_the_study_goes_on(tmp_path, model_cache,
                                                                                      tiny_model):
    study, killed, killed_at, output = kill_in_phase(tmp_path, model_cache, REPLAY, ["--budget", "2"])
    died, after = study.trials[0], study.trials[1]
    assert_pruned_for_death(died, REPLAY, killed, killed_at, output)
    # the next trial started its own engine and measured normally
    assert after.state == TrialState.COMPLETE and after.user_attrs.get("engine_config")
    assert after.user_attrs["curve"] and after.values[0] > 0
    assert killed not in [int(p) for p, _ in after.user_attrs["engine_processes"]]
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(finished) == 2 and not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING, TrialState.FAIL))
    assert not alive_pids([int(p) for t in study.trials for p, _ in t.user_attrs.get("engine_processes", [])])


@pytest.mark.engine
def test_sigkill_of_the_engine_core_at_shutdown_keeps_the_measured_trial_and_leaves_no_process(tmp_path, model_cache,
                                                                                               tiny_model):
    study, killed, killed_at, output = kill_in_phase(tmp_path, model_cache, SHUTDOWN, ["--budget", "1"])
    done = study.trials[0]
    assert done.state == TrialState.COMPLETE and done.values[0] > 0, output[-3000:]
    assert done.datetime_complete.timestamp() - killed_at < 30
    assert not alive_pids([int(p) for p, _ in done.user_attrs["engine_processes"]])


@pytest.mark.engine
def test_sigkill_of_the_served_engine_core_mid_replay_prunes_the_trial(tmp_path, model_cache, tiny_model):
    """The same through `vllm serve` (--backend http): the API server and its engine core are watched alike."""
    study, killed, killed_at, output = kill_in_phase(tmp_path, model_cache, REPLAY, ["--budget", "1", "--backend",
                                                                                      "http"])
    assert_pruned_for_death(study.trials[0], REPLAY, killed, killed_at, output)


class DiesInTheBaseline(SimEngine):
    """The baseline's engine dies in its first replay, after writing to its log (as vLLM's engine core does)."""

    def simulate_replay(self, requests, arrivals_s):
        if len(requests) > 10 and DiesInTheBaseline.deaths == 0:  # the first measured replay (not the warm-up)
            DiesInTheBaseline.deaths += 1
            raise EngineDiedError("the engine died during the replay: EngineCore gone; engine process 4242 gone")
        return super().simulate_replay(requests, arrivals_s)

    async def start(self, params, log_path=None):
        resolved = await super().start(params, log_path)
        if log_path is not None:
            with log_path.open("a") as f:
                f.write("INFO engine core started\nINFO step 1\n")
        return resolved

    deaths = 0


def test_an_engine_death_prunes_the_trial_with_its_log_and_the_study_goes_on(tmp_path, config_only_model):
    """The same on the simulator, fast: the baseline's engine dies; the study still ends with its budget, and the
    end-of-run summary copes with a baseline that could not be measured."""
    DiesInTheBaseline.deaths = 0
    config = make_config(tmp_path, config_only_model, budget=3)
    study = run_study(tmp_path, config, engine=DiesInTheBaseline)
    died = study.trials[0]
    assert died.state == TrialState.PRUNED and died.user_attrs["pruned_reason"] == failures.ENGINE_DIED
    assert "engine process 4242 gone" in died.user_attrs["pruned_detail"]
    assert "INFO step 1" in died.user_attrs["log_excerpt"]
    assert [t.state for t in study.trials[1:]] == [TrialState.COMPLETE] * 2
    assert len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == 3
    text = summary_text(study, config)
    assert text.strip()


def test_log_tail_keeps_whole_lines_from_the_end(tmp_path):
    log = tmp_path / "trial.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    tail = log_tail(log, max_chars=100)
    assert tail.endswith("line 999\n") and tail.startswith("line ") and len(tail) <= 100
    assert log_tail(tmp_path / "missing.log") == ""


def test_vllm_front_end_errors_go_to_the_trial_log_while_the_engine_runs(tmp_path):
    import logging

    from optimizer.engines.front_end_log import FrontEndLog

    vllm_logger = logging.getLogger("vllm")
    before = list(vllm_logger.handlers)
    log = tmp_path / "trial.log"
    redirect = FrontEndLog(log)
    try:
        raise RuntimeError("engine core gone")
    except RuntimeError:
        logging.getLogger("vllm.v1.engine.async_llm").exception("AsyncLLM output_handler failed.")
    redirect.close()
    text = log.read_text()
    assert "AsyncLLM output_handler failed." in text and "Traceback" in text and "engine core gone" in text
    assert vllm_logger.handlers == before  # the terminal gets vLLM's messages back after the trial
