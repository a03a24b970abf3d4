"""Create, load and resume a study; run it to its budget of finished trials.

The resolved StudyConfig is stored with the study, so `optimize --study NAME` resumes with no flags repeated.
The budget counts finished trials (COMPLETE or PRUNED); a trial that crashed or was interrupted does not count
and its work is redone.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from pydantic import ValidationError

from optimizer.config.settings import StudyConfig
from optimizer.core.errors import UsageError
from optimizer.search.attrs import BASELINE, CONFIRM, STUDY_CONFIG, STUDY_CONFIRMS, WORKER
from optimizer.search.breaker import is_environment_failure
from optimizer.search.measured import check_schema
from optimizer.search.recovery import RUN_ENV, SLOT_ENV, recover

# A worker that stops beating for HEARTBEAT_GRACE_S has its trial failed and queued again (by any worker).
HEARTBEAT_INTERVAL_S = 10
HEARTBEAT_GRACE_S = 60
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
DIRECTIONS = ["maximize", "minimize"]  # output throughput (tok/s), TTFT P99 (ms) at the best sustained rate
METRIC_NAMES = ["output_throughput_tok_s", "ttft_p99_ms"]  # what optuna-dashboard shows as the objectives
CONFIRMATION_SUFFIX = ".confirmation"  # the study that holds a study's confirmation runs: NAME.confirmation


def default_storage_url(study_name: str, studies_dir: Path) -> str:
    return f"sqlite:///{(studies_dir / f'{study_name}.db').resolve()}"


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<storage URL>"


def storage_for(url: str) -> optuna.storages.BaseStorage:
    """Open the storage, or fail with a message that names the fix (the password never printed)."""
    from optimizer.core.paths import check_sqlite_url

    check_sqlite_url(url)  # a path that cannot hold a database is one clear line, not FileExistsError
    url = with_installed_driver(url)
    try:
        return with_schema_retry(lambda: _rdb_storage(url))
    except Exception as exc:
        if "locked" in str(exc).lower():
            raise UsageError(f"the study database {redact(url)} is locked by another process: wait for it to "
                             f"finish, or use PostgreSQL (--storage postgresql://...) for several workers") from None
        raise UsageError(f"cannot open storage {redact(url)} ({type(exc).__name__}): check the URL (e.g. "
                         f"sqlite:///studies/NAME.db or postgresql://user:pass@host/db) and that the "
                         f"database is reachable") from None


def _rdb_storage(url: str) -> optuna.storages.RDBStorage:
    from optimizer.search.dbretry import rdb_storage

    # a database that blinks (PostgreSQL restarted, SQLite held by a reader): waits and bounded retries
    return rdb_storage(
        url,
        heartbeat_interval=HEARTBEAT_INTERVAL_S,
        grace_period=HEARTBEAT_GRACE_S,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2),
    )


def with_schema_retry(make: Callable[[], Any], attempts: int = 5) -> Any:
    """Workers starting together on an empty database race to create the tables; the loser retries."""
    import time

    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    for attempt in range(attempts):
        try:
            return make()
        except (IntegrityError, ProgrammingError, OperationalError):  # SQLite: "table ... already exists"
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def with_installed_driver(url: str) -> str:
    """`postgresql://` means psycopg 3 to SQLAlchemy 2.1; use psycopg2 (the `postgres` extra) when that is what is here."""
    if url.startswith("postgresql://"):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def stored_config(storage: optuna.storages.BaseStorage, study_name: str) -> StudyConfig | None:
    """The config stored with an existing study, or None when no such study exists."""
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        return None
    raw = STUDY_CONFIG.of(study)
    deadline = time.monotonic() + 10.0
    while raw is None and not study.get_trials(deepcopy=False) and time.monotonic() < deadline:
        time.sleep(0.2)  # another worker made it a moment ago (open_study) and stores its config next: wait for it
        raw = STUDY_CONFIG.of(study)
    if raw is None:
        raise UsageError(f"study {study_name!r} exists but was not made by optimize: choose another --study name")
    check_schema(study)  # an older optimizer's study is refused in one line before its settings are read
    try:
        return StudyConfig.model_validate(json.loads(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UsageError(f"study {study_name!r} was stored by another version of optimize (its setting "
                         f"{'.'.join(str(p) for p in first['loc'])!r} does not read: {first['msg']}): start a new "
                         f"study under another --study name, or read this one with the optimizer that made it") \
            from None


def worker_seed(config: StudyConfig) -> int:
    """The study's seed for a lone SQLite worker; mixed with the slot's number for a slot of a run (SLOT_ENV, so
    that a rerun draws alike), and with host and PID where workers of separate runs share a study: identically
    seeded workers would propose identical parameter sets."""
    import zlib

    slot = os.environ.get(SLOT_ENV)
    if slot is not None:
        return zlib.crc32(f"{config.seed}:slot:{slot}".encode())
    if config.storage_url.startswith("sqlite"):
        return config.seed
    return zlib.crc32(f"{config.seed}:{socket.gethostname()}:{os.getpid()}".encode())


# Random proposals before TPE models the results. Optuna's default (10) spends a quarter to two thirds of the 15-40
# trials a study runs on random draws; vLLM's defaults (trial 0) are one more observation from the start.
N_STARTUP_TRIALS = 5


def sampler(seed: int) -> optuna.samplers.BaseSampler:
    """Multivariate TPE over groups: the space is conditional (without chunked prefill there is no token budget or
    long-prefill threshold), and plain multivariate TPE samples every parameter that is not in all trials
    independently, which loses the joint model exactly on the token budget. `group=True` models each set of
    parameters that occur together jointly. Chosen on benchmarks/sample_efficiency.py (docs/sample-efficiency.md)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=N_STARTUP_TRIALS)


def open_study(config: StudyConfig, storage: optuna.storages.BaseStorage, joined: bool = False) -> optuna.Study:
    """Create the study (with its baseline queued first) or load it to resume. `joined`: a process that runs trials
    for a run that opened the study already (a slot, a cluster task) leaves the recovery of earlier runs to it: a
    trial whose process died here may be one its run is retrying elsewhere."""
    try:
        study = optuna.load_study(study_name=config.study_name, storage=storage, sampler=sampler(worker_seed(config)))
    except KeyError:
        try:
            study = optuna.create_study(study_name=config.study_name, storage=storage, directions=DIRECTIONS,
                                        sampler=sampler(worker_seed(config)))
        except optuna.exceptions.DuplicatedStudyError:  # another worker created it a moment ago
            return open_study(config, storage)
        with warnings.catch_warnings():  # stable in practice; Optuna only marks it experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(METRIC_NAMES)
        STUDY_CONFIG.set(study, _stored_form(config))
        study.enqueue_trial({}, user_attrs=BASELINE.item(True), skip_if_exists=False)  # only the creator queues it
        return study
    else:
        runs = confirmation_study(study)
        for s in (study, *([runs] if runs is not None else [])):  # a confirmation run may be the one still running
            check_schema(s)
            refuse_parallel_sqlite(s, config.storage_url)
        STUDY_CONFIG.set(study, _stored_form(config))  # a larger budget is the only change allowed
        if joined:
            return study
        if runs is not None:
            requeued, ended = recover(runs)
            if requeued or ended:
                names = ", ".join(f"c{n}" for n in requeued) or "none"
                warnings.warn(f"recovered from an earlier run: confirmation runs {names} queued again, leftover "
                              f"engine processes {ended} ended", stacklevel=1)
    requeued, ended = recover(study)
    if requeued or ended:
        warnings.warn(f"recovered from an earlier run: trials {requeued} queued again, "
                      f"leftover engine processes {ended} ended", stacklevel=1)
    ensure_baseline(study)
    return study


def _stored_form(config: StudyConfig) -> str:
    """The config as stored with the study: never with the database password."""
    return config.model_copy(update={"storage_url": redact(config.storage_url)}).model_dump_json()


def refuse_parallel_sqlite(study: optuna.Study, url: str) -> None:
    """SQLite is not for parallel workers of separate runs (Optuna's own advice): refuse a second live run on one
    file. The slot processes of one run (--gpus, which share its RUN_ENV) take turns on it."""
    if not url.startswith("sqlite"):
        return
    run = os.environ.get(RUN_ENV)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        w = WORKER.of(t)
        if w and run and w.get("run") == run:
            continue
        if w and w.get("pid") != os.getpid() and not _dead_or_elsewhere(w):
            raise UsageError(
                f"another optimize process (pid {w['pid']}) is running study {study.study_name!r} on this SQLite "
                f"file; SQLite is not for parallel workers. Wait for it, or put the study in PostgreSQL "
                f"(--storage postgresql://user:pass@host/db) to run several workers."
            )


def _dead_or_elsewhere(worker: dict[str, Any]) -> bool:
    from optimizer.core.processes import ProcessRef

    if worker.get("host") != socket.gethostname():
        return True
    return ProcessRef(int(worker["pid"]), float(worker["create_time"])).alive() is None


def is_baseline(trial: FrozenTrial) -> bool:
    """vLLM's defaults, measured or pruned for their config; not a start the machine broke
    (optimizer/search/breaker.py), which measured nothing: the baseline is queued again after it."""
    return bool(BASELINE.of(trial)) and not is_environment_failure(trial)


def ensure_baseline(study: optuna.Study) -> None:
    """On resume, queue vLLM's defaults again if every baseline attempt failed (none is finished, queued or running).

    A study with no baseline trial at all is one whose creator is queueing it right now (another worker): the
    creator alone queues the first baseline, so that two workers starting together never run it twice.
    """
    trials = study.get_trials(deepcopy=False)
    baselines = [t for t in trials if is_baseline(t)]
    if any(t.state in (*FINISHED, TrialState.WAITING, TrialState.RUNNING) for t in baselines):
        return
    if baselines or any(t.state in FINISHED for t in trials):
        study.enqueue_trial({}, user_attrs=BASELINE.item(True), skip_if_exists=False)


def is_confirmation(trial: FrozenTrial | optuna.Trial) -> bool:
    """A confirmation run (optimizer/search/confirm.py), stored in the confirmation study: a config measured again
    after the search, not a trial of it."""
    return CONFIRM.of(trial) is not None


def confirmation_study_name(study_name: str) -> str:
    """The name of the study that holds the confirmation runs of study `study_name`, in the same storage."""
    return study_name + CONFIRMATION_SUFFIX


def confirmation_study(study: optuna.Study, create: bool = False) -> optuna.Study | None:
    """The study beside `study` that holds its confirmation runs (NAME.confirmation), so that Optuna's own tools
    (`best_trials`, optuna-dashboard) see in NAME only the trials the search proposed. None where it does not exist
    yet; `create` makes it, with `study`'s directions and metric names (workers racing to do so share one)."""
    storage = study._storage
    name = confirmation_study_name(study.study_name)
    sampler = optuna.samplers.RandomSampler()  # its runs are queued with their parameters: nothing is sampled
    try:
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    except KeyError:
        if not create:
            return None
    try:
        runs = optuna.create_study(study_name=name, storage=storage, directions=study.directions, sampler=sampler)
    except optuna.exceptions.DuplicatedStudyError:  # another worker made it a moment ago
        return confirmation_study(study)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if study.metric_names:
            runs.set_metric_names(study.metric_names)
    STUDY_CONFIRMS.set(runs, study.study_name)
    return runs


def confirmation_runs(study: optuna.Study, states: tuple[TrialState, ...] = FINISHED) -> list[FrozenTrial]:
    """The confirmation runs of `study` in `states`: those of its confirmation study. Every reader of the runs gets
    them here."""
    runs = confirmation_study(study)
    return [] if runs is None else runs.get_trials(deepcopy=False, states=states)


def run_name(trial: FrozenTrial) -> str:
    """A confirmation run's name: c3 for run 3 of the confirmation study."""
    return f"c{trial.number}"


def search_trials(study: optuna.Study, states: tuple[TrialState, ...] = FINISHED) -> list[FrozenTrial]:
    """The study's own trials in `states`: what the search proposed and measured (its confirmation runs are in its
    confirmation study)."""
    return study.get_trials(deepcopy=False, states=states)


def finished_count(study: optuna.Study) -> int:
    """Finished search trials (confirmation runs are not trials of the search)."""
    return len(search_trials(study))
