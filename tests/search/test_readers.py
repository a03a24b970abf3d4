"""Readers beside the writer: `optimize report`, `optimize export` and dashboard-style reads of the same SQLite file,
each in its own process and in a loop, while a study runs (simulated engine, whose start takes a while as a real
one's does). The study loses nothing, no reader sees a half-written trial or crashes, and the readers change
nothing in the file.
"""

import asyncio
import hashlib
import json
import subprocess
import sys
import time

import pytest
from optuna.trial import TrialState

from optimizer.search.runner import prepare, run
from tests.conftest import REPO, subprocess_env
from tests.support.reader_loop import half_written, one_pass
from tests.support.fakes import SimEngine, make_config

BUDGET = 8


class SlowStart(SimEngine):
    async def start(self, params, log_path=None):
        await asyncio.sleep(1.0)  # an engine start: readers get to look at a RUNNING trial
        return await super().start(params, log_path)


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_beside_readers(tmp_path, config_only_model, kinds):
    config = make_config(tmp_path, config_only_model, budget=BUDGET)
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SlowStart, memory_probe=lambda: None)
    stop = tmp_path / "stop"
    readers = {}
    for kind in kinds:
        out = tmp_path / f"out-{kind}"
        out.mkdir()
        readers[kind] = subprocess.Popen([sys.executable, "-m", "tests.support.reader_loop", kind, str(tmp_path),
                                          str(out), str(stop)], cwd=REPO, env=subprocess_env(tmp_path),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3.0)  # the readers are up and looping before the first trial
    t_start = time.time()
    try:
        study = run(prepared, quiet=True)
    finally:
        t_end = time.time()
        stop.touch()
    passes = {}
    for kind, proc in readers.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        passes[kind] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return study, passes, t_start, t_end


def check_study_lost_nothing(study):
    states = [t.state for t in study.trials]
    assert len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == BUDGET, states
    assert TrialState.FAIL not in states and TrialState.RUNNING not in states, states
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1
    assert half_written(study.trials) == []


def check_passes(passes, t_start, t_end, finished_numbers):
    for kind, seen in passes.items():
        during = [p for p in seen if t_start <= p["t"] <= t_end]
        assert len(during) >= 2, f"{kind} read only {len(during)} times while the study ran"
        crashes = [p for p in seen if p["code"] == "crash" or "internal error" in str(p.get("err"))]
        assert not crashes, crashes
        assert all(not p.get("half") for p in seen), [p for p in seen if p.get("half")]
        counts = [p["finished"] for p in seen if "finished" in p]
        assert counts == sorted(counts), f"{kind} saw finished trials disappear: {counts}"
        for p in seen:
            if kind == "report":
                assert p["code"] == 0, p
                assert set(p["front"]) <= finished_numbers, p  # the front only ever holds finished trials
            if kind == "export":  # 1: nothing meets the limit yet, said in one line
                assert p["code"] == 0 or (p["code"] == 1 and "nothing to export" in p["err"]), p
    return {k: len(v) for k, v in passes.items()}


def test_report_export_and_optuna_readers_beside_a_running_study(tmp_path, config_only_model):
    study, passes, t0, t1 = run_beside_readers(tmp_path, config_only_model, ["report", "export", "optuna"])
    check_study_lost_nothing(study)
    finished = {t.number for t in study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))}
    counts = check_passes(passes, t0, t1, finished)
    assert passes["optuna"][-1]["finished"] == BUDGET  # the last pass after the end sees every trial
    print(f"reads while the study ran: {counts}")

    # The readers change nothing: the file is byte for byte the same after each reads it once more.
    db = tmp_path / "s.db"
    before = digest(db)
    for kind in ("report", "export", "optuna"):
        result = one_pass(kind, tmp_path, tmp_path / f"out-{kind}")
        assert result["code"] == 0, result
        assert digest(db) == before, f"{kind} wrote to the study database"
    assert not (tmp_path / "s.db-journal").exists()


def test_optuna_dashboard_api_beside_a_running_study(tmp_path, config_only_model):
    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed: pip install "
                                                   "'vllm-config-optimizer[test]' (the test extra has it)")
    study, passes, t0, t1 = run_beside_readers(tmp_path, config_only_model, ["dashboard"])
    check_study_lost_nothing(study)
    check_passes(passes, t0, t1, {t.number for t in study.trials})
    db = tmp_path / "s.db"
    before = digest(db)
    assert one_pass("dashboard", tmp_path, tmp_path)["code"] == 0
    assert digest(db) == before, "optuna-dashboard wrote to the study database"
