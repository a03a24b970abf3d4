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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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

    @property
    def weights_bytes(self) -> int:
        """Its bf16 weights: the tied embedding, each layer's attention, MLP and two norms, the final norm."""
        h, i = self.hidden_size, self.intermediate_size
        return 2 * (_DEMO_COMMON["vocab_size"] * h + self.num_layers * (4 * h * h + 3 * h * i + 2 * h) + h)


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

@dataclass(frozen=True)
class ModelInfo:
    """What the tool needs to know of a model before any engine starts, read from its `config.json` alone: the
    workload's vocabulary, the space's longest max_model_len, and the simulated engine's shape. A real engine's
    memory is vLLM's own reading of the model (engines/vllm_config.py), not this."""

    path: str
    vocab_size: int
    max_len: int  # the longest max_model_len of the space (search/runner.py asks vLLM what it accepts)
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    weights_bytes: int = 0  # of the checkpoint's files; 0 for random weights (vLLM counts them at the trial)
    dtype: str = "bfloat16"  # the checkpoint's (config.json torch_dtype)
    mla: bool = False  # multi-head latent attention, as vLLM resolves it (search/runner.py asks vLLM)
    hidden_size: int = 0
    mlp_size: int = 0  # a dense MLP's output width, at least (intermediate_size); 0 for a mixture, or unknown

    def served_as(self, dtype: str | None) -> ModelInfo:
        """The same model served in `dtype` (None or "auto": its own): weights and KV cache in that many bytes."""
        if not dtype or dtype == "auto":
            return self
        size = dtype_size(dtype)
        if not self.dtype_bytes:
            return replace(self, dtype_bytes=size, dtype=dtype)
        return replace(self, dtype_bytes=size, weights_bytes=self.weights_bytes * size // self.dtype_bytes,
                       dtype=dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token over all layers, every layer counted as full attention (the simulated
        engine's cache; 0 where the config does not say)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


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
    weights = safetensors_weights_bytes(Path(resolved)) if looks_local else 0
    return model_info(config, resolved, 0 if dummy_weights else weights)


def safetensors_weights_bytes(path: Path) -> int:
    """Bytes of the safetensors files in a local directory that vLLM's default loader reads (load_format auto): the
    `consolidated*.safetensors` of the Mistral format where present, else `*.safetensors`, each filtered by its index
    where it has one, so that a repository shipping both forms counts once."""
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
    return sum(f.stat().st_size for f in files)


LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def model_info(config: dict, path: str, weights_bytes: int = 0) -> ModelInfo:
    """What a transformers `config.json` says, read as a plain decoder: every layer attention with
    `num_key_value_heads` heads. The simulated engine's model; for a real engine's memory and lengths, vLLM's
    reading replaces it (engines/vllm_config.py)."""
    text_config = config.get("text_config") or config
    lengths = [text_config[k] for k in LEN_KEYS if isinstance(text_config.get(k), int) and text_config[k] > 0]
    hidden = int(text_config.get("hidden_size") or 0)
    heads = int(text_config.get("num_attention_heads") or 0)
    dtype = str(text_config.get("torch_dtype") or text_config.get("dtype") or "bfloat16").removeprefix("torch.")
    dtype_bytes = min(dtype_size(dtype), 2)  # vLLM's dtype "auto" serves a float32 checkpoint in 16 bits
    if dtype_size(dtype) == 4 and not config.get("quantization_config"):
        weights_bytes //= 2
    mlp = text_config.get("intermediate_size")
    return ModelInfo(path=path, vocab_size=int(text_config.get("vocab_size") or 32000),
                     max_len=min(lengths) if lengths else 2048,
                     num_layers=int(text_config.get("num_hidden_layers") or 0),
                     num_kv_heads=int(text_config.get("num_key_value_heads") or heads),
                     head_dim=int(text_config.get("head_dim") or (hidden // heads if heads else 0)),
                     dtype_bytes=dtype_bytes, weights_bytes=int(weights_bytes), dtype=dtype, hidden_size=hidden,
                     mlp_size=mlp if isinstance(mlp, int) and not any(k in text_config for k in EXPERT_KEYS) else 0)


def dtype_size(dtype: str) -> int:
    """Bytes per value of a torch dtype name (float32/float -> 4, the half types -> 2)."""
    return 4 if dtype.removeprefix("torch.") in FULL_DTYPES else 2
