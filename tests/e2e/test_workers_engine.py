"""Many workers on one study through PostgreSQL, with the real CPU engine: no duplicates, budget kept overall."""

import os
import subprocess
import sys
import uuid

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import REPO, subprocess_env

pytestmark = pytest.mark.engine

URL = os.environ.get("OPTIMIZER_TEST_POSTGRES_URL")


@pytest.mark.skipif(not URL, reason="set OPTIMIZER_TEST_POSTGRES_URL (.ci/postgres start does) to run")
def test_two_workers_finish_one_study_without_duplicates(tmp_path, model_cache, tiny_model):
    study_name = f"workers-{uuid.uuid4().hex[:8]}"
    # a budget of 3: the baseline and two searched configs, the least where both workers run trials and two
    # searched configs could collide; each trial more is an engine start and its replays
    cmd = [sys.executable, "-m", "optimizer", "--storage", URL, "--study", study_name, "--budget", "3",
           "--model", "tiny-llama-17m", "--ttft-p99", "150ms", "--num-requests", "20", "--input-len", "16:96", "--output-len", "4:12",
           "--space", str(tmp_path / "space.yaml"), "--studies-dir", str(tmp_path)]
    # small memory fractions: two engines share this machine's memory
    (tmp_path / "space.yaml").write_text("gpu_memory_utilization: {min: 0.15, max: 0.25}\n")
    workers = [subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(model_cache), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [w.communicate(timeout=1200) for w in workers]
    for w, (_, err) in zip(workers, outs):
        assert w.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name=study_name, storage=URL.replace("postgresql://", "postgresql+psycopg2://"))
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(finished) == 3  # the budget holds across workers
    assert len({t.number for t in study.trials}) == len(study.trials)
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    by_worker = {t.user_attrs["worker"]["pid"] for t in finished}
    assert len(by_worker) == 2, "both workers ran trials"
    searched = [tuple(sorted(t.params.items())) for t in finished if t.params]
    assert len(searched) == len(set(searched)), "no parameter set measured twice"
