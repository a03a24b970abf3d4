"""The one module that reads vLLM's own config for the preflight: the `VllmConfig` that the installed vLLM builds for
a trial's engine arguments (`EngineArgs.create_engine_config`, the call its engine start makes first), read into a
`Resolved` (config/resolved.py). Nothing here derives a value vLLM already resolves: its max_model_len, its batch
defaults for this device and deployment, the tokens in flight, MLA under the trial's environment."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from optimizer.config.resolved import Resolved


@contextmanager
def trial_environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with the trial's `env:` parameters set (vLLM reads VLLM_MLA_DISABLE and
    VLLM_USE_V2_MODEL_RUNNER while it builds its config), as it was afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        restore_environment(saved)


def restore_environment(saved: Mapping[str, str | None]) -> None:
    """Each variable of `saved` back to its value (None: unset), as it was before a trial's environment was set."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def resolved(vllm_config: Any) -> Resolved:
    """The preflight's numbers, read from vLLM's config for the trial (under the trial's environment: vLLM reads
    some of it lazily, `ModelConfig.use_mla` among them)."""
    model, scheduler, cache = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
    # -1 asks vLLM to fit the length to the memory at start: nothing for the preflight to check against
    length = -1 if getattr(model, "original_max_model_len", None) == -1 else int(model.max_model_len)
    return Resolved(max_model_len=length, max_num_seqs=int(scheduler.max_num_seqs),
                    max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
                    max_in_flight_tokens=int(vllm_config.max_in_flight_tokens), use_mla=bool(model.use_mla),
                    kv_cache_dtype=str(cache.cache_dtype), kv_bytes_per_layer=kv_bytes_per_layer(vllm_config),
                    attention_layers=attention_layers(vllm_config))


def kv_bytes_per_layer(vllm_config: Any) -> int:
    """One token's cache in one attention layer on a rank: the `page_size_bytes` of vLLM's KV cache spec class for
    such a layer (MLAAttentionSpec under MLA, else FullAttentionSpec), at one token a block; 0 for a cache dtype
    with scales or packing per token (vLLM's KVQuantMode other than none or per-tensor fp8: the attention backend
    sizes those, which a spec built from the config alone would miss), and wherever vLLM cannot build it."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec, get_kv_quant_mode

    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if get_kv_quant_mode(cache.cache_dtype) not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        return 0
    try:
        spec = (MLAAttentionSpec if model.use_mla else FullAttentionSpec)(
            block_size=1, num_kv_heads=model.get_num_kv_heads(parallel), head_size=model.get_head_size(),
            dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, model),
            kv_quant_mode=get_kv_quant_mode(cache.cache_dtype))
        return int(spec.page_size_bytes)
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError):
        return 0


def attention_layers(vllm_config: Any) -> int:
    """The attention layers of a rank's pipeline stage, as vLLM counts them (0 where it cannot say)."""
    try:
        return int(vllm_config.model_config.get_num_layers_by_block_type(vllm_config.parallel_config, "attention"))
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError):
        return 0
