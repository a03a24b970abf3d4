"""Crash safety: which worker runs a trial, what it left behind, and what to run again.

Each trial records its worker (host, PID, start time) and its engine's processes as they appear. A later run on
the same host finds trials whose worker is dead: it ends their engine processes by PID (never by name), marks
them failed and queues their parameters again. Trials of workers on other hosts are left to Optuna's heartbeat.

An engine started outside a trial (the demo's probe, before its study exists) has no trial to hold its processes:
they go on record in a small JSON file beside the study's logs while it runs (`record_engine`), the file is removed
when it ends, and the next run ends what a killed run left there (`end_recorded`).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from optimizer.core.processes import ProcessRef, end_processes
from optimizer.measurement.engine import Engine
from optimizer.search.attrs import BASELINE, CONFIRM, ENGINE_PIDS, ENGINE_PROCESSES, INTERRUPTED, RETRY_OF, WORKER


RUN_ENV = "OPTIMIZER_RUN_ID"  # set by a run for the slot processes it starts (--gpus): they are one run's workers
SLOT_ENV = "OPTIMIZER_SLOT"  # a slot's number within its run


def worker_identity() -> dict[str, Any]:
    """Who runs a trial: the host, the process, and the run it belongs to (RUN_ENV; absent for a run of one
    process)."""
    me = psutil.Process()
    run = os.environ.get(RUN_ENV)
    return {"host": socket.gethostname(), "pid": os.getpid(), "create_time": me.create_time(),
            **({"run": run} if run else {})}


def _worker_dead_here(trial: FrozenTrial) -> bool:
    w = WORKER.of(trial)
    if not w or w.get("host") != socket.gethostname():
        return False
    return ProcessRef(int(w["pid"]), float(w["create_time"])).alive() is None


def engine_processes(trial: FrozenTrial) -> list[ProcessRef]:
    return [ProcessRef(int(pid), float(ct)) for pid, ct in ENGINE_PROCESSES.of(trial)]


def recover(study: optuna.Study) -> tuple[list[int], list[int]]:
    """End orphaned engines of dead local workers and queue their trials again.

    Returns (trial numbers queued again, engine PIDs that had to be ended).
    """
    ended: list[int] = []
    storage = study._storage
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _worker_dead_here(trial):
            ended += end_processes(engine_processes(trial))
            end_interrupted(storage, trial._trial_id, "its optimize process died")
    for trial in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        if _worker_dead_here(trial):
            ended += end_processes(engine_processes(trial))
    return requeue_interrupted(study), ended


def end_interrupted(storage: optuna.storages.BaseStorage, trial_id: int, why: str) -> None:
    """End a running trial FAIL as interrupted (`why`), to be queued again (`requeue_interrupted`); one that ended
    meanwhile is left as it is."""
    try:
        if storage.get_trial(trial_id).state == TrialState.RUNNING:
            storage.set_trial_user_attr(trial_id, INTERRUPTED.key, why)
            storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass


def requeue_interrupted(study: optuna.Study) -> list[int]:
    """Queue once more the parameters of every interrupted trial that has not been queued again yet (in a
    confirmation study, every interrupted run)."""
    trials = study.get_trials(deepcopy=False)
    retried = {RETRY_OF.of(t) for t in trials} | {t.system_attrs.get("failed_trial") for t in trials}
    queued = []
    for t in trials:
        if t.state == TrialState.FAIL and INTERRUPTED.of(t) and t.number not in retried:
            attrs: dict[str, Any] = RETRY_OF.item(t.number)
            if BASELINE.of(t):
                attrs.update(BASELINE.item(True))
            confirm = CONFIRM.of(t)
            if confirm is not None:  # a confirmation run is run again as one, in the confirmation study
                attrs.update(CONFIRM.item(confirm))
            study.enqueue_trial(t.params, user_attrs=attrs, skip_if_exists=False)
            queued.append(t.number)
    return queued


def record_engine(path: Path, refs: list[ProcessRef]) -> None:
    """Keep `refs` (an engine's processes) on record in `path`, with this worker, replacing the file atomically."""
    data = {"worker": worker_identity(), "processes": [[r.pid, r.create_time] for r in refs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def end_recorded(path: Path) -> list[int]:
    """End the processes on record in `path` when the worker that recorded them is dead on this host, then remove
    the file; a live worker's record is left alone. Returns the PIDs that had to be ended."""
    try:
        data = json.loads(path.read_text())
        w = data["worker"]
        refs = [ProcessRef(int(pid), float(ct)) for pid, ct in data["processes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if w.get("host") != socket.gethostname():
        return []
    if ProcessRef(int(w["pid"]), float(w["create_time"])).alive() is not None:
        return []
    ended = end_processes(refs)
    path.unlink(missing_ok=True)
    return ended


def save_processes(trial: optuna.Trial, engine: Engine) -> list[list[float]]:
    """The engine's processes on the trial's record (PID and start time), where they changed."""
    refs = [[r.pid, r.create_time] for r in engine.process_refs]
    if refs != ENGINE_PROCESSES.of(trial):
        ENGINE_PROCESSES.set(trial, refs)
        ENGINE_PIDS.set(trial, [int(pid) for pid, _ in refs])
    return refs


async def record_processes(trial: optuna.Trial, engine: Engine) -> None:
    """While the engine starts, keep its processes on record: a run killed mid-start leaves them findable."""
    while True:
        await asyncio.sleep(1.0)
        save_processes(trial, engine)
