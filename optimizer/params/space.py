"""The search space: default ranges per device, user overrides from YAML, and vLLM's rules between parameters.

Known constraints are checked before any engine starts, so a combination vLLM would reject costs no start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optuna

from optimizer.config.settings import Choice, FloatRange, IntRange, SpaceSpec, build
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.errors import UsageError
from optimizer.params.open_space import ENV_PREFIX, check_open_space, cuda_knobs

Dist = IntRange | FloatRange | Choice

SEARCHABLE = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "max_model_len",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "block_size",
    "long_prefill_token_threshold",
    "dtype",  # not searched by default; on CPU `dtype: [bfloat16, float32]` in --space compares the two
)

# gpu_memory_utilization is capped below 0.95: the last few percent go out of memory under bursts.
_DEFAULTS: dict[str, dict[str, Dist]] = {
    "cuda": {  # holds what `vllm serve` runs by default on every GPU (optimizer/params/deploy.py): up to 1024 and 16384
        "max_num_seqs": IntRange(low=8, high=1024, log=True),
        "max_num_batched_tokens": IntRange(low=512, high=16384, log=True),
        "gpu_memory_utilization": FloatRange(low=0.70, high=0.94, step=0.02),
        "enable_chunked_prefill": Choice(choices=[True, False]),
        "enable_prefix_caching": Choice(choices=[True, False]),
        "block_size": Choice(choices=[16, 32]),
        "long_prefill_token_threshold": Choice(choices=[0, 256, 512, 1024, 2048]),
    },
    # On the CPU build the memory fraction is of the NUMA node's memory, and the KV cache of a small model
    # needs little of it; the scale of the other knobs is that of a 2-core machine. Every start touches the whole
    # KV cache (vLLM zeroes it): 3.3-3.9 s per GiB on the 2-core VMs measured, a third of an engine start at the
    # old range's 0.15-0.5, while no replay of the README's studies used over 6% of it (docs/machines.md).
    "cpu": {  # wide enough to hold vLLM's CPU defaults (128 sequences, 2048 tokens) and more on both sides
        "max_num_seqs": IntRange(low=2, high=256, log=True),
        "max_num_batched_tokens": IntRange(low=256, high=8192, log=True),
        "gpu_memory_utilization": FloatRange(low=0.1, high=0.3, step=0.05),
        "enable_chunked_prefill": Choice(choices=[True, False]),
        "enable_prefix_caching": Choice(choices=[True, False]),
        "block_size": Choice(choices=[32, 64, 128]),  # the CPU attention backend needs multiples of 32
        "long_prefill_token_threshold": Choice(choices=[0, 32, 64, 128, 256]),
    },
}


@dataclass(frozen=True)
class Space:
    """Resolved: what to sample and what is fixed, for one model, device and workload."""

    dists: dict[str, Dist]
    fixed: dict[str, Any]
    min_model_len: int

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Sample one parameter set (fixed values included).

        Conditional like vLLM itself: without chunked prefill a step must hold a whole prompt, so
        `max_num_batched_tokens` is not searched but set to `max(max_model_len, max_num_seqs)`, and
        `long_prefill_token_threshold` (a chunking knob) is left out.
        """
        params: dict[str, Any] = {}
        order = sorted(self.dists, key=lambda n: n not in ("max_model_len", "enable_chunked_prefill", "max_num_seqs"))
        for name in order:
            dist = self.dists[name]
            if self._chunking_off(params) and name in ("max_num_batched_tokens", "long_prefill_token_threshold"):
                continue
            if isinstance(dist, IntRange):
                step = 1 if dist.log else dist.step
                params[name] = trial.suggest_int(name, dist.low, dist.high, log=dist.log, step=step)
            elif isinstance(dist, FloatRange):
                value = trial.suggest_float(name, dist.low, dist.high, step=dist.step)
                params[name] = round(value, 6)
            else:
                params[name] = trial.suggest_categorical(name, dist.choices)
        params.update(self.fixed)
        if self._chunking_off(params) and "max_num_batched_tokens" not in self.fixed:
            model_len = params.get("max_model_len")
            if model_len is not None:
                params["max_num_batched_tokens"] = max(int(model_len), int(params.get("max_num_seqs", 1)))
        return params

    def _chunking_off(self, params: dict[str, Any]) -> bool:
        return {**params, **self.fixed}.get("enable_chunked_prefill") is False

    def violations(self, params: dict[str, Any]) -> list[str]:
        """vLLM's rules between parameters that `params` breaks, each with the fix."""
        return check_constraints(params, self.min_model_len)


def check_constraints(params: dict[str, Any], min_model_len: int) -> list[str]:
    """Rules vLLM enforces at start (and one of ours), as messages. Missing keys are vLLM defaults: unchecked."""
    out = []
    seqs, tokens = params.get("max_num_seqs"), params.get("max_num_batched_tokens")
    model_len = params.get("max_model_len")
    if seqs is not None and tokens is not None and tokens < seqs:
        out.append(f"max_num_batched_tokens ({tokens}) must be >= max_num_seqs ({seqs})")
    if params.get("enable_chunked_prefill") is False and tokens is not None and model_len is not None \
            and tokens < model_len:
        out.append(f"without chunked prefill, max_num_batched_tokens ({tokens}) must be >= max_model_len "
                   f"({model_len})")
    if model_len is not None and model_len < min_model_len:
        out.append(f"max_model_len ({model_len}) is below the workload's longest request ({min_model_len})")
    mem = params.get("gpu_memory_utilization")
    if mem is not None and not 0 < mem <= 1:
        out.append(f"gpu_memory_utilization ({mem}) must be in (0, 1]")
    return out


def parse_space_yaml(data: dict[str, Any]) -> SpaceSpec:
    """`{name: {min, max[, log, step]} | [choices] | value}` -> SpaceSpec. Names are checked in `resolve`."""
    ranges: dict[str, Dist] = {}
    fixed: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, dict):
            if set(value) - {"min", "max", "log", "step"} or not {"min", "max"} <= set(value):
                raise UsageError(f"search space: {name!r} needs 'min' and 'max' (optional 'log', 'step'), "
                                 f"got keys {sorted(value)}")
            low, high = value["min"], value["max"]
            is_int = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high))
            fields = {"low": low, "high": high, **{k: value[k] for k in ("log", "step") if k in value}}
            ranges[name] = build(IntRange if is_int else FloatRange, fields, f"search space range {name!r}")
        elif isinstance(value, list):
            if not value:
                raise UsageError(f"search space: {name!r} has an empty list of choices")
            ranges[name] = Choice(choices=value)
        else:
            fixed[name] = value
    return SpaceSpec(ranges=ranges, fixed=fixed)


def resolve(spec: SpaceSpec, device: str, model_max_len: int, workload: WorkloadSpec, mla: bool = False,
            engine_args: dict[str, Any] | None = None) -> Space:
    """Defaults for `device`, overridden by the user's ranges and fixed values. A model with multi-head latent
    attention (`mla`) leaves `block_size` to vLLM: its MLA kernels each take their own (FlashMLA 64, CUTLASS MLA
    128, FlashInfer MLA 32 or 64, the CPU's 16), and a size set by hand turns away the ones that do not take it.
    With `enforce_eager` fixed (in the study's `engine_args` or the space), no CUDA graph is captured: vLLM sets
    `max_cudagraph_capture_size` to 0 (vllm/config/vllm.py), and a search of it would only spend trials."""
    known_engine_args = _engine_arg_names()
    for name in spec.fixed:
        if name not in SEARCHABLE and name not in known_engine_args and not name.startswith(ENV_PREFIX):
            raise UsageError(f"search space: unknown parameter {name!r}; searchable are {', '.join(SEARCHABLE)}"
                             f" and any vLLM engine argument (or env:NAME for vLLM's environment variables)")
    check_open_space(spec.ranges, SEARCHABLE)  # any EngineArgs field, by its type (optimizer/params/open_space.py)
    need = workload.max_total_len
    if need > model_max_len:
        raise UsageError(f"the workload's longest request ({need} tokens, prompt + output) exceeds the model's "
                         f"context of {model_max_len} tokens: lower --input-len/--output-len or drop long trace rows")
    dists: dict[str, Dist] = dict(_DEFAULTS[device])
    if mla:
        dists.pop("block_size")
    if device == "cuda":
        dists.update(cuda_knobs())
        if {**(engine_args or {}), **spec.fixed}.get("enforce_eager"):
            dists.pop("max_cudagraph_capture_size")
    if model_max_len > need:
        dists["max_model_len"] = IntRange(low=need, high=model_max_len, log=True)
    fixed: dict[str, Any] = {} if "max_model_len" in dists else {"max_model_len": model_max_len}
    dists.update(spec.ranges)
    for name in spec.fixed:
        dists.pop(name, None)
    fixed.update(spec.fixed)
    if isinstance(dists.get("max_model_len"), IntRange) and dists["max_model_len"].low < need:
        raise UsageError(f"search space: max_model_len min {dists['max_model_len'].low} is below the workload's "
                         f"longest request ({need} tokens): raise it to at least {need}")
    mem = dists.get("gpu_memory_utilization")
    if isinstance(mem, FloatRange) and not (0 < mem.low and mem.high <= 1):
        raise UsageError("search space: gpu_memory_utilization must lie in (0, 1]")
    return Space(dists=dists, fixed=fixed, min_model_len=need)


def _engine_arg_names() -> set[str]:
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        return {f.name for f in dataclasses.fields(EngineArgs)}
    except Exception:  # vLLM not importable: only the searchable names are known
        return set()


def distance_to_default(params: dict[str, Any], default: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Parameters whose value differs from `default`: name -> (default, value)."""
    out = {}
    for name in SEARCHABLE:
        if name in params and name in default and params[name] != default[name]:
            a, b = default[name], params[name]
            if isinstance(a, float) and isinstance(b, float) and math.isclose(a, b):
                continue
            out[name] = (a, b)
    return out
