"""The simulated engine: vLLM's continuous batching modelled step by step (optimizer/sim/), behind the Engine protocol.

Two ways to drive it:
- `generate` serves requests in real time (each step sleeps its modelled duration), like any engine: the contract
  tests run against it;
- `simulate_replay` serves a whole replay in virtual time (a ten-minute workload in well under a second):
  `optimizer.replay.replay` uses it when an engine has it, so studies, rate searches and benchmarks run on the
  simulator unchanged, only faster.

With a `NoiseSource` (optimizer/engines/sim/noise.py) its step times vary like a shared machine's: a factor per
engine start (also applied in real time), one per replay, and a slow drift over the source's virtual hours. Without
one it is deterministic.

Its memory model follows optimizer/params/preflight.py: `gpu_memory_utilization` x device memory, less weights and a
runtime reserve, is the KV cache; a config that asks for more than the device has fails to start as out of memory.

A tensor-parallel layout (`tensor_parallel_size`) runs on that many GPUs of this memory: each holds its share of the
weights and of the KV heads (params/parallel.py `per_gpu`), and a step splits its work over them and pays for their
all-reduces (sim/steptime.py `for_tensor_parallel`). Pipeline and data parallel layouts are not modelled: refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from optimizer.config.model import ModelInfo
from optimizer.config.resolved import Resolved
from optimizer.core import failures
from optimizer.core.errors import EngineStartError
from optimizer.core.processes import ProcessRef
from optimizer.engines.sim.noise import NoiseSource, scaled
from optimizer.engines.sim.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from optimizer.engines.sim.steptime import StepTimeModel, for_tensor_parallel
from optimizer.engines.sim.virtual import simulate
from optimizer.measurement.metrics import RequestRecord
from optimizer.measurement.workload import Request
from optimizer.params.deploy import batch_defaults
from optimizer.params.parallel import LAYOUT_ARGS, layout_sizes, per_gpu
from optimizer.params.preflight import CPU_RESERVE_BYTES, GIB, VLLM_DEFAULT_MEMORY_FRACTION, gpu_reserve_bytes
from optimizer.params.space import SEARCHABLE, check_constraints

# vLLM 0.32's defaults for what the simulator models (what the real engines resolved on each device).
VLLM_DEFAULTS = {
    "cpu": {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "block_size": 128, "enable_chunked_prefill": True,
            "enable_prefix_caching": True, "long_prefill_token_threshold": 0},
    "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size": 16, "enable_chunked_prefill": True,
             "enable_prefix_caching": True, "long_prefill_token_threshold": 0},
}
# Engine arguments that do not change what the simulator models: accepted, ignored.
_IGNORED = {"model", "enforce_eager", "dtype", "load_format", "seed", "skip_tokenizer_init", "disable_log_stats",
            "kv_cache_dtype", "async_scheduling", "max_cudagraph_capture_size"}  # the CUDA knobs: no step-time term


class SimulatedEngine:
    def __init__(self, model: ModelInfo, time_model: StepTimeModel | None = None, device: str = "cpu",
                 device_memory_bytes: int = 24 * GIB, max_memory_fraction: float = 0.9,
                 noise: NoiseSource | None = None, deploy_as: str = "serve", device_name: str = "") -> None:
        self.model, self.time_model, self.device = model, time_model or StepTimeModel(), device
        self.tensor_parallel_size = 1  # of the config it started with: its steps split over as many GPUs
        self.device_memory_bytes, self.max_memory_fraction = device_memory_bytes, max_memory_fraction
        self.deploy_as, self.device_name = deploy_as, device_name  # whose defaults: `vllm serve`'s or vllm.LLM's
        self.noise = noise
        self.engine_factor = 1.0  # this start's step-time factor (drawn from `noise` at start)
        self.virtual_s = 0.0  # modelled seconds this engine has cost: start, replays, shutdown
        self.last_stats: SchedulerStats | None = None
        self._config: SchedulerConfig | None = None
        self._sched: Scheduler | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._queues: dict[int, asyncio.Queue[int | None]] = {}

    measure_only = False

    @property
    def pids(self) -> list[int]:
        return []

    @property
    def process_refs(self) -> list[ProcessRef]:
        return []

    def settings(self, params: dict[str, Any]) -> dict[str, Any]:
        """Pure: the values the simulated engine runs `params` with, its defaults filled in."""
        given = {k: v for k, v in params.items() if k not in _IGNORED and k not in LAYOUT_ARGS
                 and not k.startswith("env:")}
        defaults = dict(VLLM_DEFAULTS.get(self.device, VLLM_DEFAULTS["cpu"]))
        # what the deployment gets on a device of this memory and name (optimizer/params/deploy.py: an A100's 80 GB
        # get 256 sequences from `vllm serve`, an H100's 1024)
        defaults["max_num_seqs"], defaults["max_num_batched_tokens"] = batch_defaults(
            self.deploy_as, self.device, self.device_memory_bytes, self.device_name)
        out = {**defaults, **given}
        out.setdefault("max_model_len", self.model.max_len)
        out.setdefault("gpu_memory_utilization", VLLM_DEFAULT_MEMORY_FRACTION)
        return out

    def resolve(self, params: dict[str, Any]) -> dict[str, Any]:
        """The values the simulated engine runs with, defaults filled in, and its KV cache size."""
        self.validate(params)
        out = self.settings(params)
        requested = out["gpu_memory_utilization"] * self.device_memory_bytes
        if out["gpu_memory_utilization"] > self.max_memory_fraction:
            raise EngineStartError(f"simulated: gpu_memory_utilization {out['gpu_memory_utilization']} asks for "
                                   f"more memory than the device has free", failures.OUT_OF_MEMORY)
        rank = per_gpu(self.model, {**out, **self.layout(params)})  # what one GPU of the layout holds
        reserve = CPU_RESERVE_BYTES if self.device == "cpu" else gpu_reserve_bytes(out, self.model, {})
        kv_bytes = requested - rank.weights_bytes - reserve
        per_block = max(rank.kv_bytes_per_token, 1) * out["block_size"]
        blocks = int(kv_bytes // per_block) if kv_bytes > 0 else 0
        if blocks * out["block_size"] < out["max_model_len"]:
            raise EngineStartError(f"simulated: the KV cache ({blocks} blocks) cannot hold one sequence of "
                                   f"max_model_len {out['max_model_len']}", failures.OUT_OF_MEMORY)
        out["num_kv_blocks"] = blocks
        if not out["enable_chunked_prefill"]:
            out["max_num_batched_tokens"] = max(out["max_num_batched_tokens"], out["max_model_len"])
        return out

    def validate(self, params: dict[str, Any]) -> Resolved:
        """The simulated engine's own checks, and what it resolves `params` to: its defaults, its model's cache and
        weights (the plain split of params/parallel.py)."""
        unknown = sorted(k for k in set(params) - set(SEARCHABLE) - _IGNORED - set(LAYOUT_ARGS)
                         if not k.startswith("env:"))
        if unknown:
            raise EngineStartError(f"simulated: unexpected keyword argument {unknown[0]!r}", failures.INVALID_CONFIG)
        _, pp, dp = layout_sizes(params)
        if pp > 1 or dp > 1:
            raise EngineStartError("simulated: the simulated engine models tensor-parallel layouts only: leave "
                                   "pipeline_parallel_size and data_parallel_size at 1", failures.INVALID_CONFIG)
        problems = check_constraints(params, 1)
        if problems:
            raise EngineStartError("simulated: " + "; ".join(problems), failures.INVALID_CONFIG)
        out = self.settings(params)
        # its weights as vLLM builds them, in 16 bits (the preflight counts what an online quantization keeps)
        rank = per_gpu(self.model.served_as(params.get("dtype")),
                       {**{k: v for k, v in out.items() if k != "quantization"}, **self.layout(params)})
        length, seqs, tokens = int(out["max_model_len"]), int(out["max_num_seqs"]), int(out["max_num_batched_tokens"])
        return Resolved(max_model_len=length, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                        max_in_flight_tokens=tokens, use_mla=False,
                        kv_cache_dtype=str(params.get("kv_cache_dtype") or "auto"),
                        kv_bytes_one_sequence=rank.kv_bytes_per_token * length,
                        kv_bytes_per_token=rank.kv_bytes_per_token, weights_bytes=rank.weights_bytes)

    @property
    def step_model(self) -> StepTimeModel:
        """The time of a step of the started config: its time model on its tensor-parallel GPUs."""
        return for_tensor_parallel(self.time_model, self.tensor_parallel_size)

    @staticmethod
    def layout(params: dict[str, Any]) -> dict[str, int]:
        """The layout `params` ask for (tensor parallel only: `validate` refuses the others)."""
        return {"tensor_parallel_size": layout_sizes(params)[0]}

    async def start(self, params: dict[str, Any], log_path: Path | None = None) -> dict[str, Any]:
        resolved = self.resolve(params)
        self.tensor_parallel_size = layout_sizes(params)[0]
        self._config = SchedulerConfig.of(resolved)
        self._sched = Scheduler(self._config)
        if self.noise is not None:
            self.engine_factor = self.noise.engine_factor()
        self._spend(self.time_model.engine_start_s)
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text(f"simulated engine: {resolved}\nstep time model: {self.time_model.to_dict()}\n")
        return resolved

    # -- virtual time ------------------------------------------------------------------------------------
    def simulate_replay(self, requests: list[Request] | tuple[Request, ...],
                        arrivals_s: list[float]) -> list[RequestRecord]:
        assert self._sched is not None and self._config is not None, "simulate_replay before start"
        model = self.step_model
        if self.noise is not None:
            factor = self.engine_factor * self.noise.replay_factor() * self.noise.drift_factor()
            model = scaled(model, factor)
        result = simulate(requests, arrivals_s, self._config, model, self._sched)
        self._spend(result.duration_s)
        self.last_stats = result.stats
        return result.records

    # -- real time ---------------------------------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[int]:
        assert self._sched is not None, "generate before start"
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.create_task(self._loop())
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._sched.add(request, key=queue)
        assert self._wake is not None
        self._wake.set()
        while (n := await queue.get()) is not None:
            yield n

    async def _loop(self) -> None:
        assert self._sched is not None and self._wake is not None
        model = scaled(self.step_model, self.engine_factor)  # real time: the engine's factor only
        while True:
            if self._sched.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = self._sched.plan()
            if not plan.scheduled:
                if not plan.preempted:
                    seq = self._sched.waiting.popleft()
                    seq.key.put_nowait(None)
                continue
            await asyncio.sleep(model.step_s(*plan.time_inputs))
            emitted, completed = self._sched.finish(plan)
            for seq in emitted:
                seq.key.put_nowait(1)
            for seq in completed:
                seq.key.put_nowait(None)

    async def reset_prefix_cache(self) -> None:
        if self._sched is not None:
            self._sched.reset_prefix_cache()

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self._sched is not None:
            self._spend(self.time_model.engine_shutdown_s)
        self._sched = None

    def _spend(self, seconds: float) -> None:
        """Count modelled engine time: this engine's cost, and the noise source's clock for the drift."""
        self.virtual_s += seconds
        if self.noise is not None:
            self.noise.advance(seconds)


LOGICAL_GPU_MEMORY_BYTES = 80 * GIB  # `--engine sim`'s logical GPUs: an H100's memory, as NVML reports it
LOGICAL_GPU_NAME = "NVIDIA H100 80GB HBM3"
LOGICAL_MEMORY_FRACTION = 0.95  # of a logical GPU, free to a trial: vLLM's default 0.92 fits, as on an idle GPU


def on_logical_gpu(model: ModelInfo, time_model: StepTimeModel, device: str, deploy_as: str) -> SimulatedEngine:
    """The simulated engine of `--engine sim`: each GPU of its layout an idle H100 (on `device` cuda)."""
    name = LOGICAL_GPU_NAME if device == "cuda" else ""
    return SimulatedEngine(model, time_model, device, LOGICAL_GPU_MEMORY_BYTES, LOGICAL_MEMORY_FRACTION,
                           deploy_as=deploy_as, device_name=name)
