"""`--ray ADDRESS`: a study's search trials as tasks on an existing Ray cluster, each on one node with as many GPUs
as its layout needs, the study in its one database.

- **This process samples, the cluster runs.** The run asks the study for each trial and draws its config here (TPE
  with constant liar, search/study.py: knowing the configs in flight), then submits it as a Ray task that asks for
  its layout's GPUs (tensor x pipeline x data parallel) and a core per GPU. Ray starts it on a node with that many
  free and shows it exactly them; the task joins the study, runs the trial on those GPUs (its pool, so the guard
  against other programs holds: hardware/gpu_pool.py) and stores the result. A trial is drawn only while the ones in
  flight ask for fewer GPUs than the cluster has; a layout larger than every node is pruned with its reason.
- **One budget.** Only this process creates trials, and only while the study's finished and running trials are
  under the budget and the next would end before the deadline.
- **A node lost mid-trial.** Ray runs the task again on another node, up to RETRIES times: the same trial, so nothing
  is counted twice. The nodes a trial's task started on are stored with it (NODES). Past RETRIES, the trial ends
  FAIL and its config is queued again.
- **Ctrl-C or SIGTERM** cancels every task: each shuts its engine down and ends its trial to be queued again, as a
  trial interrupted on one host does; a resumed study runs them first, on whichever nodes are free.
- **The confirmation** runs as one task, on one node with as many GPUs as the largest layout it compares: its runs
  take them one at a time, so a round's pairs are measured on the same GPUs, and each run records them.
- **Every node reaches the study**: PostgreSQL, or SQLite on a filesystem every node shares.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.core import failures
from optimizer.core.errors import OptimizerError, UsageError
from optimizer.core.signals import install_stop_handlers
from optimizer.params.parallel import gpus_needed
from optimizer.search.attrs import ENGINE_PARAMS, NODES
from optimizer.search.budget import BudgetStop, claimed_count, time_left_for
from optimizer.search.recovery import end_interrupted, requeue_interrupted
from optimizer.search.study import confirmation_study

if TYPE_CHECKING:
    from optimizer.hardware.gpu_pool import GpuPool
    from optimizer.search.runner import Prepared

RETRIES = 3  # runs of a trial's task on other nodes after the node it ran on was lost
POLL_S = 1.0
STOP_WAIT_S = 120.0  # how long cancelled tasks get to shut their engines down
CONNECT_TIMEOUT_S = 10.0


def connect(address: str, env: dict[str, str]) -> Any:
    """Join the Ray cluster at `address` ('auto': the one this host belongs to); its tasks get `env`. A UsageError
    naming the fix where Ray is not installed or no cluster answers."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray on this host and on every node of the cluster: pip install "
                         "'optimizer[ray]'") from None
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in address:  # Ray would retry an address nobody answers at for minutes
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise UsageError(f"--ray {address}: nothing answers there ({exc.strerror or exc}): give the address of the "
                             f"cluster's head (its GCS port, 6379 unless set), or --ray auto on one of its "
                             f"nodes") from None
    try:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"--ray {address}: no Ray cluster answers there ({first}): start one (ray start --head) or "
                         f"give the address of its head, e.g. --ray 10.0.0.1:6379") from None
    install_stop_handlers()  # Ray's own handler would end this process on SIGTERM with a stack dump, tasks running
    return ray


def node_gpus(ray: Any) -> list[int]:
    """GPUs of each node the cluster has alive now (logical ones count: `ray start --num-gpus 8` on any host)."""
    return [gpus for gpus, _ in node_resources(ray)]


def node_resources(ray: Any) -> list[tuple[int, int]]:
    """(GPUs, CPUs) of each node the cluster has alive now."""
    return [(int(n["Resources"].get("GPU", 0)), int(n["Resources"].get("CPU", 0))) for n in ray.nodes()
            if n.get("Alive")]


def cpus_for(needed: int, nodes: list[tuple[int, int]]) -> int:
    """Pure: the cores a trial of `needed` GPUs asks for: one per GPU, fewer where no node that has the GPUs has as
    many cores (a task that asks for more than any node has would wait forever)."""
    return min(needed, max((cpus for gpus, cpus in nodes if gpus >= needed), default=0))


# --- in the task, on a node ------------------------------------------------------------------------------------------

_JOINED: dict[str, Prepared] = {}  # a worker process joins the study once: its tasks share it


def _joined(payload: dict[str, Any]) -> Prepared:
    from optimizer.config.settings import StudyConfig
    from optimizer.search.runner import prepare

    key = payload["config"]
    if key not in _JOINED:
        _JOINED.clear()
        config = StudyConfig.model_validate_json(key)
        _JOINED[key] = prepare(config, Path(payload["studies_dir"]), lambda *a: None, live=False, slot=True)
    return _JOINED[key]


def node_pool(ray: Any, logical: bool, logs_dir: Path) -> GpuPool:
    """The GPUs Ray gave this task, as its pool: logical ones (the simulated engine) by the numbers Ray gave, locked
    per node; else the ones NVML reads with Ray's CUDA_VISIBLE_DEVICES applied."""
    from optimizer.hardware.gpu_pool import GpuPool, logical_topology, pool_for

    host = socket.gethostname()
    if logical:
        ids = sorted(int(i) for i in ray.get_gpu_ids())
        node = ray.get_runtime_context().get_node_id()
        return GpuPool(logical_topology(max(ids) + 1).subset(ids), logs_dir / "logical-gpus" / node, host=host)
    pool = pool_for("all", False, logs_dir)
    pool.host = host
    return pool


def run_trial(payload: dict[str, Any], trial_id: int) -> None:
    """A Ray task: trial `trial_id` of the study (created and sampled by the run) on the GPUs Ray gave it, its
    result stored; an error of the run's (not of the config) goes up to the run."""
    import ray

    prepared = _joined(payload)
    study, objective = prepared.study, prepared.objective
    stored = study._storage.get_trial(trial_id)
    if stored.state != TrialState.RUNNING:  # a retry after the heartbeat's grace: its config was queued again
        return
    objective.gpu_pool = node_pool(ray, payload["logical"], objective.logs_dir)
    trial = optuna.Trial(study, trial_id)
    here = {"host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id()}
    NODES.set(trial, [*NODES.of(stored), here])
    with beating(study._storage, trial_id):
        try:
            values = objective(trial)
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
            return
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
    study.tell(trial, values)


@contextlib.contextmanager
def beating(storage: Any, trial_id: int) -> Iterator[None]:
    """The trial's heartbeat, as `study.optimize` keeps one (the storage's interval): should the run and its tasks
    die, the trial goes stale and the next run queues its config again (search/study.py)."""
    interval_s = storage.get_heartbeat_interval() if hasattr(storage, "get_heartbeat_interval") else None
    if not interval_s:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            storage.record_heartbeat(trial_id)
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_confirmation(payload: dict[str, Any], rounds: int, options: dict[str, Any]) -> tuple[list[str], str]:
    """A Ray task: the confirmation's rounds (search/confirm.py) on the GPUs Ray gave it; the lines it said, and its
    closing line."""
    import ray

    from optimizer.search import confirm

    prepared = _joined(payload)
    prepared.objective.gpu_pool = node_pool(ray, payload["logical"], prepared.objective.logs_dir)
    said: list[str] = []
    line = confirm.run(prepared.study, prepared.objective, rounds, prepared.config.engine_args,
                       lambda *a: said.append(" ".join(str(x) for x in a)), **options)
    return said, line


# --- in the run ------------------------------------------------------------------------------------------------------

@dataclass
class RayCluster:
    """The run's side: trials submitted as tasks (`search`), the confirmation as one (`confirm`)."""

    ray: Any
    prepared: Prepared
    studies_dir: Path
    poll_s: float = POLL_S
    in_flight: dict[Any, optuna.Trial] = field(default_factory=dict)  # by task
    needs: dict[Any, int] = field(default_factory=dict)  # the GPUs each task in flight asked for

    @functools.cached_property
    def payload(self) -> dict[str, Any]:
        """What every task is given: the run's config and where its studies are."""
        config = self.prepared.config
        return {"config": config.model_dump_json(), "studies_dir": str(self.studies_dir),
                "logical": config.engine == "sim"}

    @property
    def gpus(self) -> int:
        """The GPUs of the cluster's nodes alive now."""
        return sum(node_gpus(self.ray))

    def describe(self) -> str:
        gpus = node_gpus(self.ray)
        return f"{len(gpus)} node{'s' * (len(gpus) != 1)} with {sum(gpus)} GPUs ({'+'.join(map(str, gpus))})"

    def search(self, on_trial: Callable[[optuna.Study, FrozenTrial], None], budget: int | None,
               deadline_unix_s: float | None, trial_estimate_s: Callable[[], float | None],
               reserve_s: Callable[[], float], now_unix_s: Callable[[], float] = time.time) -> BudgetStop:
        """Submit trials while the budget and deadline allow and the cluster has GPUs for them; say each as it
        ends; stop every task on the first error of the run's, or on Ctrl-C or SIGTERM."""
        study, objective = self.prepared.study, self.prepared.objective
        task = self.ray.remote(run_trial)
        ran, reason = 0, ""
        try:
            while True:
                nodes = node_resources(self.ray)
                gpus = [g for g, _ in nodes]
                # GPUs asked for in flight under the cluster's: at most one trial waits for GPUs, drawn last
                while not reason and sum(self.needs.values()) < max(sum(gpus), 1):
                    if budget is not None and claimed_count(study) >= budget:
                        break
                    reason = time_left_for(deadline_unix_s, trial_estimate_s(), now_unix_s(), reserve_s())
                    if reason:
                        break
                    trial = study.ask()
                    try:
                        params = objective.trial_params(trial)  # drawn here, knowing the trials in flight
                        needed = gpus_needed({**self.prepared.config.engine_args, **params})
                        if needed > max(gpus, default=0):
                            self._too_large(trial, params, needed, gpus)
                            ran += 1
                            on_trial(study, study._storage.get_trial(trial._trial_id))
                            continue
                        ref = task.options(num_gpus=needed, num_cpus=cpus_for(needed, nodes), max_retries=RETRIES,
                                           retry_exceptions=False, name=f"trial-{trial.number}") \
                            .remote(self.payload, trial._trial_id)
                    except BaseException:  # stopped between its creation and its task: queued again, as interrupted
                        self._interrupt(trial, "Ctrl-C or SIGTERM")
                        raise
                    self.in_flight[ref], self.needs[ref] = trial, needed
                if not self.in_flight:
                    return BudgetStop(ran, reason)
                done, _ = self.ray.wait(list(self.in_flight), num_returns=1, timeout=self.poll_s)
                for ref in done:
                    trial = self.in_flight.pop(ref)
                    self.needs.pop(ref)
                    self._settle(ref, trial)
                    ran += 1
                    on_trial(study, study._storage.get_trial(trial._trial_id))
        except BaseException:
            self.stop()
            raise

    def _too_large(self, trial: optuna.Trial, params: dict[str, Any], needed: int, gpus: list[int]) -> None:
        ENGINE_PARAMS.set(trial, params)
        try:
            self.prepared.objective.prune(trial, failures.INVALID_CONFIG,
                                          f"its layout needs {needed} GPUs on one node; the cluster's nodes have "
                                          f"at most {max(gpus, default=0)}")
        except optuna.TrialPruned:
            self.prepared.study.tell(trial, state=TrialState.PRUNED)

    def _settle(self, ref: Any, trial: optuna.Trial) -> None:
        """A task that ended: its trial is stored; a task lost RETRIES + 1 times ends its trial FAIL, to be queued
        again; an error of the run's (the cause of a task that raised) stops the run."""
        from ray.exceptions import RayTaskError

        study = self.prepared.study
        try:
            self.ray.get(ref)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, OptimizerError):
                raise type(cause)(str(cause)) from None
            line = str(cause or exc).strip().splitlines()
            raise OptimizerError(f"trial {trial.number} failed on the cluster: {line[-1] if line else exc!r}") from None
        except self.ray.exceptions.RayError as exc:  # its worker or node lost, past the retries
            self._interrupt(trial, f"its task was lost {RETRIES + 1} times ({type(exc).__name__})")
            requeue_interrupted(study)

    def _interrupt(self, trial: optuna.Trial, why: str) -> None:
        """End `trial` FAIL as interrupted (queued again by requeue_interrupted), where its task did not."""
        end_interrupted(self.prepared.study._storage, trial._trial_id, why)

    def stop(self) -> None:
        """Cancel every task in flight (a running one shuts its engine down and ends its trial FAIL, interrupted),
        wait for them, and end as interrupted the trials of tasks that never started."""
        if not self.in_flight:
            return
        for ref in self.in_flight:
            self.ray.cancel(ref)
        _, left = self.ray.wait(list(self.in_flight), num_returns=len(self.in_flight), timeout=STOP_WAIT_S)
        for ref in left:
            self.ray.cancel(ref, force=True)
        for trial in self.in_flight.values():
            self._interrupt(trial, "Ctrl-C or SIGTERM")
        self.in_flight.clear()
        self.needs.clear()

    def confirm(self, study: optuna.Study, objective: Any, rounds: int, engine_args: dict[str, Any],
                say: Callable[..., None], on_run: Callable[[optuna.Study, FrozenTrial], None] | None = None,
                **options: Any) -> str:
        """search/confirm.py `run`, as one task on one node with the GPUs of the largest layout it compares; each
        run said as it ends."""
        from optimizer.search import confirm

        needed = max((gpus_needed({**engine_args, **ENGINE_PARAMS.of(t)}) for t in confirm.candidates(study)),
                     default=1)
        cpus = cpus_for(needed, node_resources(self.ray))
        ref = self.ray.remote(run_confirmation).options(num_gpus=needed, num_cpus=cpus, max_retries=RETRIES,
                                                        retry_exceptions=False, name="confirmation") \
            .remote(self.payload, rounds, options)
        before = confirmation_study(study)
        ended = (TrialState.COMPLETE, TrialState.PRUNED)
        seen = {t.number for t in before.get_trials(deepcopy=False, states=ended)} if before is not None else set()
        try:
            while True:
                done, _ = self.ray.wait([ref], timeout=self.poll_s)
                runs = confirmation_study(study)
                for t in runs.get_trials(deepcopy=False, states=ended) if runs is not None else []:
                    if t.number not in seen:
                        seen.add(t.number)
                        if on_run is not None:
                            on_run(runs, t)
                if done:
                    break
            said, line = self.ray.get(ref)
        except BaseException:
            self.ray.cancel(ref)
            raise
        for text in said:
            say(text)
        return line
