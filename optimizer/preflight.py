"""Reject, before any engine starts, configs whose memory cannot work (in well under a second).

The estimate: the engine may take `gpu_memory_utilization` x device memory; weights and a runtime reserve come out
of that first, and the rest is KV cache, which must hold at least one sequence of `max_model_len` tokens (vLLM
refuses to start otherwise). On the CPU build the fraction is of the NUMA node's memory, and vLLM also refuses
when that much is not free right now. Only clear cases are rejected: the sampler learns the rest from real starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from optimizer.model import ModelInfo

GIB = 1024**3
# Memory the engine needs besides weights and KV cache (runtime, activations, buffers). On CPU, measured here:
# 0.67-0.69 GiB for the 17M-parameter default model. On GPUs, CUDA context and activation peaks.
RUNTIME_RESERVE_BYTES = {"cpu": int(0.6 * GIB), "cuda": int(1.0 * GIB)}
# On the CPU build the KV cache is ordinary memory shared with everything else on the machine: a config that
# leaves less than this free (vLLM's default 0.92 of a 24 GiB machine did) thrashes, hangs and dies mid-replay.
CPU_HEADROOM_FRACTION, CPU_HEADROOM_MIN_BYTES = 0.1, 2 * GIB
VLLM_DEFAULT_MEMORY_FRACTION = 0.92


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int
    available_bytes: int

    @classmethod
    def probe(cls, device: str) -> DeviceMemory | None:
        """Memory of the device trials run on: the CPU's NUMA node 0 (as vLLM reads it) or GPU 0 (NVML)."""
        try:
            if device == "cpu":
                from vllm.utils.cpu_resource_utils import get_memory_node_info

                info = get_memory_node_info(0)
                return cls(int(info.total_memory), int(info.available_memory))
            import pynvml

            pynvml.nvmlInit()
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
                return cls(int(mem.total), int(mem.free))
            finally:
                pynvml.nvmlShutdown()
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


def estimate(params: dict[str, Any], model: ModelInfo, device: str, memory: DeviceMemory,
             mean_request_tokens: float) -> MemoryEstimate:
    """Pure: what the config asks for and what is left for the KV cache."""
    fraction = float(params.get("gpu_memory_utilization", VLLM_DEFAULT_MEMORY_FRACTION))
    requested = int(fraction * memory.total_bytes)
    reserve = RUNTIME_RESERVE_BYTES.get(device, RUNTIME_RESERVE_BYTES["cuda"])
    kv_budget = requested - model.weights_bytes - reserve
    model_len = int(params.get("max_model_len", model.max_len))
    per_token = model.kv_bytes_per_token
    one_seq = per_token * model_len
    fit = kv_budget / (per_token * mean_request_tokens) if per_token and mean_request_tokens else float("inf")
    headroom = 0
    if device == "cpu":
        headroom = max(int(CPU_HEADROOM_FRACTION * memory.total_bytes), CPU_HEADROOM_MIN_BYTES)
    return MemoryEstimate(requested, memory.available_bytes, model.weights_bytes, reserve, kv_budget, one_seq,
                          max(fit, 0.0), headroom)


def memory_problems(est: MemoryEstimate) -> list[str]:
    """Why the config cannot start, each with the fix; empty when it may."""
    out = []
    if est.requested_bytes > est.available_bytes - est.headroom_bytes:
        keep = f" (keeping {est.headroom_bytes / GIB:.2f} GiB for the rest of the machine)" if est.headroom_bytes else ""
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
