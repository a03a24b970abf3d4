"""`optimize --ray ADDRESS` on a real Ray cluster of several nodes on this machine (Ray's own `cluster_utils`): a
head without GPUs, where `optimize` runs, and two worker nodes of 4 logical GPUs each; trials on the simulated
engine. Asserted from the stored study: every trial ran on one node with exactly its layout's GPUs, no GPU of a node
served two trials at once, trials overlapped, the budget held exactly; SIGTERM ends every task's trial in one line
and the same command resumes; a node killed mid-trial has the same trial run again on the other node, counted once.
"""

import itertools
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from optimizer.search.attrs import GPUS, INTERRUPTED, NODES, RETRY_OF
from optimizer.search.study import search_trials
from tests.conftest import REPO, subprocess_env

ray_cluster_utils = pytest.importorskip("ray.cluster_utils", reason="the ray extra: pip install 'optimizer[ray]'")

LAYOUTS = "tensor_parallel_size: [1, 2, 4]\nmax_num_seqs: {min: 16, max: 256, log: true}\n"
SMALL = ["--engine", "sim", "--ttft-p99", "150ms", "--confirm", "0", "--num-requests", "300"]


@pytest.fixture(scope="module")
def cluster():
    """A head without GPUs (where `optimize` runs) and two worker nodes of 4 logical GPUs each, started once for the
    module (a cluster takes seconds to start on two cores): the test that kills a node comes last."""
    # a lost node is found out within ~2 s (Ray's default: ~30 s), so that the test does not wait for it
    fast = {"health_check_period_ms": 500, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "_system_config": fast})
    try:
        c.workers = [c.add_node(num_cpus=4, num_gpus=4) for _ in range(2)]
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def command(cluster, studies, space, name, budget):
    return [sys.executable, "-m", "optimizer", *SMALL, "--ray", cluster.address, "--space", str(space), "--budget",
            str(budget), "--study", name, "--studies-dir", str(studies)]


def load(studies, name):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{studies}/{name}.db")


def placed(trial):
    """(node, GPU index) pairs the trial held, and when."""
    held, node = GPUS.of(trial), NODES.of(trial)[-1]["node"]
    return {(node, i) for i in held["indices"]}, held["reserved_unix_s"], held["released_unix_s"]


def test_trials_run_at_once_across_nodes_sigterm_cancels_them_in_one_line_and_a_resume_finishes(tmp_path, model_cache,
                                                                                                  cluster):
    """Trials of 1, 2 and 4 GPUs on two nodes of 4: each on one node with exactly its layout's GPUs, no GPU of a node
    serving two at once, several at once; SIGTERM mid-run ends every task's trial as interrupted, in one line; the
    same command resumes to the budget, the interrupted configs run again."""
    space = tmp_path / "layouts.yaml"
    space.write_text(LAYOUTS)
    longer = ["--num-requests", "600"]
    main = subprocess.Popen(command(cluster, tmp_path, space, "spread", 40) + longer, cwd=REPO,
                            env=subprocess_env(model_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    running = []
    try:
        while time.monotonic() < deadline and len(running) < 2 and main.poll() is None:
            time.sleep(0.2)
            try:
                running = [t for t in load(tmp_path, "spread").get_trials(deepcopy=False,
                                                                          states=(TrialState.RUNNING,)) if GPUS.of(t)]
            except (KeyError, optuna.exceptions.StorageInternalError):
                continue  # the study is being created
        assert len(running) >= 2, "no two trials were seen running at once"
        time.sleep(3)  # a few trials done
        main.send_signal(signal.SIGTERM)
        _, err = main.communicate(timeout=300)
    finally:
        if main.poll() is None:
            main.kill()
    assert main.returncode != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and lines[-1].startswith(("interrupted", "stopped")), err[-2000:]
    assert "Ray cluster: 3 nodes with 8 GPUs (" in err
    study = load(tmp_path, "spread")
    assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))  # every task ended its trial
    interrupted = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if INTERRUPTED.of(t)}
    assert {t.number for t in running} <= interrupted | {t.number for t in search_trials(study)}
    budget = max(len(search_trials(study)), 4) + 6
    again = subprocess.run(command(cluster, tmp_path, space, "spread", budget) + longer, cwd=REPO,
                           env=subprocess_env(model_cache), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert " of " in again.stderr  # the trial lines say the host
    study = load(tmp_path, "spread")
    trials = search_trials(study)
    assert len(trials) == budget and not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    assert {RETRY_OF.of(t) for t in trials} & interrupted  # an interrupted config ran again
    workers = {n.node_id for n in cluster.workers}
    sizes, nodes = set(), set()
    for t in trials:
        gpus, _, _ = placed(t)
        tp = t.params.get("tensor_parallel_size", 1)
        sizes.add(tp)
        assert len(gpus) == tp and len({n for n, _ in gpus}) == 1, (t.number, gpus, tp)  # its layout, on one node
        assert len(NODES.of(t)) == 1 and NODES.of(t)[0]["node"] in workers
        nodes |= {n for n, _ in gpus}
    assert sizes <= {1, 2, 4} and len(sizes) >= 2 and max(sizes) > 1
    assert nodes == workers  # the trials went to both nodes
    overlapped = 0
    for a, b in itertools.combinations(trials, 2):
        (ga, ra, fa), (gb, rb, fb) = placed(a), placed(b)
        if ra < fb and rb < fa:
            overlapped += 1
            assert not ga & gb, (a.number, b.number, ga & gb)
    assert overlapped >= 4


def test_a_node_killed_mid_trial_has_the_same_trial_run_on_another_and_the_budget_holds(tmp_path, model_cache,
                                                                                        cluster):
    space = tmp_path / "layouts.yaml"
    space.write_text("tensor_parallel_size: [1, 2]\nmax_num_seqs: {min: 16, max: 256, log: true}\n")
    budget = 6
    proc = subprocess.Popen(command(cluster, tmp_path, space, "lost", budget), cwd=REPO,
                            env=subprocess_env(model_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    by_id = {n.node_id: n for n in cluster.workers}
    killed = victim = None
    deadline = time.monotonic() + 300
    try:
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            try:
                running = load(tmp_path, "lost").get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            except (KeyError, optuna.exceptions.StorageInternalError):
                continue  # the study is being created
            for t in running:
                on = NODES.of(t)
                if t.number > 0 and GPUS.of(t) and on and on[-1]["node"] in by_id:
                    victim, killed = t.number, on[-1]["node"]
                    cluster.remove_node(by_id[killed], allow_graceful=False)  # its raylet and workers, SIGKILL
                    break
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "no trial was seen running on a worker node"
    assert proc.returncode == 0, err[-3000:]
    trials = search_trials(load(tmp_path, "lost"))
    assert len(trials) == budget  # the retry is the same trial: nothing counted twice
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    assert not [t for t in trials if RETRY_OF.of(t) is not None]  # no copy queued
    again = next(t for t in trials if t.number == victim)
    nodes = [n["node"] for n in NODES.of(again)]
    assert nodes[0] == killed and nodes[-1] != killed and len(nodes) >= 2, nodes
    assert placed(again)[0] and {n for n, _ in placed(again)[0]} == {nodes[-1]}  # it ran to the end on the other


@pytest.mark.parametrize("args, line", [
    (["--ray", "127.0.0.1:1"], "--ray 127.0.0.1:1: nothing answers there"),
    (["--ray", "127.0.0.1:1", "--gpus", "2"], "--ray runs trials on the Ray cluster's GPUs: leave out --gpus"),
])
def test_a_cluster_that_cannot_be_used_ends_in_one_line_and_writes_nothing(tmp_path, model_cache, args, line):
    proc = subprocess.run([sys.executable, "-m", "optimizer", *SMALL, *args, "--budget", "4", "--study", "no",
                           "--studies-dir", str(tmp_path / "studies")], cwd=REPO, env=subprocess_env(model_cache),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {line}"), proc.stderr
    assert not (tmp_path / "studies").exists()

