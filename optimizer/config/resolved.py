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
    # one token's cache in one attention layer on a rank, as vLLM's KV cache spec class for it counts it (its
    # FullAttentionSpec or MLAAttentionSpec at one token a block: `page_size_bytes`); 0 for a cache with scales or
    # packing per token, which the attention backend sizes: the preflight then reads the model's config
    kv_bytes_per_layer: int = 0
    attention_layers: int = 0  # ModelConfig.get_num_layers_by_block_type(parallel_config, "attention")
