"""An open search space: any vLLM engine argument, and any environment variable vLLM reads (`env:NAME`).

A searched name that is not one of the default knobs (space.SEARCHABLE) is checked against the type of its
`EngineArgs` field before any trial runs: a range for an int or float field, choices of the field's type (bools,
a Literal's values, strings, lists for list fields). `env:VLLM_...` entries must be variables of `vllm.envs`; their
values go into the engine's environment, not its arguments. On CUDA the default space adds what GPU users tune
(`cuda_knobs`): async scheduling and the largest CUDA-graph capture size. Not the KV cache's dtype: fp8 changes
what the model computes (vLLM warns of an accuracy drop without calibrated scales), which a study driven by token
ids cannot see; a space that names `kv_cache_dtype: [auto, fp8]` searches it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

from optimizer.config.settings import Choice, FloatRange, IntRange
from optimizer.core.errors import UsageError

ENV_PREFIX = "env:"


def engine_field_types() -> dict[str, Any]:
    """EngineArgs' field name -> annotation (imports vLLM); {} when vLLM is not importable."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:
        return {}
    return {f.name: f.type for f in dataclasses.fields(EngineArgs)}


def vllm_env_names() -> set[str]:
    """The environment variables vLLM reads (vllm/envs.py); empty when vLLM is not importable."""
    try:
        from vllm import envs
    except Exception:
        return set()
    return set(envs.environment_variables)


def _without_none(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _accepts(kind: Any, value: Any) -> bool:
    """Does a value of the YAML's types fit one member of the field's annotation?"""
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return _is_int(value)
    if kind is float:
        return _is_int(value) or isinstance(value, float)
    if kind is str:
        return isinstance(value, str)
    if typing.get_origin(kind) is typing.Literal:
        return value in typing.get_args(kind)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return isinstance(value, str) and value in kind.__members__
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind) or (Any,)
        return isinstance(value, list) and all(item is Any or _accepts(item, v) for v in value)
    return False


def _describe(annotation: Any) -> str:
    return str(annotation).replace("typing.", "")


def field_problem(name: str, dist: Any, annotation: Any) -> str | None:
    """Why `dist` cannot be searched for the EngineArgs field `name` of type `annotation`; None when it can."""
    kinds = _without_none(annotation)
    if isinstance(dist, IntRange):
        if any(k in (int, float) for k in kinds):
            return None
        return f"{name!r} is {_describe(annotation)}: a min/max range needs an int or float field; give choices"
    if isinstance(dist, FloatRange):
        if float in kinds:
            return None
        return f"{name!r} is {_describe(annotation)}: a float range needs a float field"
    bad = [v for v in dist.choices if not any(_accepts(k, v) for k in kinds)]
    if bad:
        return f"{name!r} is {_describe(annotation)}: choice {bad[0]!r} is not of that type"
    return None


def check_open_space(ranges: dict[str, Any], searchable: tuple[str, ...]) -> None:
    """Every searched name beyond `searchable` is an EngineArgs field searched by its type, or a vLLM environment
    variable (`env:NAME`) with choices; a UsageError names the first that is not, and the fix."""
    extra = [n for n in ranges if n not in searchable]
    if not extra:
        return
    types = engine_field_types()
    env_names = vllm_env_names()
    for name in extra:
        dist = ranges[name]
        if name.startswith(ENV_PREFIX):
            var = name[len(ENV_PREFIX):]
            if env_names and var not in env_names:
                raise UsageError(f"search space: {var!r} is not an environment variable vLLM reads (vllm/envs.py): "
                                 f"check the name, e.g. env:VLLM_USE_FLASHINFER_SAMPLER")
            if not isinstance(dist, Choice):
                raise UsageError(f"search space: {name!r} takes choices (environment values), e.g. [\"0\", \"1\"]")
            continue
        if not types:
            raise UsageError(f"search space: {name!r} is not a default knob, and vLLM is not importable to check "
                             f"it against EngineArgs: install vLLM (./install.sh) or search only "
                             f"{', '.join(searchable)}")
        if name not in types:
            raise UsageError(f"search space: unknown parameter {name!r}: not an EngineArgs field of this vLLM (nor "
                             f"env:NAME); searchable are {', '.join(searchable)} and any EngineArgs field")
        problem = field_problem(name, dist, types[name])
        if problem:
            raise UsageError(f"search space: {problem}")


def split_env(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(engine arguments, environment variables) of a trial's parameters."""
    engine = {k: v for k, v in params.items() if not k.startswith(ENV_PREFIX)}
    env = {k[len(ENV_PREFIX):]: str(int(v) if isinstance(v, bool) else v)
           for k, v in params.items() if k.startswith(ENV_PREFIX)}
    return engine, env


def cuda_knobs() -> dict[str, Any]:
    """What GPU users tune beyond the scheduler: async scheduling and the largest CUDA-graph capture size (vLLM's
    default: min(2 x max_num_seqs, 512), 1024 on a Blackwell). The same choices on every host, so that a study
    resumed or shared by workers on other GPUs keeps its distributions (Optuna refuses a categorical whose choices
    change). Nothing that changes the model's outputs."""
    return {"async_scheduling": Choice(choices=[True, False]),
            "max_cudagraph_capture_size": Choice(choices=[128, 256, 512])}
