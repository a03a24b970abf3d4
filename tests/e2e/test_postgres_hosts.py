"""Two hosts, one PostgreSQL study: a worker killed mid-trial on one host, its trial run again by the other.

Each `optimize` worker (the simulated engine: seconds a trial, no vLLM) runs in network and UTS namespaces of its own
(`unshare --net --uts`) under its own host name, host-a or host-b: no network at all, the study reached over
PostgreSQL's Unix socket (a path, shared across network namespaces). host-a is SIGKILLed while a trial of its own
runs. host-b cannot see host-a's processes as its own (another host name), so local recovery (search/recovery.py)
leaves that trial alone: Optuna's heartbeat marks it FAIL once it stops beating and host-b runs its config again
(study.py `RetryHeartbeatStaleTrialCallback`). Asserted from the stored study.

The workers run the CLI's own `main` with the heartbeat shortened (study.py HEARTBEAT_INTERVAL_S, HEARTBEAT_GRACE_S:
10 s and 60 s), set in the worker before it opens the storage; there is no setting for them, and 60 s of grace would
make the test wait a minute for nothing.

Skipped without OPTIMIZER_TEST_POSTGRES_URL (.ci/postgres start sets it) or where this machine cannot make the
namespaces; in CI (CI=true) the namespaces must work: a failure there, never a skip.
"""

import collections
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from optimizer.search.attrs import BASELINE, ENGINE_PARAMS, WORKER
from optimizer.search.study import FINISHED, search_trials, with_installed_driver
from tests.conftest import REPO, subprocess_env

URL = os.environ.get("OPTIMIZER_TEST_POSTGRES_URL")
HOSTS = ("host-a", "host-b")
BUDGET = 12
UNCLAIMED_AT_KILL = 5  # trials host-b still has to start after the kill: more than the grace lasts
HEARTBEAT_INTERVAL_S, HEARTBEAT_GRACE_S = 1, 4
# trials of 1-6 s (1500 requests a probe at most) and ~0.3 s between them: a worker is mostly mid-trial
ARGS = ["--engine", "sim", "--ttft-p99", "150ms", "--confirm", "0", "--no-served", "--num-requests", "1500",
        "--budget", str(BUDGET), "--quiet"]

# argv: HOSTNAME OPTIMIZE_ARGS...; run inside the namespaces, as root there
LAUNCHER = f"""
import socket, sys
socket.sethostname(sys.argv[1])
import optimizer.search.study as study
study.HEARTBEAT_INTERVAL_S, study.HEARTBEAT_GRACE_S = {HEARTBEAT_INTERVAL_S}, {HEARTBEAT_GRACE_S}
from optimizer.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

pytestmark = pytest.mark.skipif(not URL, reason="set OPTIMIZER_TEST_POSTGRES_URL (.ci/postgres start does) to run")


def _skip_or_fail(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}, and CI must run this test")
    pytest.skip(why)


@pytest.fixture
def unshare() -> list[str]:
    """The command that gives a process new network and UTS namespaces where it may set its host name."""
    # as root, or else (a container without CAP_SYS_ADMIN, a user) as root of a user namespace of its own
    tries = [["unshare", "--net", "--uts"], ["unshare", "--user", "--map-root-user", "--net", "--uts"]]
    for cmd in tries:
        try:
            probe = subprocess.run([*cmd, sys.executable, "-c", "import socket; socket.sethostname('probe')"],
                                   capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return cmd
    _skip_or_fail("this machine does not let a test make network and UTS namespaces (unshare --net --uts)")
    raise AssertionError("unreachable")


@pytest.fixture
def socket_url() -> str:
    """OPTIMIZER_TEST_POSTGRES_URL over the server's Unix socket (what a worker with no network can reach)."""
    pytest.importorskip("psycopg2", reason="the postgres extra (psycopg2-binary) is not installed")
    import psycopg2
    from sqlalchemy.engine import make_url

    conn = psycopg2.connect(URL)
    try:
        cur = conn.cursor()
        cur.execute("SHOW unix_socket_directories")
        dirs = [d.strip() for d in cur.fetchone()[0].split(",") if d.strip()]
        cur.execute("SHOW port")
        port = cur.fetchone()[0]
    finally:
        conn.close()
    here = [d for d in dirs if Path(d, f".s.PGSQL.{port}").exists()]
    if not here:
        _skip_or_fail(f"the PostgreSQL server's Unix socket ({dirs} port {port}) is not on this machine")
    url = make_url(URL).set(host=None, port=None, query={"host": here[0], "port": port})
    return url.render_as_string(hide_password=False)


def net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def own_namespace(pid: int, timeout_s: float = 30.0) -> str:
    """The network namespace of `pid` once `unshare` has made it (until then it is the test's)."""
    ours = net_namespace(os.getpid())
    deadline = time.monotonic() + timeout_s
    while (ns := net_namespace(pid)) == ours and time.monotonic() < deadline:
        time.sleep(0.05)
    return ns


def in_namespace(ns: str) -> list[int]:
    """The PIDs of the processes in network namespace `ns` (none once its last process is gone)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.readlink(p / "ns" / "net") == ns:
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def study_trials(storage: optuna.storages.BaseStorage, name: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    except KeyError:  # not created yet
        return []


def stopped(proc: subprocess.Popen, timeout_s: float = 5.0) -> bool:
    """SIGSTOP `proc` and wait until it is stopped: what the study shows then stays as it is until SIGCONT."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(proc.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                return True
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.01)
    return False


def kill_mid_trial(victim: subprocess.Popen, other: subprocess.Popen, victim_log: Path, other_log: Path, storage,
                   name: str, timeout_s: float = 120.0):
    """SIGKILL `victim` while a trial of its own measures its config (drawn in full), once it has finished one and
    enough of the budget is left for `other` to be still at work when the trial goes stale. Returns that trial as it
    stood at the kill."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc, log in ((victim, victim_log), (other, other_log)):
            assert proc.poll() is None, f"a worker ended before the kill:\n{log.read_text()[-3000:]}"
        if stopped(victim):  # frozen: its trial cannot end between the look and the kill
            trials = study_trials(storage, name)
            mine = [t for t in trials if (WORKER.of(t) or {}).get("pid") == victim.pid]
            # its config drawn in full (its engine arguments written): it is measuring that config
            running = [t for t in mine if t.state == TrialState.RUNNING and ENGINE_PARAMS.of(t)]
            claimed = sum(t.state in (*FINISHED, TrialState.RUNNING) for t in trials)
            if running and any(t.state in FINISHED for t in mine):
                if BUDGET - claimed < UNCLAIMED_AT_KILL:
                    pytest.fail(f"the study went too far ({claimed} of {BUDGET} trials claimed) before host-a was "
                                f"caught mid-trial with one finished: host-b might end before the heartbeat's grace")
                victim.kill()
                victim.wait(timeout=30)
                return running[0]
        victim.send_signal(signal.SIGCONT)
        time.sleep(0.3)
    pytest.fail("host-a was never caught mid-trial after a finished one")


def test_a_worker_killed_mid_trial_on_one_host_has_its_trial_run_again_by_the_other(tmp_path, model_cache, unshare,
                                                                                    socket_url):
    from optimizer.config.demo import embedded_model
    from optimizer.config.model import GPU_DEMO_NAME

    embedded_model(GPU_DEMO_NAME)  # the simulated engine's default model, made once here, not by both at once
    name = f"hosts_{uuid.uuid4().hex[:8]}"
    env = subprocess_env(model_cache)
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    namespaces: dict[str, str] = {}
    try:
        for host in HOSTS:
            logs[host] = tmp_path / f"{host}.err"
            with open(logs[host], "w") as err:
                procs[host] = subprocess.Popen(
                    [*unshare, sys.executable, "-c", LAUNCHER, host, *ARGS, "--storage", socket_url, "--study", name,
                     "--studies-dir", str(tmp_path / host)],
                    cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
            namespaces[host] = own_namespace(procs[host].pid)
        a, b = procs["host-a"], procs["host-b"]
        # each its own network namespace, neither the test's: a process there has only a loopback that is down
        assert len({net_namespace(os.getpid()), *namespaces.values()}) == 3

        storage = optuna.storages.RDBStorage(with_installed_driver(URL))
        killed = kill_mid_trial(a, b, logs["host-a"], logs["host-b"], storage, name)
        assert a.returncode == -signal.SIGKILL
        assert b.wait(timeout=180) == 0, logs["host-b"].read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    # the namespaces went with their processes: nothing is left in them
    assert all(not in_namespace(ns) for ns in namespaces.values()), namespaces

    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    finished = search_trials(study)
    assert len(finished) == BUDGET, [(t.number, t.state.name) for t in trials]  # the budget, exactly
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    assert len(trials) == BUDGET + 1  # the budget and the one killed trial, nothing else

    # both host names ran trials to their end, each its worker's own PID
    workers = {(WORKER.of(t)["host"], WORKER.of(t)["pid"]) for t in finished}
    assert workers == {("host-a", a.pid), ("host-b", b.pid)}, workers

    # the killed trial: host-a's, failed by the heartbeat, without a result
    dead = study.trials[killed.number]
    assert WORKER.of(dead) == WORKER.of(killed) and WORKER.of(dead)["host"] == "host-a"
    assert dead.state == TrialState.FAIL and dead.values is None
    assert [t.number for t in trials if t.state == TrialState.FAIL] == [killed.number]

    # its config run again, once, to its end, by host-b
    redone = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert len(redone) == 1, [(t.number, t.system_attrs) for t in trials]
    again = redone[0]
    assert again.state in FINISHED and again.params == dead.params == killed.params
    assert ENGINE_PARAMS.of(again) == ENGINE_PARAMS.of(dead)  # the same engine arguments
    assert BASELINE.of(again) == BASELINE.of(dead)
    assert WORKER.of(again)["host"] == "host-b" and WORKER.of(again)["pid"] == b.pid
    assert again.state == TrialState.PRUNED or (again.values and "result" in again.user_attrs)

    # no config ran twice but the killed one (once killed, once again); one baseline finished
    runs = collections.Counter("baseline" if BASELINE.of(t) else tuple(sorted(t.params.items())) for t in trials)
    key = "baseline" if BASELINE.of(dead) else tuple(sorted(dead.params.items()))
    assert runs.pop(key) == 2 and set(runs.values()) <= {1}, runs
    assert sum(BASELINE.of(t) for t in finished) == 1
    optuna.delete_study(study_name=name, storage=storage)
    print(f"host-a killed in trial #{killed.number}, run again as #{again.number} by host-b; "
          f"{len(finished)} of {BUDGET} finished, by {sorted(h for h, _ in workers)}")
