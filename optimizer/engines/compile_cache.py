"""vLLM's compile cache kept per study, and an engine start split into loading, compiling and CUDA-graph capture.

On GPUs vLLM compiles the model (torch.compile) and captures CUDA graphs at every start, which takes minutes. Its
compile cache is keyed by a hash of the whole VllmConfig (vllm/compilation/backends.py: env, config, code and
compiler hashes), and the config's hash includes `max_num_seqs` and `max_num_batched_tokens`, so nearly every
trial compiles anew; what the cache saves is the second start of one config (the baseline's repeats, a trial
queued again after an interruption, `optimize verify`). It lives under `VLLM_CACHE_ROOT`; each study gets its own
(`studies/NAME.vllm_cache`) so that a study's starts are comparable and the cache goes with the study, unless the
user set VLLM_CACHE_ROOT.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

CACHE_ENV = "VLLM_CACHE_ROOT"

# vLLM 0.32's own log lines (vllm/v1/engine/core.py, vllm/v1/worker/gpu_model_runner.py,
# vllm/compilation/monitor.py and decorators.py)
_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"
                   r"(?: \(compilation: ([\d.]+) s)?")
_COMPILE = re.compile(r"torch\.compile (?:and initial profiling/warmup run together )?took ([\d.]+) s in total")
_CAPTURE = re.compile(r"Graph capturing finished in ([\d.]+) secs")
_LOAD = re.compile(r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds")


def cache_root(logs_dir: Path) -> Path:
    """The study's compile cache: beside its logs (`studies/NAME.logs` -> `studies/NAME.vllm_cache`)."""
    return logs_dir.with_name(logs_dir.name.removesuffix(".logs") + ".vllm_cache")


def cache_env(logs_dir: Path, device: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `env:` parameter that points a GPU trial's vLLM at the study's compile cache; {} on the CPU build
    (trials run eager: nothing compiled) or when the user chose VLLM_CACHE_ROOT."""
    environ = os.environ if environ is None else environ
    if device != "cuda" or CACHE_ENV in environ:
        return {}
    return {f"env:{CACHE_ENV}": str(cache_root(logs_dir).resolve())}


def start_phases(log_text: str) -> dict[str, float]:
    """Seconds of an engine start's phases that vLLM logged: `model_load_s`, `compile_s` (torch.compile, summed
    over compiled graphs), `cudagraph_capture_s`, `engine_init_s` (profiling, KV cache, warm-up, compile and capture
    together). A phase that did not happen (eager mode, the CPU build) is absent."""
    out: dict[str, float] = {}
    if m := _LOAD.search(log_text):
        out["model_load_s"] = float(m.group(1))
    init = _INIT.search(log_text)
    compiles = [float(x) for x in _COMPILE.findall(log_text)]
    if init and init.group(2):
        out["compile_s"] = float(init.group(2))
    elif compiles:
        out["compile_s"] = round(sum(compiles), 3)
    captures = [float(x) for x in _CAPTURE.findall(log_text)]
    if captures:
        out["cudagraph_capture_s"] = sum(captures)
    if init:
        out["engine_init_s"] = float(init.group(1))
    return out
