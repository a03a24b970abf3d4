"""The one module that reads vLLM's own config for the preflight: the `VllmConfig` that the installed vLLM builds for
a trial's engine arguments (`EngineArgs.create_engine_config`, the call its engine start makes first), read into a
`Resolved` (config/resolved.py). Nothing here derives a value vLLM already resolves: its max_model_len, its batch
defaults for this device and deployment, the tokens in flight, MLA under the trial's environment."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from optimizer.config.resolved import Resolved


@contextmanager
def trial_environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with the trial's `env:` parameters set (vLLM reads VLLM_MLA_DISABLE and
    VLLM_USE_V2_MODEL_RUNNER while it builds its config), as it was afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def resolved(vllm_config: Any) -> Resolved:
    """The preflight's numbers, read from vLLM's config for the trial."""
    model, scheduler, cache = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
    return Resolved(max_model_len=int(model.max_model_len), max_num_seqs=int(scheduler.max_num_seqs),
                    max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
                    max_in_flight_tokens=int(vllm_config.max_in_flight_tokens), use_mla=bool(model.use_mla),
                    kv_cache_dtype=str(cache.cache_dtype))
