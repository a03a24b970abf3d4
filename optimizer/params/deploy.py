"""What the user deploys, and the defaults vLLM gives it: the baseline is those defaults, not the engine's.

vLLM resolves `max_num_seqs` and `max_num_batched_tokens` per usage context (`EngineArgs.get_batch_defaults`,
vllm/engine/arg_utils.py): `vllm serve` builds its config under `OPENAI_API_SERVER`, `vllm.LLM` under `LLM_CLASS`,
and `AsyncLLM.from_engine_args` under `ENGINE_CONTEXT`, which has no entry and falls back to the scheduler's
128 sequences and 2048 tokens. On an H100 `vllm serve` gets 1024 and 8192. Trials are built under the context of
what is deployed (`vllm serve` unless told otherwise), so the baseline, vLLM's defaults, is what that deployment
runs, and the gain is measured against it.
"""

from __future__ import annotations

from typing import Any

GIB = 1024**3
# deploy_as -> (vLLM's UsageContext member, how the output names it)
TARGETS = {"serve": ("OPENAI_API_SERVER", "vllm serve"), "llm": ("LLM_CLASS", "vllm.LLM")}
DEFAULT_TARGET = "serve"
# vLLM's SchedulerConfig.DEFAULT_MAX_NUM_SEQS / DEFAULT_MAX_NUM_BATCHED_TOKENS: a context without an entry
SCHEDULER_DEFAULTS = (128, 2048)


def label(deploy_as: str) -> str:
    """How the output names the deployment whose defaults are the baseline, e.g. `vllm serve`."""
    return TARGETS[deploy_as][1]


def usage_context(deploy_as: str) -> Any:
    """vLLM's UsageContext for `deploy_as` (imports vLLM)."""
    from vllm.usage.usage_lib import UsageContext

    return getattr(UsageContext, TARGETS[deploy_as][0])


def batch_defaults(deploy_as: str, device: str, memory_total_bytes: int = 0, device_name: str = "",
                   world_size: int = 1) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM 0.32 gives `deploy_as` on a device of this memory and name
    (TPUs aside): pure, a copy of `EngineArgs.get_batch_defaults` that needs no GPU (tests/params/test_deploy.py
    checks it against vLLM's own)."""
    serve = deploy_as == "serve"
    if device == "cpu":
        return 128 * world_size if serve else 256 * world_size, 2048 * world_size if serve else 4096 * world_size
    if memory_total_bytes >= 160 * GIB:
        return 1024, 16384
    if memory_total_bytes >= 70 * GIB and "a100" not in device_name.lower():
        return 1024, 8192 if serve else 16384
    return 256, 2048 if serve else 8192
