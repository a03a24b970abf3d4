"""Tensor, pipeline and data parallelism: how many GPUs a config needs, and what each of them holds.

vLLM splits the weights over tensor x pipeline parallel ranks, and the KV cache's heads over tensor-parallel ranks
(each rank keeps max(1, kv_heads // tp) of them: vLLM replicates KV heads when tp exceeds their count), layers over
pipeline ranks. Data-parallel replicas each hold a whole copy, but for a mixture's experts, which vLLM's FusedMoE
shards over tensor x data parallel ranks. Memory is checked per GPU, against the smallest GPU
the config uses; throughput is compared per GPU when layouts differ.
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


# bytes per KV cache element by `kv_cache_dtype` (vllm/config/cache.py CacheDType); "auto" is the model's dtype.
# The per-token-head caches keep a scale beside each head's bytes, which this leaves out (a little under: only clear
# cases are rejected). The packed ones (nvfp4*, turboquant_*, ultraquant_*, int4_*) are not here: their KV cache goes
# unchecked, the real start decides. vLLM serves a sparse MLA model's fp8 in DeepSeek's packed layout on some
# backends (656 bytes, not 576): the GPU decides, so fp8 counts its 1 byte, the lenient side.
KV_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
                  "fp8_per_token_head": 1, "int8_per_token_head": 1}
# DeepSeek's packed MLA layouts: one token's latent (NoPE part quantized, its scales, RoPE part in 16 bits) in so many
# bytes a layer (the MLA layer's get_kv_cache_spec, `state_content_bytes`); an MLA model's only
PACKED_MLA_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
# vLLM 0.32's quantizations made on the fly from a 16-bit checkpoint (`quantization`; config/quantization.py's online
# shorthands, fp8, experts_int8): at most these shares of the weights stay, (the rest, a mixture's experts); the
# embeddings keep their width and scales come on top, so the weights are at least so much. "online" reads its format
# from `quantization_config`: 4 bits at the least.
ONLINE_WEIGHT_SHARE = {"fp8": (1 / 2, 1 / 2), "fp8_per_tensor": (1 / 2, 1 / 2), "fp8_per_block": (1 / 2, 1 / 2),
                       "fp8_per_channel": (1 / 2, 1 / 2), "mxfp8": (1 / 2, 1 / 2), "mxfp4": (1 / 4, 1 / 4),
                       "online": (1 / 4, 1 / 4), "int8_per_channel_weight_only": (1, 1 / 2),
                       "experts_int8": (1, 1 / 2), "nvfp4_per_token": (1, 1 / 4)}


def per_gpu(model: ModelInfo, params: dict[str, Any]) -> ModelInfo:
    """What one GPU of the layout holds: its share of the weights (a mixture's experts also split over data parallel
    ranks; quantized as they load where `quantization` says so: ONLINE_WEIGHT_SHARE), and of the KV cache's layers and
    heads, in the KV cache's dtype (`kv_cache_dtype`: fp8 halves a 16-bit model's KV bytes per token)."""
    share = ONLINE_WEIGHT_SHARE.get(str(params.get("quantization")))
    if share is not None:  # quantized as it loads: a bf16 checkpoint at fp8 holds half its bytes
        rest, experts = model.weights_bytes - model.expert_bytes, model.expert_bytes
        model = replace(model, weights_bytes=int(rest * share[0] + experts * share[1]),
                        expert_bytes=int(experts * share[1]))
    kv_dtype = str(params.get("kv_cache_dtype") or "auto")
    if kv_dtype in PACKED_MLA_BYTES and model.mla:
        model = replace(model, packed_layer_bytes=PACKED_MLA_BYTES[kv_dtype])
    elif kv_dtype != "auto":  # a dtype the tables lack: 0 bytes, "not understood" (ModelInfo), its KV cache unchecked
        model = replace(model, dtype_bytes=KV_DTYPE_BYTES.get(kv_dtype, 0))
    tp, pp, dp = layout_sizes(params)
    if tp == pp == 1 and (dp == 1 or not model.expert_bytes):
        return model
    # a mixture's experts are sharded over tensor x data parallel ranks (vLLM's FusedMoE), the rest over tensor ranks
    rest = model.weights_bytes - model.expert_bytes
    return replace(model, weights_bytes=math.ceil(rest / (tp * pp)) + math.ceil(model.expert_bytes / (tp * pp * dp)),
                   expert_bytes=math.ceil(model.expert_bytes / (tp * pp * dp)),
                   num_layers=math.ceil(model.num_layers / pp) if model.num_layers else 0,
                   # the largest stage's share, as for the layers (the first stages take ceil(L / pp) of them)
                   indexer_bytes=math.ceil(model.indexer_bytes * math.ceil(model.num_layers / pp) / model.num_layers)
                   if model.num_layers else 0,
                   sliding_layers=min(math.ceil(model.sliding_layers / pp), math.ceil(model.num_layers / pp)),
                   **_rank_kv_shape(model, tp))


def _rank_kv_shape(model: ModelInfo, tp: int) -> dict[str, int]:
    """One rank's KV heads (vLLM replicates them past their count) and head size: for a model whose layers differ in
    shape (`ModelInfo.kv_shapes`: Gemma 4), the smallest a rank keeps of any of them."""
    heads, size = max(1, model.num_kv_heads // tp) if model.num_kv_heads else 0, model.head_dim
    for total, other in model.kv_shapes:
        if max(1, total // tp) * other < heads * size:
            heads, size = max(1, total // tp), other
    return {"num_kv_heads": heads, "head_dim": size}


def v2_model_runner(env: dict[str, str]) -> bool:
    """Pure: whether vLLM 0.32 runs its V2 model runner on a GPU (its default where Triton is) in `env`: unless
    VLLM_USE_V2_MODEL_RUNNER says 0 (a feature V2 lacks, some speculative methods, also turns it off)."""
    return env.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() not in ("0", "false")


def batches_in_flight(params: dict[str, Any], device: str, env: dict[str, str]) -> int:
    """Pure: how many batches vLLM 0.32 keeps in flight at once (`VllmConfig.max_concurrent_batches`); a sliding-window
    layer keeps their tokens beside its window (`max_in_flight_tokens`: this x max_num_batched_tokens). With async
    scheduling, the pipeline's stages + 1 on vLLM's V2 model runner (its default where Triton is: GPUs; `env` is the
    trial's `env:` parameters, VLLM_USE_V2_MODEL_RUNNER=0 turns it off), 2 on the V1 runner without pipeline
    parallelism; else the pipeline's stages. vLLM turns async scheduling on unless the config says otherwise (its
    executors have it, Ray's V2 executor too), but for pipeline parallelism on the V1 runner; its CPU build turns it
    off. With speculative decoding, whose methods it turns it off for in part, the stages alone (the lenient side: a
    start decides)."""
    pp = _size(params, "pipeline_parallel_size")
    if device == "cpu" or params.get("speculative_config"):
        return pp
    v2 = v2_model_runner(env)
    on = params.get("async_scheduling")
    if on is None:
        on = pp == 1 or v2
    if on and v2:
        return pp + 1
    return 2 if on and pp == 1 else pp


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
