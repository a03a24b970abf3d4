"""The study database blinks: a PostgreSQL restart, a SQLite file a reader holds. Writes wait and retry, bounded.

SQLite: a reader's open transaction holds a shared lock that a committing writer must wait out; the driver's
default wait is 5 s, after which the write fails with "database is locked" and the finished trial would be lost.
Every connection here waits `SQLITE_BUSY_TIMEOUT_S` instead, and a write that still fails is retried.

PostgreSQL: while the server restarts, every statement fails with a connection error; once it is back, a fresh
connection works (pre-ping drops the dead ones from the pool). A call that fails that way is retried with backoff
(`RETRY_DELAYS_S`, at most `MAX_TOTAL_S` in all); if the database is still gone, the run stops with one line
(`StorageUnavailableError`) and the same command resumes it: the trial it was writing is redone, none is doubled.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import optuna
from optuna.trial import TrialState

from optimizer.core.errors import OptimizerError

SQLITE_BUSY_TIMEOUT_S = 60.0
RETRY_DELAYS_S: tuple[float, ...] = (0.5, 1, 2, 4, 8, 15, 30, 30)  # 90.5 s of waiting, 9 attempts
MAX_TOTAL_S = 150.0  # attempts and waits together: a SQLite attempt alone may take its busy timeout
_log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageUnavailableError(OptimizerError):
    """The study database stayed unreachable (or locked) through every retry."""


def engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options for the study database: a long SQLite busy wait; pre-ping for servers."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}
    return {"pool_pre_ping": True}


def is_transient(exc: BaseException) -> bool:
    """A lost connection or a locked SQLite file, anywhere in the cause chain: worth trying again."""
    from sqlalchemy import exc as sa_exc

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sa_exc.DBAPIError) and seen.connection_invalidated:
            return True
        if isinstance(seen, (sa_exc.OperationalError, sa_exc.InterfaceError)):
            return True
        if "database is locked" in str(seen) or "server closed the connection" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def with_retries(fn: Callable[[], T], what: str, delays_s: tuple[float, ...] | None = None,
                 sleep: Callable[[float], None] = time.sleep, max_total_s: float | None = None,
                 now: Callable[[], float] = time.monotonic) -> T:
    """`fn()`, tried again after each delay while it fails transiently, for at most `max_total_s` in all (a SQLite
    attempt itself may wait out its busy timeout); then StorageUnavailableError."""
    delays = RETRY_DELAYS_S if delays_s is None else delays_s
    limit_s = MAX_TOTAL_S if max_total_s is None else max_total_s
    start = now()
    for attempt in range(len(delays) + 1):
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if attempt == len(delays) or now() - start + delays[attempt] > limit_s:
                raise StorageUnavailableError(
                    f"the study database stayed unreachable for {now() - start:.0f} s while {what} "
                    f"({_root_message(exc)}): the finished trials are stored; when the database is back, run the "
                    f"same command again to resume (the interrupted trial is redone)") from None
            _log.warning("study database unreachable while %s (%s): retrying in %.1f s", what, _root_message(exc),
                         delays[attempt])
            sleep(delays[attempt])
    raise AssertionError("unreachable")


def storage_error_in(exc: BaseException) -> StorageUnavailableError | None:
    """The StorageUnavailableError behind `exc`, if any. When the database is gone, Optuna's own clean-up after a
    failed write fails too and surfaces as another error (an UnboundLocalError in `_run_trial`): the cause is in
    the chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, StorageUnavailableError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _root_message(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


# Calls that may be repeated: reads, and writes that set a value (setting it twice is setting it once).
RETRIED_CALLS = ("get_study_id_from_name", "get_study_name_from_id", "get_study_directions", "get_study_user_attrs",
            "get_study_system_attrs", "get_trial_user_attrs", "get_trial_system_attrs", "get_all_studies",
            "get_trial_param", "get_trial_params", "get_trial_number_from_id",
            "get_trial_id_from_study_id_trial_number", "get_trial", "get_all_trials",
            "get_best_trial", "set_study_user_attr", "set_study_system_attr", "set_trial_param",
            "set_trial_intermediate_value", "set_trial_user_attr", "set_trial_system_attr", "_get_stale_trial_ids")


class RetryingRDBStorage(optuna.storages.RDBStorage):
    """Optuna's RDBStorage whose calls survive a database that blinks (see the module's docstring).

    Not retried: `create_new_trial` (a lost acknowledgement would leave a second trial behind; if it fails, the
    run stops before any work is lost) and the study creation. `set_trial_state_values` is retried, and an
    attempt that finds the trial already in the state it was setting counts as done: the previous attempt had
    committed before its connection dropped. A heartbeat that cannot be written is skipped: the next one counts.
    """

    retry_delays_s: tuple[float, ...] | None = None  # None: RETRY_DELAYS_S

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Any = None) -> bool:
        failed_before = False

        def attempt() -> bool:
            nonlocal failed_before
            try:
                return super(RetryingRDBStorage, self).set_trial_state_values(trial_id, state, values)
            except optuna.exceptions.UpdateFinishedTrialError:
                if failed_before and super(RetryingRDBStorage, self).get_trial(trial_id).state == state:
                    return True
                raise
            except Exception:
                failed_before = True
                raise

        return with_retries(attempt, f"writing the end of trial {trial_id}", self.retry_delays_s)

    def record_heartbeat(self, trial_id: int) -> None:
        try:
            super().record_heartbeat(trial_id)
        except Exception as exc:
            if not is_transient(exc):
                raise
            _log.debug("heartbeat of trial %s skipped: %s", trial_id, _root_message(exc))


def _retrying(name: str) -> Callable[..., Any]:
    base = getattr(optuna.storages.RDBStorage, name)

    @functools.wraps(base)
    def call(self: RetryingRDBStorage, *args: Any, **kwargs: Any) -> Any:
        return with_retries(lambda: base(self, *args, **kwargs), f"calling {name}", self.retry_delays_s)

    return call


for _name in RETRIED_CALLS:
    setattr(RetryingRDBStorage, _name, _retrying(_name))


def rdb_storage(url: str, **kwargs: Any) -> RetryingRDBStorage:
    """A RetryingRDBStorage with the engine options for `url` (busy wait, pre-ping)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RetryingRDBStorage(url, engine_kwargs=engine_kwargs(url), **kwargs)
