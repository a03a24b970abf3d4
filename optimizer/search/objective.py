"""One trial: params -> engine -> warm-up -> rate search (cold replays) -> values, constraint, stored curve.

A configuration that cannot run (vLLM rejects it, it runs out of memory, the engine dies, it hangs) ends as a
PRUNED trial with a violated constraint and its reason in user attributes: the sampler learns from it.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna

from optimizer.config.model import ModelInfo
from optimizer.config.settings import StudyConfig
from optimizer.core import failures
from optimizer.core.clock import Clock, MonotonicClock
from optimizer.core.errors import EngineDiedError, EngineStartError
from optimizer.core.processes import log_tail, output_to
from optimizer.engines.compile_cache import cache_env, start_phases
from optimizer.hardware.device import visible_gpus
from optimizer.hardware.gpu_pool import GpuPool, PoolTooSmallError, Reservation
from optimizer.measurement.engine import Engine, EngineFactory, ServesInVirtualTime
from optimizer.measurement.engine_watch import CallBounds, WatchedEngine, pause_from_env
from optimizer.measurement.limits import diagnose
from optimizer.measurement.disturbance import MachineLoad
from optimizer.measurement.telemetry import for_device
from optimizer.measurement.workload import Workload, build_workload, fixed_load_rate
from optimizer.params.parallel import LAYOUT_ARGS, gpus_needed, layout_problems
from optimizer.params.preflight import (
    VLLM_DEFAULT_MEMORY_FRACTION, DeviceMemory, MemoryEstimate, as_resolved, estimate, held_elsewhere, layout_probe,
    memory_problems, most_free_for, wait_for_memory,
)
from optimizer.params.space import Space
from optimizer.search.attrs import (
    BASELINE, BASELINE_NOTE, CONFIRM, ENGINE_CONFIG, ENGINE_PARAMS, GPUS,
    ENGINE_START_PHASES, ENVIRONMENT_CAUSE, INTERRUPTED, LIMITED_BY, LOG_EXCERPT, LOG_FILE, MEMORY_ESTIMATE_GIB,
    MACHINE_LOAD, MEMORY_WAITED_FOR, PRUNED_DETAIL, PRUNED_REASON, TELEMETRY, TIMINGS, WORKER,
)
from optimizer.search.breaker import StartFailureBreaker, environment_cause
from optimizer.search.dashboard import constraint_key, set_constraints
from optimizer.search.incumbent import fair_incumbent_rate
from optimizer.search.measured import (Bound, TrialMeasurement, bound_by, closest_point, values_at,
                                       write_measurement)
from optimizer.search.records import RecordStore
from optimizer.search.recovery import record_processes, save_processes, worker_identity
from optimizer.search.placement import on_gpus, reserve
from optimizer.search.probes import TrialReplays
from optimizer.search.repeats import with_repeats
from optimizer.search.study import is_confirmation

CONSTRAINT = "ttft_p99_over_limit"  # a TTFT P99 limit's constraint (dashboard.constraint_key): measured / limit - 1
# Each limit's constraint value for a config that cannot run at all: worse than any measured miss.
CANNOT_RUN = 1e4
# On the CPU build, where vLLM's default memory fraction (0.92) does not fit beside other processes: the middle of
# the CPU space's range (params/space.py), so that the probe's engine start, made with it, predicts a trial's.
CPU_BASELINE_MEMORY_FALLBACK = 0.2
# The baseline's replays at a load the workload fixes (closed-loop clients, a trace at its own timestamps): their
# spread is the study's noise level there. A rate search needs none: its probes' pooled fit gives its interval.
BASELINE_REPEATS = 3


@dataclass
class TrialTimings:
    start_s: float = 0.0
    replay_s: float = 0.0
    shutdown_s: float = 0.0
    total_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return max(self.total_s - self.start_s - self.replay_s - self.shutdown_s, 0.0)

    def to_dict(self) -> dict[str, float]:
        return {"engine_start_s": round(self.start_s, 3), "replay_s": round(self.replay_s, 3),
                "engine_shutdown_s": round(self.shutdown_s, 3), "overhead_s": round(self.overhead_s, 3),
                "total_s": round(self.total_s, 3)}


@dataclass
class Objective:
    """Callable for `study.optimize`: measures one trial on a fresh engine."""

    config: StudyConfig
    space: Space
    workload: Workload
    engine_factory: EngineFactory
    logs_dir: Path
    clock: Clock = field(default_factory=MonotonicClock)
    model: ModelInfo | None = None
    memory_probe: Callable[[], DeviceMemory | None] = lambda: None
    records: RecordStore | None = None  # where every replay's per-request records go
    early_stop: bool = True  # stop a trial's rate search where it cannot beat the incumbent
    nvml: Any = None  # the NVML module for GPU telemetry (None: pynvml); tests pass a fake
    memory_wait_s: float = 60.0  # how long a trial waits for memory another process holds before the run stops
    memory_poll_s: float = 2.0
    most_free_bytes: dict[int, int] = field(default_factory=dict)  # by visible GPU: the most seen free in this run
    breaker: StartFailureBreaker = field(default_factory=StartFailureBreaker)  # stops a run the machine breaks
    gpu_count: int | None = None  # GPUs visible to this process (found on the first trial on cuda)
    served_factory: EngineFactory | None = None  # `vllm serve` for the confirmation's runs as served (None: none)
    gpu_pool: GpuPool | None = None  # --gpus: the GPUs each trial reserves its layout's from (None: the visible ones)
    gpu_name: str = ""  # the first GPU's name ("" on CPU): vLLM's batch defaults depend on it (params/deploy.py)
    # the confirmation's draws, by seed; not an init field, so a copy (dataclasses.replace) starts its own
    round_workloads: dict[int, Workload] = field(default_factory=dict, init=False, repr=False)

    def __call__(self, trial: optuna.Trial) -> tuple[float, float]:
        WORKER.set(trial, worker_identity())
        try:
            return asyncio.run(self.run(trial))
        except KeyboardInterrupt:
            # The engine was shut down on the way out; the trial ends FAIL (not counted) and is queued again.
            INTERRUPTED.set(trial, "Ctrl-C or SIGTERM")
            raise

    def trial_params(self, trial: optuna.Trial) -> dict[str, Any]:
        confirm = CONFIRM.of(trial)
        if confirm is not None:  # a confirmation run: the candidate's engine arguments, as its search trial ran them
            return dict(confirm["params"])
        if BASELINE.of(trial):
            # vLLM's own defaults for every searched knob; only the user's fixed values apply.
            return {k: v for k, v in self.space.fixed.items() if k != "max_model_len"}
        return self.space.suggest(trial)

    async def run(self, trial: optuna.Trial) -> tuple[float, float]:
        timings = TrialTimings()
        t0 = time.perf_counter()
        params = self.trial_params(trial)
        ENGINE_PARAMS.set(trial, params)
        problems = self.space.violations(params)
        if problems:
            self.prune(trial, failures.INVALID_CONFIG, "; ".join(problems))
        held = await self._reserve_gpus(trial, params)
        with on_gpus(held, self.gpu_pool is not None and self.gpu_pool.topology.logical, lambda r: GPUS.set(trial, r)):
            return await self._run(trial, params, timings, t0)

    async def _reserve_gpus(self, trial: optuna.Trial, params: dict[str, Any]) -> Reservation | None:
        """The GPUs of the trial's layout from the study's pool (--gpus: search/placement.py); None without one."""
        if self.gpu_pool is None:
            return None
        try:
            return await reserve(self.gpu_pool, gpus_needed({**self.config.engine_args, **params}), self.nvml,
                                 self.memory_wait_s, self.memory_poll_s, self.clock.now)
        except PoolTooSmallError as exc:
            self.prune(trial, failures.INVALID_CONFIG, str(exc))
            raise

    async def _run(self, trial: optuna.Trial, params: dict[str, Any], timings: TrialTimings,
                   t0: float) -> tuple[float, float]:
        engine = self.engine_for(trial)
        log_path = self.logs_dir / log_name(trial)
        LOG_FILE.set(trial, str(log_path))
        params = await self._preflight(trial, engine, params, log_path)
        try:
            resolved = await self._start(trial, engine, params, log_path, timings)
            ENGINE_CONFIG.set(trial, resolved)
            t_replay = time.perf_counter()
            engine_points: list[dict[str, Any] | None] = []  # per replay, in curve order
            telemetry = for_device(self.config.device, self.nvml)
            # what else ran on its CPUs meanwhile: a disturbed run is run again (a simulated one cannot be)
            load = MachineLoad(virtual_time=isinstance(engine, ServesInVirtualTime))
            try:
                confirm = CONFIRM.of(trial)
                incumbent = None if not self.early_stop or confirm is not None else fair_incumbent_rate(
                    trial.study, gpus_needed({**self.config.engine_args, **params}), self.config.engine_args)
                with telemetry, load:
                    # records by (study, number): a confirmation run's are its confirmation study's
                    search = await engine.guard(self._measure(engine, incumbent, trial.number, engine_points,
                                                              self._repeats(trial), confirm, trial.study.study_name),
                                                bound_s=self.config.trial_timeout_s)
            except asyncio.TimeoutError:
                self.prune(trial, failures.TIMEOUT, f"replays took longer than {self.config.trial_timeout_s:.0f} s")
            except EngineDiedError as exc:
                LOG_EXCERPT.set(trial, log_tail(log_path))  # what the engine said before it died
                self.prune(trial, failures.ENGINE_DIED, str(exc))
            finally:
                TELEMETRY.set(trial, telemetry.summary())
                MACHINE_LOAD.set(trial, load.summary())
            timings.replay_s = time.perf_counter() - t_replay
        finally:
            t_stop = time.perf_counter()
            await engine.shutdown()
            timings.shutdown_s = time.perf_counter() - t_stop
            timings.total_s = time.perf_counter() - t0
            TIMINGS.set(trial, timings.to_dict())
        limits = self.config.limits
        replays = search.points + search.repeats  # in the order they ran, as engine_points
        curve = [{**p.to_dict(), **({"engine": e} if e else {})}
                 for p, e in zip(replays, engine_points + [None] * len(replays))]
        if search.repeats:  # the trial's numbers at its best rate are the medians of its replays there
            search = with_repeats(search, limits)
        set_constraints(trial, {constraint_key(lim): v for lim, v in zip(limits, search.violations(limits).values())})
        point = search.best or closest_point(search.points, limits)
        first = values_at(point, limits)[limits.first.key]
        measured = TrialMeasurement.of_search(search, point, limits, curve)
        gpus = None
        if any(name in self.space.dists for name in LAYOUT_ARGS):  # layouts differ: the sampler compares per GPU
            gpus = gpus_needed({**self.config.engine_args, **params})
            measured = measured.with_gpus(gpus)
        write_measurement(trial, measured)
        found = _limited_by(replays, engine_points, point, bound_by(search, limits))
        if found:
            LIMITED_BY.set(trial, found)
        latency = first if math.isfinite(first) else CANNOT_RUN * limits.first.value_ms
        if gpus is not None:
            return point.output_throughput_tok_s / gpus, latency
        return point.output_throughput_tok_s, latency

    def engine_for(self, trial: optuna.Trial) -> WatchedEngine:
        """The trial's engine, watched (measurement/engine_watch.py; its start bounded as the trial): the study's,
        or for a confirmation run as served, `vllm serve` (`served_factory`)."""
        factory = self.engine_factory
        if (CONFIRM.of(trial) or {}).get("served"):
            if self.served_factory is None:
                self.prune(trial, failures.INVALID_CONFIG, "a run as served needs `vllm serve`, which this run "
                                                            "does not start (--no-served, or --backend http)")
            factory = self.served_factory
        return WatchedEngine(factory(), CallBounds(start_s=self.config.trial_timeout_s), pause_from_env())

    async def _preflight(self, trial: optuna.Trial, engine: Engine, params: dict[str, Any], log_path: Path) -> dict:
        """vLLM's config validation and the memory estimate: a config that cannot start costs no start."""
        sized = {**self.config.engine_args, **params}  # a layout fixed in the study's engine arguments counts too
        layout = layout_problems(sized, self._visible_gpus())
        if layout:
            self.prune(trial, failures.INVALID_CONFIG, "; ".join(layout))
        try:
            with output_to(log_path):
                resolved = engine.validate(params)  # what the installed vLLM resolves for it (None: no vLLM)
        except EngineStartError as exc:
            self.prune(trial, exc.reason, str(exc))
        gpus = gpus_needed(sized)  # its ranks' GPUs: another job on a GPU past them does not count against it
        probe = layout_probe(self.memory_probe, gpus, self.most_free_bytes)
        memory = probe() if self.model is not None else None
        if memory is None:
            return params
        if resolved is not None:  # the engine's own batch sizes and max_model_len for the trial
            sized = as_resolved(sized, resolved)

        def estimate_of(config: dict[str, Any]) -> MemoryEstimate:  # the engine starts in this process's environment
            return estimate(config, self.model, self.config.device, memory, self.config.workload.mean_total_len,
                            os.environ, resolved)

        est = estimate_of(sized)
        most_free = most_free_for(self.most_free_bytes, gpus)
        problems = memory_problems(est)
        if problems and held_elsewhere(est, most_free, memory.total_bytes):
            # Short only because another process (an earlier trial's engine, still exiting?) holds memory that
            # was free before: not the config's fault. Wait for it; DeviceMemoryHeldError ends the run.
            MEMORY_WAITED_FOR.set(trial, "memory held by another process")
            needed = est.requested_bytes + est.headroom_bytes
            memory = await wait_for_memory(
                probe, lambda m: not memory_problems(replace(est, available_bytes=m.available_bytes)),
                self.clock, self.memory_wait_s, self.memory_poll_s, needed, most_free) or memory
            est = replace(est, available_bytes=memory.available_bytes)  # the same device: only what is free moved
            problems = memory_problems(est)
        MEMORY_ESTIMATE_GIB.set(trial, est.to_dict())
        if problems and self._may_fall_back(trial, params):
            fallback = {**params, "gpu_memory_utilization": CPU_BASELINE_MEMORY_FALLBACK}
            # the defaults at the smaller fraction, checked as any config: a model that cannot fit either way costs
            # no start
            again = memory_problems(estimate_of({**sized, "gpu_memory_utilization": CPU_BASELINE_MEMORY_FALLBACK}))
            if not again:
                BASELINE_NOTE.set(trial, _fallback_note("; ".join(problems)))
                ENGINE_PARAMS.set(trial, fallback)
                return fallback
            problems = again
        if problems:
            self.prune(trial, failures.OUT_OF_MEMORY, "preflight: " + "; ".join(problems))
        return params

    def _may_fall_back(self, trial: optuna.Trial, params: dict[str, Any]) -> bool:
        return bool(BASELINE.of(trial)) and self.config.device == "cpu" \
            and "gpu_memory_utilization" not in params

    async def _start(self, trial: optuna.Trial, engine: Engine, params: dict[str, Any], log_path: Path,
                     timings: TrialTimings) -> dict[str, Any]:
        t = time.perf_counter()
        recorder = asyncio.create_task(record_processes(trial, engine))
        cache = cache_env(self.logs_dir, self.config.device)  # the study's compile cache (GPU trials)
        try:
            try:
                resolved = await asyncio.wait_for(engine.start({**params, **cache}, log_path),
                                                  timeout=self.config.trial_timeout_s)
            except EngineStartError as exc:
                if not (exc.reason == failures.OUT_OF_MEMORY and self._may_fall_back(trial, params)):
                    raise
                # vLLM's default memory fraction does not fit beside other processes on this CPU machine:
                # keep its scheduler defaults and reserve a fraction that fits.
                await engine.shutdown()
                BASELINE_NOTE.set(trial, _fallback_note(str(exc)))
                params = {**params, "gpu_memory_utilization": CPU_BASELINE_MEMORY_FALLBACK}
                ENGINE_PARAMS.set(trial, params)
                resolved = await asyncio.wait_for(engine.start({**params, **cache}, log_path),
                                                  timeout=self.config.trial_timeout_s)
            self.breaker.observe(None)
            return resolved
        except asyncio.TimeoutError:
            self.breaker.observe(None)
            self.prune(trial, failures.TIMEOUT, f"the engine did not start within {self.config.trial_timeout_s:.0f} s")
        except EngineDiedError as exc:  # a process of it gone mid-start, or the start hung past its bound
            self.breaker.observe(None)
            LOG_EXCERPT.set(trial, log_tail(log_path))
            self.prune(trial, failures.ENGINE_DIED, str(exc))
        except EngineStartError as exc:
            cause = self._environment_cause(trial, exc, log_path)  # raises when the breaker trips
            self.prune(trial, failures.START_FAILED if cause else exc.reason, str(exc))
        finally:
            timings.start_s = time.perf_counter() - t
            if log_path.exists():  # compile and CUDA-graph capture apart from the rest of the start
                ENGINE_START_PHASES.set(trial, start_phases(log_path.read_text(errors="replace")))
            recorder.cancel()
            save_processes(trial, engine)
        raise AssertionError("unreachable")

    def _visible_gpus(self) -> int | None:
        """GPUs this process may use (NVML, once per run); None where unknown (CPU build, no NVML): unchecked."""
        if self.gpu_pool is not None:
            return self.gpu_pool.size
        if self.config.device != "cuda":
            return None
        if self.gpu_count is None:
            self.gpu_count = len(visible_gpus(self.nvml))
        return self.gpu_count or None

    def _environment_cause(self, trial: optuna.Trial, exc: EngineStartError, log_path: Path) -> Any:
        """The machine's fault, not the config's? Counted by the breaker, which stops the run after a streak."""
        if exc.reason == failures.OUT_OF_MEMORY:
            self.breaker.observe(None)
            return None
        log_text = exc.log_excerpt or (log_path.read_text(errors="replace") if log_path.exists() else "")
        cause = environment_cause(f"{log_text}\n{exc}")
        if cause is not None:
            ENVIRONMENT_CAUSE.set(trial, cause.name)
        if self.breaker.observe(cause):
            INTERRUPTED.set(trial, f"stopped: {cause.what}")  # FAIL: queued again on resume
            raise self.breaker.error(trial.number, str(log_path), log_text)
        return cause

    def workload_of(self, confirm: dict[str, Any] | None) -> Workload:
        """The requests a trial replays: the study's, or for a confirmation run the draw of its round's seed (built
        once per seed; the warm-up is the study's either way)."""
        seed = None if confirm is None else confirm.get("workload_seed")
        if seed is None or seed == self.config.workload.seed or self.model is None:
            return self.workload
        if seed not in self.round_workloads:
            drawn = build_workload(self.config.workload.model_copy(update={"seed": int(seed)}), self.model.vocab_size)
            self.round_workloads[seed] = replace(drawn, warmup=self.workload.warmup)
        return self.round_workloads[seed]

    async def _measure(self, engine: Engine, incumbent_rate_rps: float | None, trial_number: int,
                       engine_points: list[dict[str, Any] | None], repeats: int = 1,
                       confirm: dict[str, Any] | None = None, study_name: str | None = None):
        measuring = TrialReplays(engine, self.workload_of(confirm), self.config, self.clock, self.records, trial_number,
                                 engine_points, study_name=study_name)
        return await measuring.measure(incumbent_rate_rps, repeats, confirm)

    def _repeats(self, trial: optuna.Trial) -> int:
        """Replays at the best rate: the study's `repeats`; at a fixed load at least BASELINE_REPEATS for the
        baseline, whose spread is the study's noise level there (optimizer/measurement/noise.py)."""
        if CONFIRM.of(trial) is not None:
            return 1
        if BASELINE.of(trial) and fixed_load_rate(self.config.workload, self.workload) is not None:
            return max(self.config.repeats, BASELINE_REPEATS)
        return self.config.repeats

    def prune(self, trial: optuna.Trial, reason: str, detail: str) -> None:
        """Store why `trial` cannot run (a core/failures.py class, and its message) and end it pruned."""
        PRUNED_REASON.set(trial, reason)
        PRUNED_DETAIL.set(trial, detail[:1000])
        set_constraints(trial, {constraint_key(lim): CANNOT_RUN for lim in self.config.limits})
        raise optuna.TrialPruned(f"{reason}: {detail}")


def log_name(trial: optuna.Trial | optuna.trial.FrozenTrial) -> str:
    """The file name of a trial's engine log in the study's logs folder: trial-00007.log; a confirmation run stored
    in the confirmation study, whose numbers start at 0 again, confirm-00003.log."""
    return f"{'confirm' if is_confirmation(trial) else 'trial'}-{trial.number:05d}.log"


def _limited_by(replays: list, engine_points: list[dict[str, Any] | None], point: Any, bound: Bound | None) -> str | None:
    """The one line that says what limited the trial at its chosen point: the limit that bound it, then the
    engine's stats of the first replay at that rate (`replays` in the order they ran, as `engine_points`)."""
    for p, e in zip(replays, engine_points):
        if p.offered_rate_rps == point.offered_rate_rps:
            found = diagnose(e, point.ttft_p99_ms, bound.text if bound else None,
                             bound.limit.metric if bound else None)
            return found.line if found else None
    return None


def _fallback_note(why: str) -> str:
    return (f"vLLM's default gpu_memory_utilization ({VLLM_DEFAULT_MEMORY_FRACTION}) does not fit on this CPU machine "
            f"({why}); the baseline keeps vLLM's scheduler defaults with gpu_memory_utilization="
            f"{CPU_BASELINE_MEMORY_FALLBACK}")
