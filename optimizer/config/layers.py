"""Pure: which layers of a model keep a KV cache that grows with every token, as vLLM 0.32 builds them from the
model's `config.json` (a transformers config as read from disk, before transformers fills its defaults in).

vLLM gives each attention layer a cache spec (vllm/v1/kv_cache_interface.py): full attention keeps every token of a
sequence; a sliding-window layer (Gemma 2/3, gpt-oss, Mistral 7B v0.1) keeps its window and the tokens in flight
(`SlidingWindowSpec.max_admission_blocks_per_request`: window - 1 + the tokens in flight, at most max_model_len); a
Mamba, linear-attention or convolution layer of a hybrid model (Jamba, Nemotron-H, Granite 4, Qwen3-Next, Zamba2, LFM2,
Kimi Linear) keeps a state of fixed size, nothing per token (the state is not counted: a little under). A model with
both full and sliding layers keeps the windows apart only under the hybrid KV cache manager, on GPUs: on the CPU build,
or with `disable_hybrid_kv_cache_manager`, its sliding layers are promoted to full attention
(`kv_cache_utils.unify_hybrid_kv_cache_specs`); one whose layers all slide (Mistral 7B v0.1, Phi-3-mini-4k) keeps its
windows anywhere, as its specs are uniform. A layer type it does not know counts as none, and so do a hybrid model's
layers where no key says which attend: the memory check must never reject what vLLM would start.
"""

from __future__ import annotations

from dataclasses import dataclass

# `layer_types` values (transformers' configs): a sparse model's attention (DeepSeek V3.2's and glm_moe_dsa's indexed,
# MiniMax M3's) and a parallel hybrid's (Falcon-H1, Zamba2: attention beside the Mamba mixer) cache every token too
FULL_TYPES = frozenset({"full_attention", "attention", "chunked_attention", "global_attention", "indexed_attention",
                        "deepseek_sparse_attention", "qwen_sparse_attention", "minimax_m3_sparse", "hybrid"})
SLIDING_TYPES = frozenset({"sliding_attention", "local_attention", "hybrid_sliding"})
# the model types whose every layer is a state-space layer (vllm/model_executor/models/mamba*.py)
SSM_ONLY_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba"})
# keys of a hybrid model's state layers: where they are present and no key says which layers attend, none is counted
HYBRID_KEYS = ("mamba_d_state", "ssm_state_size", "mamba_d_conv", "linear_num_key_heads", "linear_conv_kernel_dim",
               "conv_L_cache", "short_conv_kernel", "mamba_n_heads", "mamba_expand", "linear_attn_config")
# One full layer in every `sliding_window_pattern` when config.json does not list `layer_types`, as transformers'
# configs build them: Gemma 2 (every other), Gemma 3 (6 by default), Cohere 2 (Command R7B, Command A: 4)
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}


@dataclass(frozen=True)
class CacheLayers:
    """How many layers keep keys and values of every token, and how many of them only a window of them."""

    attention: int  # layers with a per-token cache, sliding ones included
    sliding: int = 0  # of them, with a sliding window of `window` tokens
    window: int = 0


def cache_layers(text_config: dict) -> CacheLayers:
    """The layers of `text_config` that cache tokens, read as vLLM's model code reads them (see the module's doc); the
    last `num_kv_shared_layers` (Gemma 3n and 4) reuse earlier layers' keys and values and keep none of their own:
    not counted, taken from the full-attention layers first (the lenient side: which kind they are is not read)."""
    found = _cache_layers(text_config)
    shared = text_config.get("num_kv_shared_layers", 15 if text_config.get("model_type") == "gemma3n_text" else 0)
    if not isinstance(shared, int) or shared <= 0:
        return found
    attention = max(found.attention - shared, 0)
    return CacheLayers(attention, min(found.sliding, attention), found.window)


def kv_shapes(text_config: dict, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """Pure: the (KV heads, head size) shapes of a model's attention layers: its own, and for Gemma 4 its full-attention
    layers' (vLLM's per_layer_config: `global_head_dim`, 512, with `num_global_key_value_heads` where
    `attention_k_eq_v`, else the model's KV heads; or the entries of a `per_layer_config` config.json holds). Every
    layer counts at the smallest, per rank (params/parallel.py), the lenient side: Gemma-4-31B's full layers 4 x 512,
    not 16 x 256."""
    shapes = [(kv_heads, head_dim)]
    if not str(text_config.get("model_type", "")).startswith("gemma4"):
        return shapes
    size = text_config.get("global_head_dim")
    size = size if isinstance(size, int) and size > 0 else 512
    heads = text_config.get("num_global_key_value_heads") if text_config.get("attention_k_eq_v") else None
    heads = heads if isinstance(heads, int) and heads > 0 else kv_heads
    given = text_config.get("per_layer_config")
    entries = [e for e in given.values() if isinstance(e, dict)] if isinstance(given, dict) else []
    shapes += [(int(e.get("num_key_value_heads") or kv_heads), int(e.get("head_dim") or head_dim)) for e in entries] \
        or [(heads, size)]
    return list(dict.fromkeys(shapes))


def _cache_layers(text_config: dict) -> CacheLayers:
    layers = int(text_config.get("num_hidden_layers") or 0)
    window = text_config.get("sliding_window")
    if text_config.get("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        window = 0  # Qwen2/Qwen3 keep a sliding_window they do not use; 0 is "none" to vLLM
    both_ways = text_config.get("use_bidirectional_attention")
    if window and (both_ways == "all" or (both_ways is True and text_config.get("model_type") == "gemma3n_text")):
        window = window // 2 + 1  # transformers halves a bidirectional Gemma's window as it loads; vLLM runs that
    kinds = text_config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        sliding = sum(1 for k in kinds if k in SLIDING_TYPES) if window else 0
        full = sum(1 for k in kinds if k in FULL_TYPES or (k in SLIDING_TYPES and not window))
        return CacheLayers(full + sliding, sliding, window)
    attending = _hybrid_attention_layers(text_config, layers)
    if attending is not None:
        return CacheLayers(attending)
    if text_config.get("model_type") in SSM_ONLY_TYPES:
        return CacheLayers(0)
    if any(key in text_config for key in HYBRID_KEYS):
        return CacheLayers(0)  # a hybrid whose attention layers this does not read: its cache goes unchecked
    if not window:
        return CacheLayers(layers)
    pattern = GEMMA_PATTERN.get(str(text_config.get("model_type")))
    if pattern is not None:
        given = text_config.get("sliding_window_pattern")
        pattern = given if isinstance(given, int) and given > 0 else pattern
        return CacheLayers(layers, sum(1 for i in range(layers) if (i + 1) % pattern), window)
    if text_config.get("use_sliding_window"):  # Qwen2's: the layers from max_window_layers on (transformers: 28)
        given = text_config.get("max_window_layers")
        first = given if isinstance(given, int) else 28
        return CacheLayers(layers, max(layers - first, 0), window)
    return CacheLayers(layers, layers, window)  # a model-wide window (Mistral 7B v0.1): every layer


def layers_vary(text_config: dict) -> bool:
    """Whether a model's layers are not all attention beside an MLP of one shape: a hybrid's state layers (Nemotron-H's
    Mamba, MLP and expert layers apart), a NAS model's `block_configs` (some layers without attention), a state-space
    model. config/weights.py's layer-by-layer estimate counts such a model twice over or worse (Nemotron 3 Nano: 102B
    parameters for its 31.6B): its weights are then unknown, the lenient side."""
    kinds = text_config.get("layer_types") or text_config.get("layers_block_type")
    if isinstance(kinds, list) and kinds and all(k in ("attention", "full_attention") for k in kinds):
        return False  # a hybrid family's dense model (Granite 4's): attention in every layer
    return text_config.get("model_type") in SSM_ONLY_TYPES or any(
        k in text_config for k in (*HYBRID_KEYS, "hybrid_override_pattern", "layers_block_type", "block_configs"))


def _hybrid_attention_layers(text_config: dict, layers: int) -> int | None:
    """A hybrid model's attention layers, from the key its family names them by (vLLM 0.32's model classes, with
    transformers' defaults where config.json leaves a key out); None where it has none."""
    kind = text_config.get("model_type")
    pattern = text_config.get("hybrid_override_pattern")  # Nemotron-H: "*" attention, "M" Mamba, "-" MLP
    if isinstance(pattern, str) and pattern:
        return pattern.count("*")
    kinds = text_config.get("layers_block_type")  # Granite 4, Nemotron-H (either spelling), Zamba2's "hybrid" blocks
    if isinstance(kinds, list) and kinds:
        return sum(1 for k in kinds if k in ("attention", "full_attention", "hybrid"))
    linear = text_config.get("linear_attn_config")  # Kimi Linear: its KDA layers by number (from 1), MLA the others
    if isinstance(linear, dict) and isinstance(linear.get("kda_layers"), list):
        return layers - sum(1 for i in range(1, layers + 1) if i in linear["kda_layers"])
    indices = text_config.get("attn_layer_indices") or text_config.get("full_attn_idxs")  # LFM2's fallback
    if isinstance(indices, list):
        return len(indices)
    period, offset = text_config.get("attn_layer_period"), text_config.get("attn_layer_offset")  # Jamba: 8, 4
    if kind == "jamba":
        period, offset = period if isinstance(period, int) else 8, offset if isinstance(offset, int) else 4
    if isinstance(period, int) and period > 0 and isinstance(offset, int):
        return sum(1 for i in range(layers) if i % period == offset)
    interval = text_config.get("full_attention_interval")  # Qwen3-Next before its layer_types (transformers: 4)
    if kind == "qwen3_next" and not isinstance(interval, int):
        interval = 4
    if isinstance(interval, int) and interval > 0:
        return layers // interval
    if kind == "falcon_h1":  # a parallel hybrid: attention beside the Mamba mixer in every layer
        return layers
    types = text_config.get("attn_type_list")  # MiniMax: 1 softmax attention, 0 lightning (linear) attention
    if isinstance(types, list) and types:
        return sum(1 for t in types if t == 1)
    return None


def indexer_bytes_per_token(text_config: dict) -> int:
    """A sparse-attention model's indexer caches per token over its layers (0 for others), as vLLM 0.32 builds them
    for DeepSeek V3.2 and its aliases (vllm/model_executor/models/deepseek_v32/attention.py on CUDA, deepseek_v2.py
    elsewhere: the same rule):
    a config with `index_topk` gives each layer an indexer, but those its IndexCache skips (it keeps the layers before
    `index_skip_topk_offset` - 1 and every `index_topk_freq`-th from there, or those without an "S" in
    `index_topk_pattern`), each caching per token `index_head_dim` fp8 values and a 4-byte scale per 128 of them
    (132 bytes for the usual 128)."""
    if "index_topk" not in text_config:
        return 0
    layers = int(text_config.get("num_hidden_layers") or 0)
    dim = int(text_config.get("index_head_dim") or 128)
    freq = int(text_config.get("index_topk_freq") or 1)
    given = text_config.get("index_skip_topk_offset")
    offset = given if isinstance(given, int) else 2
    pattern = text_config.get("index_topk_pattern")

    def skipped(layer: int) -> bool:
        if pattern is None:
            return max(layer - offset + 1, 0) % freq != 0
        return layer < len(pattern) and pattern[layer] == "S"

    return sum(1 for layer in range(layers) if not skipped(layer)) * (dim + dim // 128 * 4)
