"""What the installed vLLM resolves for one trial's engine arguments before anything loads: the numbers the memory
preflight (params/preflight.py) takes from vLLM itself rather than working them out again. Built by
engines/vllm_config.py from the `VllmConfig` that vLLM's own `EngineArgs.create_engine_config` makes for the trial."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resolved:
    """One trial's config as vLLM resolves it (`VllmConfig`), for the preflight."""

    max_model_len: int  # ModelConfig.max_model_len: vLLM's derivation from the model's config and the arguments (-1:
    # vLLM fits it to the memory at start)
    max_num_seqs: int  # SchedulerConfig: vLLM's default for this device and deployment where left to it
    max_num_batched_tokens: int
    max_in_flight_tokens: int  # VllmConfig.max_in_flight_tokens: the tokens a sliding window keeps beside itself
    use_mla: bool  # ModelConfig.use_mla, under the trial's environment (VLLM_MLA_DISABLE)
    kv_cache_dtype: str  # CacheConfig.cache_dtype ("auto": the model's dtype)
    # one rank's model as vLLM builds it (engines/vllm_config.py::rank_model); 0 where it could not be built
    kv_bytes_one_sequence: int = 0  # the KV cache of one max_model_len sequence, as vLLM's start checks it
    kv_bytes_per_token: int = 0  # of it, a token's share (state kept per sequence, as Mamba's, spread over its tokens)
    weights_bytes: int = 0  # its parameters and buffers
