"""The study database blinks: a SQLite file held by a reader when a trial ends; transient errors retried, bounded.

Whole studies on the simulated engine (the engine does not matter here; the database does), on real SQLite files.
The PostgreSQL restart is in tests/e2e/test_postgres_faults.py.
"""

import sqlite3
import threading
import time

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy.exc import OperationalError

from optimizer.search import dbretry
from optimizer.search.dbretry import StorageUnavailableError, is_transient, with_retries
from tests.support.fakes import SimEngine, make_config, run_study

HOLD_S = 8.0  # longer than the SQLite driver's default busy wait (5 s), after which an unretried write fails


class ReaderAtTheEnd(SimEngine):
    """Trial 1's engine shuts down while a reader holds a read transaction on the study file: every write that
    ends the trial (its timings, curve, result and state) meets the reader's shared lock."""

    db = None
    released_at: list[float] = []

    async def shutdown(self):
        await super().shutdown()
        study = optuna.load_study(study_name="s", storage=f"sqlite:///{self.db}")
        if len(study.trials) == 2 and not self.released_at:
            held = threading.Event()
            threading.Thread(target=self._hold, args=(held,), daemon=True).start()
            held.wait(5)

    def _hold(self, held):
        conn = sqlite3.connect(self.db, isolation_level=None)
        conn.execute("BEGIN")
        conn.execute("SELECT count(*) FROM trials").fetchall()  # the shared lock, until the transaction ends
        held.set()
        time.sleep(HOLD_S)
        conn.execute("COMMIT")
        ReaderAtTheEnd.released_at.append(time.time())
        conn.close()


def test_a_reader_holding_the_sqlite_file_when_a_trial_ends_delays_the_write_and_loses_nothing(
        tmp_path, config_only_model):
    ReaderAtTheEnd.db = tmp_path / "s.db"
    ReaderAtTheEnd.released_at = []
    config = make_config(tmp_path, config_only_model, budget=3)
    t0 = time.monotonic()
    study = run_study(tmp_path, config, engine=ReaderAtTheEnd)
    assert ReaderAtTheEnd.released_at, "the reader never held the file"
    assert time.monotonic() - t0 >= HOLD_S
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE] * 3, states  # before: 'database is locked', trial 1 lost, run ended
    held = study.trials[1]
    assert held.values and held.user_attrs["result"]["output_throughput_tok_s"] == held.values[0]
    assert held.user_attrs["timings"]["total_s"] > 0
    # the trial's end was written after the reader let go: the write waited for it
    assert held.datetime_complete.timestamp() >= ReaderAtTheEnd.released_at[0] - 0.5
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1


def test_a_locked_sqlite_write_through_the_storage_waits_for_the_reader(tmp_path):
    """The storage itself, without a study loop: a write issued while a reader holds the file succeeds late."""
    from optimizer.search.study import storage_for

    db = tmp_path / "x.db"
    storage = storage_for(f"sqlite:///{db}")
    study = optuna.create_study(storage=storage, study_name="x")
    trial = study.ask()
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN")
    conn.execute("SELECT count(*) FROM trials").fetchall()
    releaser = threading.Timer(6.0, lambda: conn.execute("COMMIT"))
    releaser.start()
    t0 = time.monotonic()
    study.tell(trial, 1.0)
    waited = time.monotonic() - t0
    releaser.join()
    assert waited >= 5.5, "the write went through while the reader held the file?"
    assert optuna.load_study(study_name="x", storage=f"sqlite:///{db}").trials[0].state == TrialState.COMPLETE


def _locked():
    return OperationalError("UPDATE trials", {}, sqlite3.OperationalError("database is locked"))


def test_transient_errors_are_retried_with_backoff_then_stop_with_one_clear_line():
    sleeps, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise optuna.exceptions.StorageInternalError("commit failed") from _locked()
        return "written"

    assert with_retries(flaky, "writing", delays_s=(1, 2, 4), sleep=sleeps.append) == "written"
    assert sleeps == [1, 2]

    sleeps.clear()
    clock = [0.0]

    def sleep(s):
        sleeps.append(s)
        clock[0] += s

    with pytest.raises(StorageUnavailableError) as err:
        with_retries(lambda: (_ for _ in ()).throw(_locked()), "writing the end of trial 3", delays_s=(1, 2),
                     sleep=sleep, now=lambda: clock[0])
    assert sleeps == [1, 2]
    message = str(err.value)
    assert "\n" not in message and "run the same command again to resume" in message and "for 3 s" in message

    # bounded in time too: attempts that each wait long (a SQLite busy timeout) stop the retries early
    sleeps.clear()

    def slow_locked():
        clock[0] += 60
        raise _locked()

    clock[0] = 0.0
    with pytest.raises(StorageUnavailableError):
        with_retries(slow_locked, "writing", delays_s=(1, 2, 4, 8), sleep=sleep, now=lambda: clock[0],
                     max_total_s=150)
    assert sleeps == [1, 2] and clock[0] <= 150 + 60


def test_other_errors_are_not_retried():
    sleeps = []
    with pytest.raises(ValueError):
        with_retries(lambda: (_ for _ in ()).throw(ValueError("bad value")), "writing", delays_s=(1,),
                     sleep=sleeps.append)
    assert sleeps == [] and not is_transient(ValueError("x")) and is_transient(_locked())


def test_every_call_optuna_makes_through_the_storage_is_retried_or_deliberately_not():
    names = {n for n in dir(optuna.storages.RDBStorage) if not n.startswith("__") and
             callable(getattr(optuna.storages.RDBStorage, n))}
    deliberate = {"create_new_trial", "create_new_study", "delete_study", "set_trial_state_values",
                  "record_heartbeat"}
    optuna_internal = {n for n in names if n.startswith("_") and n != "_get_stale_trial_ids"}
    housekeeping = {"remove_session", "upgrade", "get_current_version", "get_head_version", "get_all_versions",
                    "get_heartbeat_interval", "get_heartbeat_stale_trial_callback", "get_failed_trial_callback",
                    "check_trial_is_updatable",
                    "is_heartbeat_enabled", "get_n_trials", "get_best_trial"}
    uncovered = names - set(dbretry.RETRIED_CALLS) - deliberate - optuna_internal - housekeeping
    assert not uncovered, f"new storage calls to decide on: {sorted(uncovered)}"


def test_sqlite_connections_wait_long_for_a_reader(tmp_path):
    from optimizer.search.study import storage_for

    storage = storage_for(f"sqlite:///{tmp_path}/y.db")
    assert storage.engine_kwargs["connect_args"]["timeout"] == dbretry.SQLITE_BUSY_TIMEOUT_S >= 30
