"""Model resolution: a local directory, a hub id, or an embedded default generated locally once.

The CPU's default is a small Llama-architecture model with random weights (no download), one of a small ladder of
shapes: the probe chooses the largest one this machine serves well inside the limit, so that on any CPU a
150 ms TTFT P99 limit separates good engine configurations from bad ones. A GPU's: config/demo.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from optimizer.config.layers import cache_layers, indexer_bytes_per_token, kv_shapes, layers_vary
from optimizer.config.context import context_lengths
from optimizer.config.weights import expert_count, kv_head_count, weights_split
from optimizer.core.errors import UsageError
from optimizer.hardware.machine import FULL_DTYPES

@dataclass(frozen=True)
class DemoShape:
    """One embedded demo model: a small Llama with random weights, generated locally (no download)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int

    @property
    def config(self) -> dict[str, Any]:
        """Its transformers `config.json` (head size 64, which every CPU attention backend supports)."""
        heads = self.hidden_size // 64
        return {**_DEMO_COMMON, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": heads, "num_key_value_heads": heads}

    @property
    def flops_per_token(self) -> int:
        """Multiply-adds x 2 of one prompt token through the decoder layers: what prefill time scales with."""
        h, i = self.hidden_size, self.intermediate_size
        return 2 * self.num_layers * (4 * h * h + 3 * h * i)


_DEMO_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 16000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Largest first. The probe (optimizer/search/probe.py) picks the largest one this machine serves fast enough for the
# limit: a CPU without native bf16, or a small laptop core, gets a smaller model instead of an infeasible demo.
DEMO_LADDER = (
    DemoShape("tiny-llama-17m", hidden_size=384, intermediate_size=1024, num_layers=6),
    DemoShape("tiny-llama-7m", hidden_size=256, intermediate_size=688, num_layers=4),
    DemoShape("tiny-llama-4m", hidden_size=192, intermediate_size=512, num_layers=2),
)
DEFAULT_MODEL_NAME = DEMO_LADDER[0].name
DEFAULT_MODEL_CONFIG = DEMO_LADDER[0].config
GPU_DEMO_NAME = "llama3.2-1b-dummy"  # the GPU's embedded default (config/demo.py)


def is_demo_model(path_or_name: str) -> bool:
    """Whether `path_or_name` is one of the embedded CPU demo models (its name, or a directory named after it)."""
    return Path(path_or_name.rstrip("/")).name in {shape.name for shape in DEMO_LADDER}


def demo_shape(name: str) -> DemoShape:
    """The embedded shape called `name`, or a UsageError that lists them."""
    for shape in DEMO_LADDER:
        if shape.name == name:
            return shape
    raise UsageError(f"no embedded demo model {name!r}: the embedded ones are "
                     f"{', '.join(s.name for s in DEMO_LADDER)}")

# The model types vLLM 0.32 runs with multi-head latent attention when their config has a kv_lora_rank
# (vllm/transformers_utils/model_arch_config_convertor.py::is_deepseek_mla)
MLA_MODEL_TYPES = frozenset({
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots3_note", "deepseek_mtp",
    "k3_dspark", "glm5_next", "glm5_next_text", "glm_moe_dsa", "glm4_moe_lite", "glm4_moe_lite_mtp", "kimi_k2",
    "kimi_linear", "longcat_flash", "pangu_ultra_moe", "pangu_ultra_moe_mtp", "bailing_hybrid", "bailing_hybrid_mtp",
    "bailing_hybrid_v3_mtp", "hy_v4", "hy_v4_mtp"})

# Of them, those whose vLLM class reads `use_mla` and builds ordinary attention when VLLM_MLA_DISABLE is set
# (deepseek_v2.py, AXK1.py, glm4_moe_lite.py, openpangu.py); the others keep their latent whatever it says
MLA_SWITCHABLE = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_mtp", "kimi_k2", "axk1", "glm4_moe_lite",
                            "glm4_moe_lite_mtp", "pangu_ultra_moe", "pangu_ultra_moe_mtp"})


@dataclass(frozen=True)
class ModelInfo:
    """What the tool needs to know of a model before any engine starts."""

    path: str
    vocab_size: int
    max_len: int
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    weights_bytes: int = 0
    dtype: str = "bfloat16"  # the checkpoint's (config.json torch_dtype)
    mla: bool = False  # multi-head latent attention (DeepSeek V2/V3, Kimi K2): one latent per token and layer
    expert_bytes: int = 0  # of weights_bytes, a mixture's experts (sharded over data parallel ranks too)
    # DeepSeek V3.2's sparse attention: each indexer layer's own cache of fp8 keys and their scales, per token over
    # all layers (`indexer_bytes_per_token`); in bytes whatever the KV cache's dtype, on every tensor-parallel rank
    indexer_bytes: int = 0
    # the two caches VLLM_MLA_DISABLE chooses between, for a model whose MLA it can turn off: (the latent's head
    # size, the heads and head size with MLA off); () where it chooses nothing (`under_env`)
    mla_switch: tuple[int, ...] = ()
    # of num_layers (the layers with a per-token cache: config/layers.py), those with a sliding window of so many tokens
    sliding_layers: int = 0
    sliding_window: int = 0
    # an MLA layer's token in a packed layout (kv_cache_dtype fp8_ds_mla: 656 bytes; params/parallel.py), 0 otherwise
    packed_layer_bytes: int = 0
    hidden_size: int = 0
    default_len: int = 0  # the max_model_len vLLM takes where a config leaves it out (config/context.py); 0: max_len
    mlp_size: int = 0  # a dense MLP's output width, at least (intermediate_size); 0 for a mixture, or unknown
    kv_shapes: tuple[tuple[int, int], ...] = ()  # where layers differ (Gemma 4): each (KV heads, head size)

    def served_as(self, dtype: str | None) -> ModelInfo:
        """The same model served in `dtype` (None or "auto": its own): weights and KV cache in that many bytes."""
        if not dtype or dtype == "auto":
            return self
        size = dtype_size(dtype)
        if not self.dtype_bytes:
            return replace(self, dtype_bytes=size, dtype=dtype)
        return replace(self, dtype_bytes=size, weights_bytes=self.weights_bytes * size // self.dtype_bytes,
                       expert_bytes=self.expert_bytes * size // self.dtype_bytes, dtype=dtype)

    def under_env(self, env: Mapping[str, str]) -> ModelInfo:
        """Pure: the model as vLLM runs it where `env` (a trial's `env:` parameters) sets VLLM_MLA_DISABLE, which
        this process's own environment decided at `model_info`: the latent cache, or every head's keys and values."""
        if not self.mla_switch or "VLLM_MLA_DISABLE" not in env:
            return self
        return self.with_mla(mla_enabled(env))

    def with_mla(self, mla: bool) -> ModelInfo:
        """Pure: the model with its latent cache on or off, as vLLM resolved it (a model without the switch as it
        is)."""
        if not self.mla_switch:
            return self
        latent, heads, head_dim = self.mla_switch
        return replace(self, mla=mla, num_kv_heads=1 if mla else heads, head_dim=latent if mla else head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token over all layers (0 when the architecture is not understood); with MLA the one
        latent vector vLLM caches instead (its MLAAttentionSpec: one head of kv_lora_rank + qk_rope_head_dim, no V),
        and a sparse model's indexer caches beside it."""
        return self.num_layers * self.kv_bytes_per_layer + self.indexer_bytes if self.head_dim and self.dtype_bytes \
            else 0

    @property
    def kv_bytes_per_layer(self) -> int:
        """One token's cache in one attention layer (the indexer's aside)."""
        if self.mla and self.packed_layer_bytes:
            return self.packed_layer_bytes
        return (1 if self.mla else 2) * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes_one_sequence(self, max_model_len: int, in_flight_tokens: int = 0, windows_kept: bool = True) -> int:
        """At least the cache one sequence of `max_model_len` tokens needs, as vLLM checks it at start (`kv_cache_utils.
        check_enough_kv_cache_memory`, from each layer's `max_memory_usage_bytes`): a sliding layer keeps its window and
        the `in_flight_tokens` (max_num_batched_tokens x the batches in flight, params/parallel.py; 0 where unknown)
        where `windows_kept` (config/layers.py says where), else every token as full attention does."""
        full = self.kv_bytes_per_token * max_model_len
        if not (windows_kept and self.sliding_layers and self.sliding_window) or not self.head_dim:
            return full
        kept = min(self.sliding_window - 1 + in_flight_tokens, max_model_len)
        return full - self.sliding_layers * self.kv_bytes_per_layer * (max_model_len - kept)


def cache_dir() -> Path:
    return Path(os.environ.get("OPTIMIZER_CACHE", Path.home() / ".cache" / "optimizer"))


def default_model(name: str = DEFAULT_MODEL_NAME) -> Path:
    """An embedded demo model's directory, generated on first use (seeded random weights)."""
    shape = demo_shape(name)
    target = cache_dir() / "models" / shape.name
    if all((target / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=target.parent))
    try:
        config = LlamaConfig(**{k: v for k, v in shape.config.items() if k != "architectures"})
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(tmp)
        word_tokenizer(shape.config["vocab_size"]).save_pretrained(tmp)
        if target.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer ("w123" <-> id 123), so that the default model also serves over HTTP and with
    `vllm serve`; the optimizer itself drives engines with token ids and never needs it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def inspect_model(model: str, dummy_weights: bool = False) -> ModelInfo:
    """Check the model before a study starts; a bad path fails here with the fix, not in every trial."""
    path = Path(model).expanduser()
    looks_local = path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1
    if looks_local:
        if not path.exists():
            raise UsageError(f"model path {model!r} does not exist: give a model directory, a hub id like "
                             f"'org/name', or leave out --model for the embedded default")
        if not (path / "config.json").is_file():
            raise UsageError(f"{model!r} is not a model directory (no config.json in it): point --model at the "
                             f"folder that holds config.json")
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path / 'config.json'} is not valid JSON ({exc}): fix or regenerate it") from None
        if not isinstance(config, dict):
            raise UsageError(f"{path / 'config.json'} holds a JSON {type(config).__name__}, not an object of the "
                             f"model's settings: fix or regenerate it")
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin")) or any(path.glob("*.pt"))
        if not has_weights and not dummy_weights:
            raise UsageError(f"{model!r} has a config.json but no weights: add --dummy-weights to tune the "
                             f"architecture with random weights")
        resolved = str(path.resolve())
    else:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model).to_dict()
        except Exception as exc:
            raise UsageError(f"cannot load model {model!r} from the hub ({type(exc).__name__}): check the id, the "
                             f"network and HF_TOKEN, or give a local directory") from None
        resolved = model
    weights = safetensors_weights_bytes(Path(resolved), config.get("text_config") or config) if looks_local else 0
    legacy = Path(resolved) / "hf_quant_config.json"  # ModelOpt <= 0.29 wrote its quantization here (vLLM reads it)
    if looks_local and "quantization_config" not in config and legacy.is_file():
        try:
            config = {**config, "quantization_config": json.loads(legacy.read_text(encoding="utf-8"))}
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # vLLM's own start reports it
    return model_info(config, resolved, 0 if dummy_weights else weights)


def safetensors_weights_bytes(path: Path, text_config: dict | None = None) -> int:
    """Bytes of the safetensors files vLLM loads from a local directory, each counted once, less the multi-token
    prediction layers of `text_config`'s model (`spec_layer_bytes`), which the base model does not load.

    As vLLM 0.32's DefaultModelLoader chooses them (`_prepare_weights`, load_format auto): a directory with
    `consolidated*.safetensors` is loaded in the Mistral format (those files, filtered by
    `consolidated.safetensors.index.json`), any other from `*.safetensors` filtered by
    `model.safetensors.index.json`. A repository that ships both forms is counted once, not twice."""
    consolidated = sorted(path.glob("consolidated*.safetensors"))
    if consolidated:
        files, index = consolidated, path / "consolidated.safetensors.index.json"
    else:
        files, index = sorted(path.glob("*.safetensors")), path / "model.safetensors.index.json"
    if index.is_file():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
            raise UsageError(f"{index} is not a safetensors index (no weight_map): fix or remove it") from None
        files = [f for f in files if f.name in named]
    return sum(f.stat().st_size for f in files) - (spec_layer_bytes(files, text_config) if text_config else 0)


def spec_layer_bytes(files: list[Path], text_config: dict) -> int:
    """Bytes of the tensors of a checkpoint's multi-token prediction layers (DeepSeek V3's and GLM-4.5's
    `num_nextn_predict_layers` past `num_hidden_layers`, Qwen3-Next's and Qwen3.5's `mtp.`, MiMo's
    `model.mtp_layers.` and MiMo-V2's `model.mtp.`), read from each file's safetensors header: vLLM's base model skips
    them (models/utils.py `skip_spec_layers`, the `mtp.` mappers of qwen3_next.py and qwen3_5.py, mimo.py,
    mimo_v2.py); only an MTP draft loads them. DeepSeek-V3's one layer holds ~11.5 GB of its 688: 1.4 GiB a GPU at
    TP=8. 0 where a header cannot be read."""
    base, extra = int(text_config.get("num_hidden_layers") or 0), int(text_config.get("num_nextn_predict_layers") or 0)
    named = text_config.get("mtp_num_hidden_layers") or str(text_config.get("model_type", "")).startswith(
        ("qwen3_next", "qwen3_5", "mimo"))
    if not extra and not named:
        return 0
    prefixes = tuple(f"{head}layers.{base + i}." for i in range(extra)
                     for head in ("model.", "", "model.language_model.")) + ("mtp.", "model.mtp_layers.", "model.mtp.")
    total = 0
    for f in files:
        try:
            with f.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size)) if 0 < size < 1 << 27 else {}
        except (OSError, ValueError):
            return 0
        total += sum(int(t["data_offsets"][1]) - int(t["data_offsets"][0]) for name, t in header.items()
                     if name.startswith(prefixes) and isinstance(t, dict) and "data_offsets" in t)
    return total


def model_info(config: dict, path: str, weights_bytes: int = 0) -> ModelInfo:
    """What a transformers `config.json` says; weights estimated from the architecture when `weights_bytes` is 0."""
    text_config = config.get("text_config") or config
    max_len, default_len = context_lengths(text_config)
    vocab = int(text_config.get("vocab_size") or 32000)
    hidden = int(text_config.get("hidden_size") or 0)
    heads = int(text_config.get("num_attention_heads") or 0)
    cached = cache_layers(text_config)
    layers = cached.attention
    kv_heads = kv_head_count(text_config)  # a NAS model's (block_configs) differ by layer: unchecked below
    head_dim = int(text_config.get("head_dim") or (hidden // heads if heads else 0))
    head_dim = 0 if "block_configs" in text_config else head_dim
    shapes = kv_shapes(text_config, kv_heads, head_dim)  # Gemma 4's full layers: their own shape
    kv_heads, head_dim = min(shapes, key=lambda shape: shape[0] * shape[1])
    latent = uses_mla(text_config, {})  # the architecture's own, whatever VLLM_MLA_DISABLE says
    mla = latent and mla_enabled(os.environ)  # as this process's environment runs it
    dtype = str(text_config.get("torch_dtype") or text_config.get("dtype") or "bfloat16").removeprefix("torch.")
    dtype_bytes = dtype_size(dtype)
    if dtype_bytes == 4:  # vLLM's dtype "auto" serves a float32 checkpoint in 16 bits (config/model.py
        dtype_bytes = 2  # _resolve_auto_dtype), its weights and KV cache alike; packed quantized weights stay as stored
        weights_bytes = weights_bytes if config.get("quantization_config") else weights_bytes // 2
    # estimated from the architecture, every expert of a mixture counted (config/weights.py); measured weights keep the
    # estimate's share of experts (by parameters where the quantization is one it does not know)
    known = weights_split(text_config, dtype_bytes, config.get("quantization_config"))
    known = None if layers_vary(text_config) else known  # a hybrid's layers: not estimated (layers_vary)
    share = known or weights_split(text_config, dtype_bytes, False)
    weights = weights_bytes or (known[0] if known else 0)
    experts = int(weights * share[1] / share[0]) if share and share[0] else 0
    rope, nope = int(text_config.get("qk_rope_head_dim") or 0), int(text_config.get("qk_nope_head_dim") or 0)
    switch: tuple[int, ...] = ()
    if latent and text_config.get("model_type") in MLA_SWITCHABLE and "compress_ratios" not in text_config \
            and "index_topk" not in text_config and rope and nope:
        # VLLM_MLA_DISABLE builds DeepseekV2Attention: K of rope + nope and V padded to it, for every attention head
        # (vllm/model_executor/models/deepseek_v2.py); a sparse model (index_topk) keeps its latent whatever it says
        switch = (int(text_config["kv_lora_rank"]) + rope, heads, rope + nope)
    # a dense MLP's width: Granite 4's dense models run a shared MLP of their own size, LFM2's adjusts it (unknown: 0),
    # some give a list a layer (0)
    mlp = text_config.get({"granitemoehybrid": "shared_intermediate_size", "lfm2": ""}.get(
        str(text_config.get("model_type")), "intermediate_size"))
    mlp = mlp if isinstance(mlp, int) and not expert_count(text_config) else 0
    indexer = 0
    if latent and "compress_ratios" in text_config:  # DeepSeek V4's compressed, sparse cache: not modelled, unchecked
        mla, kv_heads, head_dim = True, 1, 0
    elif latent and (mla or not switch):
        # vLLM caches one latent per token and layer, on every tensor-parallel rank alike (1 KV head)
        mla, kv_heads, head_dim = True, 1, int(text_config["kv_lora_rank"]) + rope
        indexer = indexer_bytes_per_token(text_config)
    elif switch:  # MLA turned off (VLLM_MLA_DISABLE in this process's environment)
        kv_heads, head_dim = switch[1], switch[2]
    return ModelInfo(path=path, vocab_size=vocab, max_len=max_len, num_layers=layers, num_kv_heads=kv_heads,
                     head_dim=head_dim, dtype_bytes=dtype_bytes, weights_bytes=int(weights), dtype=dtype, mla=mla,
                     expert_bytes=experts, indexer_bytes=indexer, mla_switch=switch, sliding_layers=cached.sliding,
                     sliding_window=cached.window, hidden_size=hidden, mlp_size=mlp, default_len=default_len,
                     kv_shapes=tuple(shapes) if len(shapes) > 1 else ())


def uses_mla(text_config: dict, env: Mapping[str, str] | None = None) -> bool:
    """Pure: whether vLLM 0.32 runs the model with multi-head latent attention, as its `is_deepseek_mla` and `use_mla`
    decide: a model type of its list with a `kv_lora_rank` (DeepSeek V4's sparse layout, `compress_ratios`: a
    `head_dim`), not a bidirectional variant, and VLLM_MLA_DISABLE unset or 0 (in this process's environment; a
    trial's `env:VLLM_MLA_DISABLE`: `ModelInfo.under_env`). Other models with a `kv_lora_rank` (MiniCPM3) run
    ordinary attention."""
    if text_config.get("model_type") not in MLA_MODEL_TYPES or text_config.get("is_causal", True) is False:
        return False
    if "compress_ratios" in text_config:
        if text_config.get("head_dim") is None:
            return False
    elif text_config.get("kv_lora_rank") is None:
        return False
    return mla_enabled(os.environ if env is None else env)


def mla_enabled(env: Mapping[str, str]) -> bool:
    """Pure: VLLM_MLA_DISABLE in `env` unset or 0."""
    try:  # as vllm/envs.py reads it: bool(int(...)); a value it cannot read stops vLLM's own start anyway
        return not int(env.get("VLLM_MLA_DISABLE", "0"))
    except ValueError:
        return True


def dtype_size(dtype: str) -> int:
    """Bytes per value of a torch dtype name (float32/float -> 4, the half types -> 2)."""
    return 4 if dtype.removeprefix("torch.") in FULL_DTYPES else 2
