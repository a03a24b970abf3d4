"""`optimize --engine sim --gpus 8`, as a user runs it: trials of 1, 2 and 4 GPUs at once on 8 logical GPUs, one slot
process per GPU, the study in SQLite. Asserted from the stored study: no GPU served two trials at once, each trial
had exactly its layout's GPUs, trials overlapped, and the budget held exactly."""

import itertools
import signal
import subprocess
import sys
import time

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from optimizer.search.attrs import GPUS
from optimizer.search.study import search_trials
from tests.conftest import REPO, subprocess_env

LAYOUTS = "tensor_parallel_size: [1, 2, 4]\nmax_num_seqs: {min: 16, max: 256, log: true}\n"
SMALL = ["--engine", "sim", "--ttft-p99", "150ms", "--confirm", "0", "--num-requests", "300"]


def optimize(cache, studies, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "optimizer", *args, "--studies-dir", str(studies)], cwd=REPO,
                          env=subprocess_env(cache), capture_output=True, text=True, timeout=timeout)


def load(studies, name):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{studies}/{name}.db")


def test_trials_of_1_2_and_4_gpus_run_at_once_on_8_and_never_share_one(tmp_path, model_cache):
    space = tmp_path / "layouts.yaml"
    space.write_text(LAYOUTS)
    proc = optimize(model_cache, tmp_path, *SMALL, "--gpus", "8", "--space", str(space), "--budget", "14",
                    "--study", "pool")
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(tmp_path, "pool")
    trials = search_trials(study)
    assert len(trials) == 14  # the slots together ran exactly the budget
    done = [t for t in trials if GPUS.of(t)]
    assert len(done) == 14 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    sizes = set()
    for t in done:
        held = GPUS.of(t)["indices"]
        tp = t.params.get("tensor_parallel_size", 1)
        sizes.add(tp)
        assert len(held) == tp, (t.number, held, tp)
        if tp == 4:  # one NVLink island of the logical 8-GPU server
            assert len({i // 4 for i in held}) == 1, held
    assert sizes <= {1, 2, 4} and len(sizes) >= 2 and max(sizes) > 1  # the sampler's draws: layouts differ
    overlapped = 0
    for a, b in itertools.combinations(done, 2):
        ha, hb = GPUS.of(a), GPUS.of(b)
        if ha["reserved_unix_s"] < hb["released_unix_s"] and hb["reserved_unix_s"] < ha["released_unix_s"]:
            overlapped += 1
            assert not set(ha["indices"]) & set(hb["indices"]), (a.number, b.number)
    assert overlapped >= 4
    workers = {t.user_attrs["worker"]["pid"] for t in done}
    assert len(workers) > 1  # several slot processes ran them
    assert "on GPUs " in proc.stderr and "8 logical GPUs; up to 8 trials at once" in proc.stderr
    assert len(list((tmp_path / "pool.logs").glob("slot-*.log"))) == 8


def test_a_layout_larger_than_the_gpus_given_is_pruned_saying_so(tmp_path, model_cache):
    space = tmp_path / "big.yaml"
    space.write_text("tensor_parallel_size: [4]\n")
    proc = optimize(model_cache, tmp_path, *SMALL, "--gpus", "2", "--space", str(space), "--budget", "2",
                    "--study", "big")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pruned = [t for t in search_trials(load(tmp_path, "big")) if t.params.get("tensor_parallel_size") == 4]
    assert pruned and all(t.state == TrialState.PRUNED for t in pruned)
    assert "its layout needs 4 GPUs; the study's --gpus gives it 2" in proc.stderr


@pytest.mark.parametrize("args, fix", [
    (["--engine", "sim", "--gpus", "all"], "with --engine sim, give the number of logical GPUs"),
    (["--gpus", "2", "--device", "cuda"], ""),  # this machine: no CUDA build, or no GPU NVML reads
    (["--gpus", "0-1"], "NVML reads no GPU this process may use"),
])
def test_gpus_that_name_none_end_in_one_line_and_write_nothing(tmp_path, model_cache, args, fix):
    proc = optimize(model_cache, tmp_path, "--ttft-p99", "150ms", "--budget", "3", *args, "--study", "none",
                    timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert fix in lines[0]
    assert not (tmp_path / "none.db").exists() and not (tmp_path / "none.logs").exists()


def test_sigterm_stops_every_slot_in_one_line_and_a_rerun_resumes(tmp_path, model_cache):
    space = tmp_path / "layouts.yaml"
    space.write_text(LAYOUTS)
    args = [sys.executable, "-m", "optimizer", *SMALL, "--gpus", "4", "--space", str(space), "--budget", "40",
            "--num-requests", "2000", "--study", "stop", "--studies-dir", str(tmp_path)]
    main = subprocess.Popen(args, cwd=REPO, env=subprocess_env(model_cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    slots = []
    while time.monotonic() < deadline and len(slots) < 4:
        slots = [p for p in psutil.Process(main.pid).children() if "--slot" in p.cmdline()]
        time.sleep(0.5)
    assert len(slots) == 4
    time.sleep(8)  # trials under way
    main.send_signal(signal.SIGTERM)
    _, err = main.communicate(timeout=180)
    assert main.returncode != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and lines[-1].startswith(("interrupted", "stopped")), err[-2000:]
    gone, alive = psutil.wait_procs(slots, timeout=5)
    assert not alive
    finished = len(search_trials(load(tmp_path, "stop")))
    assert finished < 40
    again = optimize(model_cache, tmp_path, "--study", "stop", "--gpus", "4", "--budget", str(finished + 4),
                     timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = search_trials(load(tmp_path, "stop"))
    assert len(trials) == finished + 4 and all(t.state != TrialState.RUNNING for t in trials)


def test_the_dry_run_names_the_pool_and_writes_nothing(tmp_path, model_cache):
    proc = optimize(model_cache, tmp_path, *SMALL, "--gpus", "8", "--budget", "40", "--study", "dry", "--dry-run",
                    timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GPUs:     8 logical GPUs: up to 8 trials at once" in proc.stdout
    assert "simulated engine" in proc.stdout and list(tmp_path.iterdir()) == []
