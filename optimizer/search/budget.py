"""A study's budget: how many trials it has given out (finished, and running now), why the next may not start (the
deadline), and the loop that runs trials until the budget holds them, alone or beside other workers."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.params.parallel import gpus_needed
from optimizer.search.attrs import ENGINE_PARAMS
from optimizer.search.study import FINISHED, finished_count, search_trials


def fail_stale(study: optuna.Study) -> None:
    """End as failed the running trials whose worker stopped beating (Optuna's heartbeat; its callback queues them
    again: search/study.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def claimed_count(study: optuna.Study) -> int:
    """Finished search trials plus those running now (stale ones failed first): what the budget has given out."""
    fail_stale(study)
    return len(search_trials(study, (*FINISHED, TrialState.RUNNING)))


def trials_at_once(study: optuna.Study, gpus: int, engine_args: Mapping[str, Any]) -> float:
    """How many search trials run at once on `gpus` GPUs (--gpus, --ray): their number over the mean GPUs of the
    study's trials so far (each layout's, over `engine_args`), 1 GPU each before any; at least 1."""
    if gpus <= 1:
        return 1.0
    needs = [gpus_needed({**engine_args, **ENGINE_PARAMS.of(t)}) for t in search_trials(study)]
    return max(gpus / (sum(needs) / len(needs) if needs else 1.0), 1.0)


def _still_running(study: optuna.Study) -> bool:
    """A trial of `study` runs (one whose worker died failed first: Optuna's heartbeat)."""
    fail_stale(study)
    return any(t.state == TrialState.RUNNING for t in study.get_trials(deepcopy=False))


def wait_while_running(study: optuna.Study, timeout_s: float, poll_s: float = 1.0,
                       now: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                       on_wait: Callable[[], None] | None = None) -> None:
    """Until no trial of `study` runs (another worker's), at most `timeout_s`: a worker that died mid-trial is not
    waited for forever. `on_wait` is called once, before the first wait."""
    deadline = now() + timeout_s
    waited = False
    while now() < deadline and _still_running(study):
        if not waited and on_wait is not None:
            on_wait()
        waited = True
        sleep(poll_s)


@dataclass(frozen=True)
class BudgetStop:
    """How a run ended: `ran` trials here; `reason` says why it stopped before the trial budget (else empty)."""

    ran: int
    reason: str = ""


def time_left_for(deadline_unix_s: float | None, estimate_s: float | None, now_unix_s: float,
                  reserve_s: float = 0.0) -> str:
    """Pure: why the next trial may not start (it would end past the deadline, less `reserve_s` kept for the
    confirmation after the search), or '' when it may."""
    if deadline_unix_s is None:
        return ""
    left_s = deadline_unix_s - now_unix_s
    if left_s <= 0:
        return "time budget: the deadline has passed; give --budget DURATION (e.g. --budget 2h) to extend it"
    if estimate_s is not None and estimate_s + reserve_s > left_s:
        kept = f", ~{reserve_s:.0f} s of them kept for the confirmation" if reserve_s > 0 else ""
        return (f"time budget: the next trial takes ~{estimate_s:.0f} s and {left_s:.0f} s are left before the "
                f"deadline{kept}: stopping the search here; give --budget DURATION to extend it")
    return ""


class Cluster(Protocol):
    """Runs a run's search trials and its confirmation elsewhere (search/raycluster.py `RayCluster`)."""

    def search(self, on_trial: Callable[[optuna.Study, FrozenTrial], None], budget: int | None,
               deadline_unix_s: float | None, trial_estimate_s: Callable[[], float | None],
               reserve_s: Callable[[], float]) -> BudgetStop: ...

    def confirm(self, study: optuna.Study, objective: Any, rounds: int, engine_args: dict[str, Any],
                say: Callable[..., None], on_run: Callable[[optuna.Study, FrozenTrial], None] | None = None,
                **options: Any) -> str: ...


class Gate(Protocol):
    """A lock processes share (search/slots.py `BudgetGate`)."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


def run_to_budget(study: optuna.Study, objective: Callable[[optuna.Trial], Any], budget: int | None,
                  on_trial: Callable[[optuna.Study, FrozenTrial], None] | None = None,
                  gc_after_trial: bool = True, deadline_unix_s: float | None = None,
                  trial_estimate_s: Callable[[], float | None] = lambda: None,
                  now_unix_s: Callable[[], float] = time.time,
                  reserve_s: Callable[[], float] = lambda: 0.0, gate: Gate | None = None,
                  wait_running_s: float = 0.0, poll_s: float = 1.0,
                  sleep: Callable[[float], None] = time.sleep) -> BudgetStop:
    """Run trials one by one until the study holds `budget` finished trials, or until the next trial's estimated
    duration would push past `deadline_unix_s` (less `reserve_s()`, kept for the confirmation). `budget` None: the
    deadline alone decides.

    `gc_after_trial=False` is for simulated trials, where a full collection costs more than the trial itself.

    With several workers, a worker starts a trial only while finished + running trials are under the budget,
    so the workers together never run more than the budget; with a `gate` they share, exactly the budget (the check
    and the trial's creation are one step under its lock). Once the budget is given out, a worker waits up to
    `wait_running_s` for the others' trials: one whose worker died goes stale (Optuna's heartbeat), is queued again
    and run here, so that a lost worker's trial is not lost with it.
    """
    ran = 0
    waited_since: float | None = None
    callbacks = [lambda s, t: on_trial(s, t)] if on_trial else []
    while True:
        if gate is not None:
            gate.acquire()
        try:
            if budget is not None and claimed_count(study) >= budget:
                now_s = time.monotonic()
                waited_since = now_s if waited_since is None else waited_since
                if finished_count(study) >= budget or now_s - waited_since >= wait_running_s:
                    return BudgetStop(ran)
                if gate is not None:
                    gate.release()
                sleep(poll_s)
                continue
            waited_since = None
            reason = time_left_for(deadline_unix_s, trial_estimate_s(), now_unix_s(), reserve_s())
            if reason:
                return BudgetStop(ran, reason)

            def started(trial: optuna.Trial) -> Any:  # the trial exists: the next check counts it
                if gate is not None:
                    gate.release()
                return objective(trial)

            study.optimize(started, n_trials=1, callbacks=callbacks, catch=(), gc_after_trial=gc_after_trial)
        finally:
            if gate is not None:
                gate.release()
        ran += 1
