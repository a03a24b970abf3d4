"""The embedded default a study runs when no --model is given, chosen by the device it runs on (`demo_for`, pure).

- cpu: the CPU demo (config/model.py, DEMO_LADDER): a small Llama generated locally with random weights, its shape
  chosen by a probe of the machine, and chat traffic scaled down so that a 2-core CPU serves a few requests a second
  (a preset's `cpu_demo` scale).
- cuda: the GPU demo (GPU_DEMO_NAME): Llama-3.2-1B's published config.json with vLLM's dummy weights, and chat
  traffic at a GPU's scale: the chat preset's lengths (prompts 16-2048 tokens, mean 400; answers 16-1024, mean 250)
  and GPU_DEMO_REQUESTS requests a probe at most, since on a GPU an engine's start costs a minute or more and its
  requests little beside it (docs/gpu.md).

An embedded model named with --model keeps its own scale on either device; workload fields given explicitly (a
preset among them) win over the default's. `embedded_model` makes an embedded model's directory.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimizer.config.model import (DEFAULT_MODEL_NAME, DEMO_LADDER, GPU_DEMO_NAME, cache_dir, default_model,
                                    word_tokenizer)
from optimizer.config.presets import demo_workload, get
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD
from optimizer.core.errors import UsageError

CUDA = "cuda"
# Llama-3.2-1B's published config.json (1.24B parameters: 16 layers, 32 heads, 8 KV heads, vocabulary 128256, llama3
# RoPE scaling, tied embeddings), shipped in the package
GPU_DEMO_CONFIG = Path(__file__).parent / "embedded" / GPU_DEMO_NAME / "config.json"
EMBEDDED_MODELS = (*(shape.name for shape in DEMO_LADDER), GPU_DEMO_NAME)
GPU_DEMO_PRESET = "chat"
GPU_DEMO_REQUESTS = 2000


@dataclass(frozen=True)
class Demo:
    """An embedded default: its model, whether vLLM fills its weights with random values (load_format=dummy),
    whether a probe of the machine picks its shape, and its workload's fields."""

    model: str
    dummy_weights: bool
    probe: bool
    workload: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """Its StudyConfig fields; `dummy_weights` only where set, so that a --dummy-weights given stays."""
        return {"model": self.model, "model_is_default": True, "demo_probe": self.probe, "workload": self.workload,
                **({"dummy_weights": True} if self.dummy_weights else {})}


def demo_for(device: str, workload: Mapping[str, Any] | None = None, model: str | None = None) -> Demo:
    """Pure: the embedded default on `device` (the GPU demo on cuda, the CPU demo elsewhere), or the embedded model
    `model` where one is named, with the explicitly given `workload` fields over its own scale."""
    given = dict(workload or {})
    if model is not None and model not in EMBEDDED_MODELS:
        raise UsageError(f"no embedded model {model!r}: the embedded ones are {', '.join(EMBEDDED_MODELS)}")
    name = model or (GPU_DEMO_NAME if device == CUDA else DEFAULT_MODEL_NAME)
    if name == GPU_DEMO_NAME:
        base = get(given.get("preset") or GPU_DEMO_PRESET).fields
        return Demo(name, dummy_weights=True, probe=False,
                    workload={**base, "num_requests": GPU_DEMO_REQUESTS, **given})
    return Demo(name, dummy_weights=False, probe=model is None, workload=demo_workload(given, CPU_DEMO_WORKLOAD))


def embedded_model(name: str) -> Path:
    """The directory of the embedded model `name`, made on first use: a CPU demo shape with its seeded random weights
    (config/model.py), or the GPU demo's shipped config.json beside a word tokenizer for `vllm serve` to detokenize
    with (no weights: vLLM's dummy ones)."""
    if name != GPU_DEMO_NAME:
        return default_model(name)
    target = cache_dir() / "models" / GPU_DEMO_NAME
    shipped = GPU_DEMO_CONFIG.read_text(encoding="utf-8")
    if _made(target, shipped):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=target.parent))
    try:  # written beside it and renamed: a reader never sees half of it
        (tmp / "config.json").write_text(shipped, encoding="utf-8")
        word_tokenizer(int(json.loads(shipped)["vocab_size"])).save_pretrained(tmp)
        if not _made(target, shipped):  # else another process finished first
            shutil.rmtree(target, ignore_errors=True)  # made from another version of the shipped config
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _made(target: Path, shipped: str) -> bool:
    config = target / "config.json"
    return (target / "tokenizer.json").is_file() and config.is_file() and config.read_text(encoding="utf-8") == shipped
