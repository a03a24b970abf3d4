"""Reject, before any engine starts, configs whose memory cannot work (in seconds, without an engine start).

The estimate: the engine may take `gpu_memory_utilization` x device memory; weights and a runtime reserve come out
of that first, and the rest is KV cache, which must hold at least one sequence of `max_model_len` tokens (vLLM
refuses to start otherwise). On the CPU build the fraction is of the NUMA node's memory, and vLLM also refuses
when that much is not free right now. Only clear cases are rejected: the sampler learns the rest from real starts.

Free memory also drops for reasons that say nothing about the config: an earlier trial's engine still exiting
(GPU memory returns some seconds after its process ends), an orphan, another job. A config that would fit in the
most memory seen free in this run, but not in what is free now, is not infeasible: the trial waits and probes
again (`wait_for_memory`), and if the memory stays held, the run stops with `DeviceMemoryHeldError` instead of
teaching the sampler a false out-of-memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from optimizer.config.model import ModelInfo
from optimizer.config.resolved import Resolved
from optimizer.core.clock import Clock
from optimizer.core.errors import OptimizerError
from optimizer.params.open_space import split_env
from optimizer.params.parallel import layout_sizes, online_share, per_gpu, v2_model_runner

GIB = 1024**3
# Memory the engine needs besides weights and KV cache (runtime, activations, buffers) on the CPU build, measured
# here: 0.67-0.69 GiB for the 17M-parameter default model. On GPUs: `gpu_reserve_bytes`.
CPU_RESERVE_BYTES = int(0.6 * GIB)
# On the CPU build the KV cache is ordinary memory shared with everything else on the machine: a config that
# leaves less than this free (vLLM's default 0.92 of a 24 GiB machine did) thrashes, hangs and dies mid-replay.
CPU_HEADROOM_FRACTION, CPU_HEADROOM_MIN_BYTES = 0.1, 2 * GIB
VLLM_DEFAULT_MEMORY_FRACTION = 0.92


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int
    available_bytes: int
    per_gpu: tuple[tuple[int, int], ...] = ()  # each visible GPU's (total, free) bytes in CUDA's order; () on CPU

    def for_gpus(self, count: int) -> DeviceMemory:
        """Pure: the memory each rank of a layout over `count` GPUs has: the smallest total and free among the first
        `count` GPUs this process sees, the ones vLLM puts its ranks on (cuda:0 to cuda:count - 1, data-parallel
        replicas after each other), so that another job on a GPU past them is none of its business. The whole
        device on CPU, or where the GPUs were not read one by one."""
        if not self.per_gpu:
            return self
        used = self.per_gpu[:max(count, 1)]
        return DeviceMemory(min(t for t, _ in used), min(f for _, f in used), self.per_gpu)

    @classmethod
    def probe(cls, device: str, nvml: Any | None = None) -> DeviceMemory | None:
        """Memory of the device trials run on: the CPU's NUMA node 0 (as vLLM reads it; psutil without vLLM)
        or, on GPUs, each GPU's this process sees (NVML; `nvml` defaults to `pynvml`), with the smallest total and
        free among them: every rank of a tensor- or data-parallel layout must fit on its GPU (`for_gpus` keeps the
        GPUs a layout uses)."""
        try:
            if device == "cpu":
                try:
                    from vllm.utils.cpu_resource_utils import get_memory_node_info
                except ImportError:
                    import psutil

                    vm = psutil.virtual_memory()
                    return cls(int(vm.total), int(vm.available))
                info = get_memory_node_info(0)
                return cls(int(info.total_memory), int(info.available_memory))
            from optimizer.hardware.device import visible_gpus

            gpus = visible_gpus(nvml)  # every GPU this process may use: a layout over several must fit on each
            if not gpus:
                return None
            return cls(min(g.memory_total_bytes for g in gpus), min(g.memory_free_bytes for g in gpus),
                       tuple((g.memory_total_bytes, g.memory_free_bytes) for g in gpus))
        except Exception:  # no vLLM CPU utilities, no NVML: no estimate, the real start decides
            return None


@dataclass(frozen=True)
class MemoryEstimate:
    requested_bytes: int
    available_bytes: int
    weights_bytes: int
    reserve_bytes: int
    kv_budget_bytes: int
    kv_one_sequence_bytes: int
    sequences_that_fit: float
    headroom_bytes: int = 0  # what must stay free for the rest of the machine

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v / GIB, 3) if k.endswith("_bytes") else round(v, 1) for k, v in asdict(self).items()}


def gpu_reserve_bytes(params: dict[str, Any], model: ModelInfo, env: dict[str, str]) -> int:
    """Pure: at least what vLLM takes on each GPU besides weights and KV cache, as its start counts it
    (`Worker.determine_available_memory`: all allocated since a snapshot taken after CUDA's context and NCCL, plus
    `profile_run`'s peak; CUDA graphs come on top, measured, not counted here). A lower bound, from the tensors that
    provably coexist, for `model` as served (its dtype, before the KV cache's):

    - the sampler state of the V2 model runner, allocated whatever a request asks for: `output_bin_counts`
      (max_num_seqs x vocab int32: 1 GiB for a 262k-token vocabulary at 1024 sequences), `prompt_bin_mask` and the
      grammar bitmask (a bit per token each);
    - the profile run's peak over max_num_batched_tokens tokens (less a draft's queries, one row a sequence and
      speculative token, under speculative decoding): the residual and a dense MLP's output (intermediate_size, a
      tensor-parallel share: Molmo's gate and up together, a non-gated MLP's up projection; none for a mixture), or
      the logits of one row a sequence (min(max_num_seqs, tokens)) in the served dtype, with their float32 copy on
      the V1 runner.

    Where the V2 runner is not certain (VLLM_USE_V2_MODEL_RUNNER=0, speculative decoding, dual batch overlap) the
    smaller of the two runners' figures. The sampler and the logits are the last pipeline stage's, whose layers and
    weights may be fewer than the estimate's (the first stages take the odd layers): with pipeline parallelism, and
    for a pooling model (no sampler), the MLP's peak alone; with prefill context parallelism each rank's share of the
    tokens. Token budgets as vLLM resolves them (`as_resolved`) count; one left unknown counts none."""
    tp, pp, _ = layout_sizes(params)
    seqs, tokens = int(params.get("max_num_seqs") or 0), int(params.get("max_num_batched_tokens") or 0)
    spec = params.get("speculative_config")
    if spec:
        drafts = spec.get("num_speculative_tokens") if isinstance(spec, dict) else None
        tokens = max(tokens - seqs * (1 + (drafts if isinstance(drafts, int) and drafts > 0 else 1)), 0)
    tokens //= int(params.get("prefill_context_parallel_size") or 1)  # each rank's share of the batch's tokens
    dt = model.dtype_bytes or 2
    mlp = dt * tokens * (model.hidden_size + model.mlp_size) // tp
    if pp > 1 or params.get("runner") == "pooling" or params.get("convert") not in (None, "auto", "none"):
        return mlp
    rows, vocab = min(seqs, tokens), model.vocab_size
    logits = dt * (tokens + rows) * model.hidden_size // tp + dt * rows * vocab
    v2 = 4 * seqs * vocab + 2 * 4 * seqs * -(-vocab // 32) + max(mlp, logits)
    if v2_model_runner(env) and not spec and not params.get("enable_dbo") and int(params.get("ubatch_size") or 1) <= 1:
        return v2
    return min(v2, max(mlp, logits + 4 * rows * vocab))


def estimate(params: dict[str, Any], model: ModelInfo, device: str, memory: DeviceMemory,
             mean_request_tokens: float, process_env: Mapping[str, str] | None = None,
             resolved: Resolved | None = None) -> MemoryEstimate:
    """Pure: what the config asks for and what is left for the KV cache, per GPU of its layout.

    With `resolved` (a real engine: what the installed vLLM resolved for the trial, engines/vllm_config.py), the
    weights and the cache of one sequence are those of one rank of vLLM's own build of the model; where it could not
    build one, they count none (the lenient side: the engine's start decides). Without it (the simulated engine),
    the plain split of `model` (params/parallel.py). The runtime reserve is ours either way (`gpu_reserve_bytes`),
    under the environment the engine starts in: `process_env` and the trial's own `env:` parameters."""
    env = {**(process_env or {}), **split_env(params)[1]}
    served = model.served_as(params.get("dtype"))
    reserve = CPU_RESERVE_BYTES if device == "cpu" else gpu_reserve_bytes(params, served, env)
    fraction = float(params.get("gpu_memory_utilization", VLLM_DEFAULT_MEMORY_FRACTION))
    requested = int(fraction * memory.total_bytes)
    if resolved is not None:
        weights = int(resolved.weights_bytes * online_share(params))
        per_token, one_seq = resolved.kv_bytes_per_token, resolved.kv_bytes_one_sequence
    else:
        rank = per_gpu(served, params)
        weights, per_token = rank.weights_bytes, rank.kv_bytes_per_token
        model_len = int(params.get("max_model_len") or rank.max_len)
        one_seq = -(-per_token * model_len // int(params.get("decode_context_parallel_size") or 1))
    kv_budget = requested - weights - reserve
    fixed_kv = params.get("kv_cache_memory_bytes")
    if isinstance(fixed_kv, (int, float)) and not isinstance(fixed_kv, bool) and fixed_kv > 0:
        kv_budget = int(fixed_kv)  # vLLM's KV cache then takes that, whatever the fraction says
    fit = kv_budget / (per_token * mean_request_tokens) if per_token and mean_request_tokens else float("inf")
    headroom = 0
    if device == "cpu":
        headroom = max(int(CPU_HEADROOM_FRACTION * memory.total_bytes), CPU_HEADROOM_MIN_BYTES)
    return MemoryEstimate(requested, memory.available_bytes, weights, reserve, kv_budget, one_seq, max(fit, 0.0),
                          headroom)


def as_resolved(params: dict[str, Any], resolved: Resolved) -> dict[str, Any]:
    """Pure: `params` with the batch sizes and max_model_len the installed vLLM resolved for them."""
    out = {**params, "max_num_seqs": resolved.max_num_seqs, "max_num_batched_tokens": resolved.max_num_batched_tokens}
    if resolved.max_model_len > 0:  # -1: vLLM fits it to the memory at start
        out["max_model_len"] = resolved.max_model_len
    return out


def memory_problems(est: MemoryEstimate) -> list[str]:
    """Why the config cannot start, each with the fix; empty when it may."""
    out = []
    if est.requested_bytes > est.available_bytes - est.headroom_bytes:
        keep = (f" (keeping {est.headroom_bytes / GIB:.2f} GiB for the rest of the machine)"
                if est.headroom_bytes else "")
        out.append(f"gpu_memory_utilization asks for {est.requested_bytes / GIB:.2f} GiB but only "
                   f"{est.available_bytes / GIB:.2f} GiB are free{keep}: lower it")
    if est.kv_budget_bytes <= 0:
        out.append(f"weights ({est.weights_bytes / GIB:.2f} GiB) and runtime ({est.reserve_bytes / GIB:.2f} GiB) leave "
                   f"no room for the KV cache in {est.requested_bytes / GIB:.2f} GiB: raise gpu_memory_utilization")
    elif est.kv_one_sequence_bytes and est.kv_budget_bytes < est.kv_one_sequence_bytes:
        out.append(f"one max_model_len sequence needs {est.kv_one_sequence_bytes / GIB:.2f} GiB of KV cache, "
                   f"{est.kv_budget_bytes / GIB:.2f} GiB are left: lower max_model_len or raise "
                   f"gpu_memory_utilization")
    return out


class DeviceMemoryHeldError(OptimizerError):
    """Memory that was free earlier in this run stays held by another process: the run stops, nothing is pruned."""


# Free memory drifts by itself (the front end's heap, caches): only a larger drop counts as held by another process.
HELD_MIN_BYTES, HELD_MIN_FRACTION = GIB, 0.02


def remember_free(seen: dict[int, int], memory: DeviceMemory) -> None:
    """Pure but for `seen`: the most memory seen free, by GPU (its place among the visible ones; 0 for the CPU's),
    raised to what `memory` reads now."""
    for i, (_, free) in enumerate(memory.per_gpu or ((memory.total_bytes, memory.available_bytes),)):
        seen[i] = max(seen.get(i, 0), free)


def layout_probe(probe: Callable[[], DeviceMemory | None], count: int,
                 seen: dict[int, int]) -> Callable[[], DeviceMemory | None]:
    """`probe` as a layout over `count` GPUs reads it: each reading remembered in `seen` (`remember_free`), then the
    memory of the GPUs its ranks use (`DeviceMemory.for_gpus`)."""
    def read() -> DeviceMemory | None:
        memory = probe()
        if memory is None:
            return None
        remember_free(seen, memory)
        return memory.for_gpus(count)

    return read


def most_free_for(seen: dict[int, int], count: int) -> int:
    """The most memory seen free on each GPU of a layout over `count` GPUs (the first `count` visible), at the least
    of them: what its ranks could have had. A layout's first trial thus knows what trials on its GPUs saw before."""
    return min((seen[i] for i in range(max(count, 1)) if i in seen), default=0)


def held_elsewhere(est: MemoryEstimate, most_free_bytes: int, total_bytes: int) -> bool:
    """Is the config short of memory only because another process holds some that was free earlier in this run?

    True when it would pass `memory_problems` with the most memory seen free, and at least
    max(1 GiB, 2% of the device) of that is gone now.
    """
    drop = most_free_bytes - est.available_bytes
    if drop < max(HELD_MIN_BYTES, HELD_MIN_FRACTION * total_bytes):
        return False
    return not memory_problems(replace(est, available_bytes=most_free_bytes))


async def wait_for_memory(probe: Callable[[], DeviceMemory | None], fits: Callable[[DeviceMemory], bool],
                          clock: Clock, timeout_s: float, interval_s: float, needed_bytes: int,
                          most_free_bytes: int) -> DeviceMemory | None:
    """Probe every `interval_s` until `fits(memory)`; after `timeout_s`, raise DeviceMemoryHeldError.

    Returns the memory that fits (None if the probe stops answering: then the real start decides).
    """
    deadline = clock.now() + timeout_s
    last: DeviceMemory | None = None
    while clock.now() < deadline:
        await clock.sleep_until(min(clock.now() + interval_s, deadline))
        last = probe()
        if last is None or fits(last):
            return last
    free = f"{last.available_bytes / GIB:.2f} GiB are free" if last else "the device is unreadable"
    raise DeviceMemoryHeldError(
        f"the trial needs {needed_bytes / GIB:.2f} GiB of device memory; {most_free_bytes / GIB:.2f} GiB were free "
        f"earlier in this run, but after waiting {timeout_s:.0f} s only {free}. Another process holds the rest "
        f"(an earlier trial's engine that did not exit? see `nvidia-smi` or `ps -ef | grep VLLM`): end it, then run "
        f"the same command again to resume")
