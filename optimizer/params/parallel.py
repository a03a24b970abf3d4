"""Tensor, pipeline and data parallelism: how many GPUs a config needs, and what each of them holds.

Memory is checked per GPU, against the smallest GPU the config uses; throughput is compared per GPU when layouts differ.
What one rank of a real engine holds is vLLM's own build of that rank (engines/vllm_config.py); `per_gpu` is the
simulated engine's plain split.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from optimizer.config.model import ModelInfo

LAYOUT_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def _size(params: dict[str, Any], name: str) -> int:
    value = params.get(name)
    return 1 if value is None else int(value)


def layout_sizes(params: dict[str, Any]) -> tuple[int, int, int]:
    """(tensor, pipeline, data) parallel sizes of `params`, vLLM's 1 where unset."""
    tp, pp, dp = (_size(params, name) for name in LAYOUT_ARGS)
    return tp, pp, dp


def gpus_needed(params: dict[str, Any]) -> int:
    """GPUs the engine takes: tensor x pipeline x data parallel sizes (vLLM's defaults: 1 each)."""
    return math.prod(layout_sizes(params))


# bytes per KV cache element by `kv_cache_dtype` (vllm/config/cache.py CacheDType), for the simulated engine's cache;
# "auto" is the model's dtype, another one counts 0 (unchecked). A real engine's cache is vLLM's own spec of it.
KV_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# quantizations made on the fly from a 16-bit checkpoint (`quantization`; vLLM's online shorthands): at most this
# share of the weights vLLM's model builds in 16 bits stays once loaded (embeddings keep their width, scales come on
# top: the weights are at least so much)
ONLINE_WEIGHT_SHARE = {"fp8": 1 / 2, "fp8_per_tensor": 1 / 2, "fp8_per_block": 1 / 2, "fp8_per_channel": 1 / 2,
                       "mxfp8": 1 / 2, "mxfp4": 1 / 4, "online": 1 / 4, "int8_per_channel_weight_only": 1 / 2,
                       "experts_int8": 1 / 2, "nvfp4_per_token": 1 / 4}


def online_share(params: dict[str, Any]) -> float:
    """Pure: the share of 16-bit weights that stays where `params` quantize as the model loads (1: none)."""
    return ONLINE_WEIGHT_SHARE.get(str(params.get("quantization")), 1.0)


def per_gpu(model: ModelInfo, params: dict[str, Any]) -> ModelInfo:
    """What one GPU of the layout holds of the simulated engine's model: its share of the weights over tensor x
    pipeline ranks (quantized as they load where `quantization` says so), of the layers over pipeline ranks, of the
    KV heads over tensor ranks (vLLM replicates them past their count), in the KV cache's dtype."""
    kv_dtype = str(params.get("kv_cache_dtype") or "auto")
    tp, pp, _ = layout_sizes(params)
    return replace(model, weights_bytes=math.ceil(model.weights_bytes * online_share(params) / (tp * pp)),
                   num_layers=math.ceil(model.num_layers / pp),
                   num_kv_heads=max(1, model.num_kv_heads // tp) if model.num_kv_heads else 0,
                   dtype_bytes=model.dtype_bytes if kv_dtype == "auto" else KV_DTYPE_BYTES.get(kv_dtype, 0))


def v2_model_runner(env: dict[str, str]) -> bool:
    """Pure: whether vLLM 0.32 runs its V2 model runner on a GPU (its default where Triton is) in `env`: unless
    VLLM_USE_V2_MODEL_RUNNER says 0 (a feature V2 lacks, some speculative methods, also turns it off)."""
    return env.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() not in ("0", "false")


def layout_problems(params: dict[str, Any], visible_gpus: int | None) -> list[str]:
    """Why the layout cannot run on the GPUs this process sees (None: unknown, unchecked), with the fix."""
    for name in LAYOUT_ARGS:
        if _size(params, name) < 1:
            return [f"{name} must be at least 1, got {params[name]}"]
    need = gpus_needed(params)
    if visible_gpus is not None and need > visible_gpus:
        return [f"the layout needs {need} GPUs (tensor x pipeline x data parallel), {visible_gpus} are visible: "
                f"lower tensor_parallel_size/data_parallel_size in the space, or make more GPUs visible "
                f"(CUDA_VISIBLE_DEVICES)"]
    return []


def per_gpu_curve(curve: list[dict[str, Any]], gpus: int) -> list[dict[str, Any]]:
    """A stored curve with its output throughput per GPU (and the GPU count), for comparing layouts."""
    return [{**p, "output_throughput_tok_s": float(p["output_throughput_tok_s"]) / gpus, "gpus": gpus}
            for p in curve]
