"""Pure: a model's weight bytes estimated from its `config.json`, for the memory preflight when no weight files are
on disk (a hub id, or `--dummy-weights`).

Counted as vLLM loads them: the embeddings and the output head, each layer's attention (multi-head latent attention
for DeepSeek-style models: its low-rank projections), and each layer's MLP: a dense one, or a mixture of experts with
*every* expert (vLLM keeps all of them in memory, not only the few a token routes to), its shared experts and its
router. Which layers are mixtures follows the model's own config keys:

- DeepSeek V2/V3 and their kin (`n_routed_experts`): the layers from `first_k_dense_replace` on, every
  `moe_layer_freq`-th; `n_shared_experts` experts of `moe_intermediate_size` beside the routed ones;
- Qwen2/Qwen3-MoE (`num_experts`): every `decoder_sparse_step`-th layer not in `mlp_only_layers`; a shared expert of
  `shared_expert_intermediate_size` where given;
- Llama 4 (`interleave_moe_layer_step`): every step-th layer, with one shared expert; the others dense of
  `intermediate_size_mlp`;
- Mixtral, Phi-MoE, GraniteMoE, OLMoE, gpt-oss (`num_local_experts` or `num_experts` alone): every layer.

Quantized checkpoints (`quantization_config`, or an older ModelOpt checkpoint's `hf_quant_config.json`) count their
linear layers at the stored width: GPTQ/AWQ `bits`, compressed-tensors' narrowest weight `num_bits` (a mixed checkpoint
is undercounted, never over), FP8 1 byte, MXFP4 4.25 bits (gpt-oss's experts; fp_quant's mxfp4), NVFP4 4.5, DeepSeek
V4's experts in MXFP4 unless its `expert_dtype` is fp8 and the rest in FP8; embeddings stay in the checkpoint's
dtype. A quantization this does not know leaves the weights unknown (0: the preflight then checks the rest and
vLLM's own start decides), never a guess at full width that would prune configs that fit.

The experts' share is kept apart (`weights_split`): vLLM shards a mixture's experts over tensor x data parallel ranks
(its FusedMoE flattens the two, expert parallelism or not), the rest over tensor ranks only.

Checked against published totals (tests/config/test_weights.py): Mixtral-8x7B 46.7B, Qwen3-30B-A3B 30.5B,
DeepSeek-V3 671B, Llama-4-Scout's text model 108B, gpt-oss-120b 117B.
"""

from __future__ import annotations

from typing import Any

# model types whose dense MLP is an up and a down projection, no gate (vLLM's classes of them): StarCoder2-15B is 16B,
# not the 21.7B three matrices would make it
NON_GATED = frozenset({"starcoder2", "gpt_neox", "phi", "nemotron", "falcon", "opt", "gpt2", "gpt_bigcode", "gptj",
                       "bloom", "mpt", "persimmon", "codegen", "apertus", "arcee", "jais2", "nanochat", "gpt_neo",
                       "gpt_neox_japanese"})
FP8_METHODS = frozenset({"fp8", "fbgemm_fp8", "deepseek_v4_fp8", "modelopt_mxfp8", "mxfp8"})
MXFP4_BITS = 4.25  # 4-bit values and one 8-bit scale per 32
NVFP4_BITS = 4.5  # 4-bit values and one 8-bit scale per 16


def _int(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def attention_params(cfg: dict[str, Any]) -> int:
    """One layer's attention projections."""
    h = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    if cfg.get("kv_lora_rank") is not None and _int(cfg, "qk_rope_head_dim"):  # multi-head latent attention
        rope, nope = _int(cfg, "qk_rope_head_dim"), _int(cfg, "qk_nope_head_dim")
        v_dim, kv_rank, q_rank = _int(cfg, "v_head_dim", default=nope), _int(cfg, "kv_lora_rank"), \
            _int(cfg, "q_lora_rank")
        q = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        return q + h * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * h
    head_dim = _int(cfg, "head_dim", default=h // heads if heads else 0)
    kv_heads = kv_head_count(cfg)
    return 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim


def kv_head_count(cfg: dict[str, Any]) -> int:
    """KV heads as vLLM builds them: Falcon's `num_kv_heads` under its new decoder architecture, else one where
    `multi_query` (its default) says so (transformers fills num_kv_heads with every head there: not read); other models'
    `num_key_value_heads`, every head where unsaid."""
    heads = _int(cfg, "num_attention_heads")
    if cfg.get("model_type") == "falcon":
        if cfg.get("new_decoder_architecture"):
            return _int(cfg, "num_kv_heads") or heads
        return 1 if cfg.get("multi_query", True) else heads
    return _int(cfg, "num_key_value_heads") or heads


def expert_count(cfg: dict[str, Any]) -> int:
    """Routed experts per mixture layer (0: a dense model)."""
    return _int(cfg, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")


def mixture_layers(cfg: dict[str, Any]) -> list[bool]:
    """For each layer, whether its MLP is a mixture of experts."""
    layers, experts = _int(cfg, "num_hidden_layers"), expert_count(cfg)
    if not experts:
        return [False] * layers
    if "n_routed_experts" in cfg:  # DeepSeek
        first, freq = _int(cfg, "first_k_dense_replace"), max(_int(cfg, "moe_layer_freq", default=1), 1)
        return [i >= first and i % freq == 0 for i in range(layers)]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:  # Qwen MoE
        step, dense = max(_int(cfg, "decoder_sparse_step", default=1), 1), set(cfg.get("mlp_only_layers") or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    if "interleave_moe_layer_step" in cfg:  # Llama 4 (a step of 0: no mixture layers)
        step = _int(cfg, "interleave_moe_layer_step", default=1)
        return [step > 0 and (i + 1) % step == 0 for i in range(layers)]
    return [True] * layers


def mlp_params(cfg: dict[str, Any], mixture: bool) -> tuple[int, int]:
    """One layer's MLP: (its experts' parameters, the rest: a dense MLP, shared experts, the router)."""
    h, inter = _int(cfg, "hidden_size"), _int(cfg, "intermediate_size")
    if not mixture:  # gated: gate, up and down; the families of one up projection: two
        return 0, (2 if cfg.get("model_type") in NON_GATED else 3) * h * _int(cfg, "intermediate_size_mlp",
                                                                            default=inter or 4 * h)
    experts, size = expert_count(cfg), _int(cfg, "moe_intermediate_size", default=inter)
    shared = _int(cfg, "n_shared_experts") * 3 * h * size + 3 * h * _int(cfg, "shared_expert_intermediate_size")
    if "interleave_moe_layer_step" in cfg:  # Llama 4: one shared expert of the experts' size
        shared += 3 * h * size
    return experts * 3 * h * size, shared + h * experts


def quantized_bits(q: Any, cfg: dict[str, Any] | None = None) -> tuple[float, float] | None:
    """(bits a mixture's expert weight is stored in, bits the other linear weights are) for a checkpoint's
    `quantization_config` (`cfg`: the model's config, for DeepSeek V4's experts); (16, 16) without one (the caller
    caps both at the dtype's width); None: a quantization this does not know."""
    if not isinstance(q, dict):
        return 16.0, 16.0
    method, cfg = str(q.get("quant_method") or "").lower(), cfg or {}
    if str(cfg.get("model_type", "")).startswith("deepseek_v4"):  # vLLM keeps V4's experts in MXFP4 (unless fp8),
        return (8.0 if cfg.get("expert_dtype") == "fp8" else MXFP4_BITS), 8.0  # the rest in FP8
    if method in ("mxfp4", "gpt_oss_mxfp4"):
        return MXFP4_BITS, 16.0  # gpt-oss: experts only, attention in the checkpoint's dtype
    if method == "fp_quant":
        bits = NVFP4_BITS if str(q.get("forward_dtype", "")).lower() == "nvfp4" else MXFP4_BITS
        return bits, bits
    if method in FP8_METHODS:
        return 8.0, 8.0
    if method.startswith("modelopt") or "quant_algo" in q or isinstance(q.get("quantization"), dict):
        algo = str(q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo") or "").upper()
        return (8.0, 8.0) if algo == "FP8" else (NVFP4_BITS, NVFP4_BITS) if algo == "NVFP4" else None
    if method == "compressed-tensors":
        widths = [g.get("weights", {}).get("num_bits") for g in (q.get("config_groups") or {}).values()
                  if isinstance(g, dict) and isinstance(g.get("weights"), dict)]
        widths = [w for w in widths if isinstance(w, int)]
        return (float(min(widths)),) * 2 if widths else None
    bits = _int(q, "bits", "w_bit", "weight_bits")
    return (float(bits), float(bits)) if bits else None


def weights_split(cfg: dict[str, Any], dtype_bytes: int, quantization: Any = None) -> tuple[int, int] | None:
    """(the weights' bytes as vLLM holds them, of which the mixture's experts): `cfg` the (text) model's config,
    `quantization` the checkpoint's `quantization_config` (top level of config.json; default: `cfg`'s own; False: none,
    as if unquantized). None: a quantization this does not know."""
    stored = quantized_bits(cfg.get("quantization_config") if quantization is None else quantization, cfg)
    if stored is None:
        return None
    expert_bits, dense_bits = stored
    h, vocab = _int(cfg, "hidden_size"), _int(cfg, "vocab_size", default=32000)
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings", True) else 2)  # unsaid: tied, the lenient side
    experts = dense = 0
    attention = attention_params(cfg)
    for mixture in mixture_layers(cfg):
        e, rest = mlp_params(cfg, mixture)
        experts, dense = experts + e, dense + rest + attention
    full = dtype_bytes * 8.0
    expert_bytes = int(experts * min(expert_bits, full) / 8)
    return int(embeddings * dtype_bytes + dense * min(dense_bits, full) / 8) + expert_bytes, expert_bytes

