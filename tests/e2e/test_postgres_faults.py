"""PostgreSQL blinks while a trial ends: the result is written once the server is back; or, when it stays down, the
worker stops with one line and the same command resumes. Nothing finished is lost, nothing doubled.

A private PostgreSQL server of its own (initdb in a temporary folder, password authentication), since the test
stops and starts it: the shared one of `.ci/postgres` is left alone. The password is only in PGPASSWORD, never
in a URL, which is how the tool's "export it:" line asks to run it. Skipped where PostgreSQL or psycopg2 is missing.
"""

import glob
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import REPO, subprocess_env

BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
PASSWORD = "blink-Secret-42"
BUDGET = 4

pytestmark = pytest.mark.skipif(not BIN or shutil.which("su") is None or os.geteuid() != 0,
                                reason="needs PostgreSQL's server binaries (apt-get install postgresql) and root "
                                       "(to run them as the postgres user)")


def _as_postgres(cmd: str) -> str:
    return f"su postgres -s /bin/sh -c {subprocess.list2cmdline([cmd])}"


class Server:
    """A throwaway PostgreSQL on 127.0.0.1 at a free port, password authentication (scram-sha-256)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="optimizer-pgfault-", dir="/tmp"))
        shutil.chown(self.dir, "postgres")
        self.dir.chmod(0o755)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        pwfile = self.dir / "pw"
        pwfile.write_text(PASSWORD + "\n")
        shutil.chown(pwfile, "postgres")
        bin_ = BIN[-1]
        data = self.dir / "data"
        subprocess.run(_as_postgres(f"{bin_}/initdb -D {data} -U postgres --auth=scram-sha-256 --pwfile={pwfile}"),
                       shell=True, check=True, capture_output=True)
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        self.start_cmd = _as_postgres(f"{bin_}/pg_ctl -D {data} -l {self.dir}/log -w -o '{opts}' start")
        self.stop_cmd = _as_postgres(f"{bin_}/pg_ctl -D {data} -w -m fast stop")
        self.start()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"  # no password: it is in PGPASSWORD

    def start(self) -> None:
        subprocess.run(self.start_cmd, shell=True, check=True, capture_output=True)

    def stop(self) -> None:
        subprocess.run(self.stop_cmd, shell=True, capture_output=True)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def server():
    pytest.importorskip("psycopg2", reason="the postgres extra (psycopg2-binary) is not installed")
    s = Server()
    try:
        yield s
    finally:
        s.close()


def env(server, tmp_path):
    return {**subprocess_env(tmp_path), "PGPASSWORD": PASSWORD, "PG_STOP": server.stop_cmd,
            "PG_START": server.start_cmd}


def worker(server, tmp_path, model, outage_s, timeout_s=300):
    proc = subprocess.run([sys.executable, "-m", "tests.support.pg_worker", server.url, str(tmp_path), str(model),
                           str(BUDGET), str(outage_s)], cwd=REPO, env=env(server, tmp_path), capture_output=True,
                          text=True, timeout=timeout_s)
    return proc.returncode, proc.stderr


def load(server):
    os.environ["PGPASSWORD"] = PASSWORD
    try:
        return optuna.load_study(study_name="s", storage=server.url.replace("postgresql://",
                                                                             "postgresql+psycopg2://"))
    finally:
        del os.environ["PGPASSWORD"]


def check_no_loss_no_double(study):
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(finished) == BUDGET, [t.state for t in study.trials]
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    assert sum(bool(t.user_attrs.get("baseline")) for t in finished) == 1
    for t in finished:
        assert t.state == TrialState.PRUNED or (t.values and "result" in t.user_attrs and "curve" in t.user_attrs)
    return finished


def test_a_restart_while_a_trial_ends_is_waited_out_and_the_result_written(server, tmp_path, config_only_model):
    code, err = worker(server, tmp_path, config_only_model, outage_s=4.0)
    assert code == 0, err[-3000:]
    assert "database stopped" in err and "database back" in err and "retrying" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    study = load(server)
    finished = check_no_loss_no_double(study)
    assert len(study.trials) == BUDGET  # nothing failed, nothing redone, nothing doubled
    print(f"restart waited out: {len(finished)} of {BUDGET} trials finished, 0 failed")


def test_a_database_that_stays_down_stops_the_worker_in_one_line_and_the_same_command_resumes(
        server, tmp_path, config_only_model):
    code, err = worker(server, tmp_path, config_only_model, outage_s=-1)
    assert code == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the study database stayed unreachable") and "run the same command again" in last
    assert "Traceback" not in err, err[-3000:]
    server.start()
    before = load(server)
    done_before = {t.number: t.values for t in before.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))}
    stuck = [t for t in before.trials if t.state == TrialState.RUNNING]
    assert len(done_before) >= 1 and len(stuck) == 1, [t.state for t in before.trials]

    code, err = worker(server, tmp_path, config_only_model, outage_s=0)  # the same command, the server back
    assert code == 0, err[-3000:]
    after = load(server)
    finished = check_no_loss_no_double(after)
    for number, values in done_before.items():  # what was finished is still there, unchanged
        assert after.trials[number].values == values
    interrupted = after.trials[stuck[0].number]
    assert interrupted.state == TrialState.FAIL and interrupted.user_attrs["interrupted"] == "its optimize process died"
    redone = [t for t in finished if t.user_attrs.get("retry_of") == interrupted.number]
    assert len(redone) == 1 and redone[0].params == interrupted.params  # redone once, not twice
    print(f"outage: {len(done_before)} trials finished before, {len(finished)} after the resume, 1 redone")


def test_the_export_hint_runs_as_printed_with_the_password_in_pgpassword(server, tmp_path, config_only_model):
    from optimizer.core.hints import export_hint

    code, err = worker(server, tmp_path, config_only_model, outage_s=0)
    assert code == 0, err[-3000:]
    with_password = server.url.replace("postgres@", f"postgres:{PASSWORD}@")
    hint = export_hint("s", with_password, str(tmp_path))
    assert PASSWORD not in hint and "PGPASSWORD" in hint
    argv = shlex.split(hint[len("export it: "):].split("  (", 1)[0])
    proc = subprocess.run([sys.executable, "-m", "optimizer", *argv[1:]], cwd=REPO, env=env(server, tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 1: no trial meets the limit, said in one line
    assert "cannot open storage" not in proc.stderr and "Traceback" not in proc.stderr
