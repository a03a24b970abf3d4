"""Which layers keep a per-token KV cache (optimizer/config/layers.py), read from published config.json fields, and
what one sequence of max_model_len then needs, as vLLM 0.32 checks it at start: a sliding layer keeps its window on
GPUs (the hybrid KV cache manager) and wherever every layer slides, every token on the CPU build otherwise; a hybrid
model's state layers keep nothing per token. Counting every layer as full attention rejected vLLM's own defaults for
Gemma 3 on an H100."""

import pytest

from optimizer.config.layers import CacheLayers, cache_layers
from optimizer.config.model import model_info
from optimizer.params.parallel import batches_in_flight, per_gpu
from optimizer.params.preflight import GIB, DeviceMemory, estimate, memory_problems, with_batch_default

GEMMA3_27B = {  # google/gemma-3-27b-it config.json: its text_config, the fields read
    "architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
    "text_config": {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
                    "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                    "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
                    "max_position_embeddings": 131072}}
GPT_OSS_120B = {"model_type": "gpt_oss", "num_hidden_layers": 36, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18, "num_key_value_heads": 8, "head_dim": 64}
QWEN25_7B = {"model_type": "qwen2", "num_hidden_layers": 28, "sliding_window": 131072, "use_sliding_window": False,
             "max_window_layers": 28}
MISTRAL_7B_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "sliding_window": 4096}
JAMBA = {"model_type": "jamba", "num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4,
         "mamba_d_state": 16}
NEMOTRON_H = {"model_type": "nemotron_h", "num_hidden_layers": 58,  # the form of Nemotron-H's pattern, not a copy
              "hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-M-M-M-"}
QWEN3_NEXT = {"model_type": "qwen3_next", "num_hidden_layers": 48,
              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12}


def test_layers_by_their_families_keys():
    # Gemma 3 without layer_types: one full layer in six, as transformers' Gemma3Config builds them
    assert cache_layers(GEMMA3_27B["text_config"]) == CacheLayers(62, 52, 1024)
    assert cache_layers(GPT_OSS_120B) == CacheLayers(36, 18, 128)
    assert cache_layers(QWEN25_7B) == CacheLayers(28)  # a window it does not use
    assert cache_layers(MISTRAL_7B_V01) == CacheLayers(32, 32, 4096)  # a model-wide window: every layer
    assert cache_layers({**MISTRAL_7B_V01, "sliding_window": None}) == CacheLayers(32)
    assert cache_layers(JAMBA) == CacheLayers(4)  # layers 4, 12, 20, 28 attend; the rest are Mamba
    assert cache_layers(NEMOTRON_H) == CacheLayers(4)  # its "*" layers attend
    assert cache_layers(QWEN3_NEXT) == CacheLayers(12)  # one full attention layer in four
    assert cache_layers({"model_type": "mamba", "num_hidden_layers": 64}) == CacheLayers(0)
    # Kimi Linear: its KDA layers numbered from 1, MLA in the rest (the form of Kimi-Linear-48B-A3B's config: 7 of
    # 27); counting all 27 would reject a context vLLM serves
    kda = [i for i in range(1, 28) if i % 4 and i != 27]
    kimi = {"model_type": "kimi_linear", "num_hidden_layers": 27, "kv_lora_rank": 512,
            "linear_attn_config": {"kda_layers": kda, "full_attn_layers": [4, 8, 12, 16, 20, 24, 27]}}
    assert cache_layers(kimi) == CacheLayers(7)
    assert model_info({**kimi, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}, "k").kv_bytes_per_token == 7 * 576 * 2
    assert cache_layers({**kimi, "linear_attn_config": {"kda_layers": [], "full_attn_layers": []}}) == CacheLayers(27)
    # transformers' spellings and defaults where config.json leaves a key out
    assert cache_layers({"model_type": "nemotron_h", "num_hidden_layers": 4,
                         "layers_block_type": ["linear_attention", "full_attention", "mlp", "linear_attention"]}) \
        == CacheLayers(1)
    assert cache_layers({"model_type": "zamba2", "num_hidden_layers": 6,
                         "layers_block_type": ["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid"]}) \
        == CacheLayers(2)  # a shared attention block in each "hybrid" layer
    assert cache_layers({"model_type": "jamba", "num_hidden_layers": 32, "mamba_d_state": 16}) == CacheLayers(4)
    assert cache_layers({"model_type": "qwen3_next", "num_hidden_layers": 48, "linear_num_key_heads": 16}) == \
        CacheLayers(12)  # full_attention_interval 4
    assert cache_layers({"model_type": "falcon_h1", "num_hidden_layers": 44, "mamba_d_state": 256}) == \
        CacheLayers(44)  # attention beside the Mamba mixer in every layer
    assert cache_layers({"model_type": "lfm2", "num_hidden_layers": 16, "conv_L_cache": 3,
                         "full_attn_idxs": [2, 5, 8, 10, 12, 14]}) == CacheLayers(6)
    # a hybrid whose attention layers it cannot read: none counted (unchecked), never all of them
    assert cache_layers({"model_type": "new_hybrid", "num_hidden_layers": 40, "ssm_state_size": 128}) == CacheLayers(0)
    assert cache_layers({"model_type": "llama", "num_hidden_layers": 80}) == CacheLayers(80)
    # Cohere 2 (Command R7B): one full layer in four, as Gemma's rule with its own pattern
    assert cache_layers({"model_type": "cohere2", "num_hidden_layers": 32, "sliding_window": 4096,
                         "sliding_window_pattern": 4}) == CacheLayers(32, 24, 4096)
    # a sparse model's layer_types (transformers 5 writes them for DeepSeek V3.2): attention that caches every token
    assert cache_layers({"num_hidden_layers": 61, "layer_types": ["indexed_attention"] * 61}) == CacheLayers(61)
    every = cache_layers({**QWEN25_7B, "use_sliding_window": True, "max_window_layers": 0})
    assert every == CacheLayers(28, 28, 131072)  # sliding from layer 0 on
    # without max_window_layers, transformers' default: from layer 28 on
    assert cache_layers({"model_type": "qwen2", "num_hidden_layers": 36, "sliding_window": 4096,
                         "use_sliding_window": True}) == CacheLayers(36, 8, 4096)


def test_a_sliding_layer_keeps_its_window_and_the_tokens_in_flight():
    gpt = model_info(GPT_OSS_120B, "gpt-oss")
    per_layer = 2 * 8 * 64 * 2
    assert gpt.kv_bytes_per_token == 36 * per_layer
    # vLLM's SlidingWindowSpec: window - 1 + max_num_batched_tokens of a sequence, at most max_model_len
    assert gpt.kv_bytes_one_sequence(131072, 8192) == 18 * per_layer * 131072 + 18 * per_layer * (127 + 8192)
    assert gpt.kv_bytes_one_sequence(4096, 8192) == 36 * per_layer * 4096  # the window and more: every token
    assert gpt.kv_bytes_one_sequence(131072, 8192, windows_kept=False) == 36 * per_layer * 131072


def test_the_batches_in_flight_as_vllm_counts_them():
    """vLLM 0.32's VllmConfig.max_concurrent_batches, whose batches' tokens a sliding layer keeps beside its window:
    async scheduling (on unless the config says otherwise) keeps the pipeline's stages + 1 in flight on the V2 model
    runner (the default where Triton is), 2 on the V1 runner without a pipeline; the CPU build turns it off."""
    v1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert batches_in_flight({}, "cuda", {}) == 2
    assert batches_in_flight({"async_scheduling": False}, "cuda", {}) == 1
    assert batches_in_flight({"pipeline_parallel_size": 4}, "cuda", {}) == 5
    assert batches_in_flight({}, "cuda", v1) == 2
    assert batches_in_flight({"pipeline_parallel_size": 4}, "cuda", v1) == 4  # V1 turns async off with a pipeline
    assert batches_in_flight({"distributed_executor_backend": "ray"}, "cuda", {}) == 2  # Ray's V2 executor has it
    assert batches_in_flight({}, "cpu", {}) == 1
    assert batches_in_flight({"speculative_config": {"method": "ngram"}}, "cuda", {}) == 1  # lenient
    assert batches_in_flight({"pipeline_parallel_size": 2, "async_scheduling": True}, "cpu", {}) == 2


def test_vllm_s_token_budget_where_the_config_leaves_it_to_vllm():
    """vLLM 0.32's get_batch_defaults for `vllm serve` (params/deploy.py): 8192 tokens on an H100, 2048 on an A100 of
    the same memory; a config's own value stays, and with chunked prefill off none is filled in (vLLM takes at least
    max_model_len then: left uncounted, the lenient side)."""
    h100, a100 = int(79.6 * GIB), int(79.2 * GIB)

    def tokens(params, deploy_as, device, memory, name=""):
        return with_batch_default(params, deploy_as, device, memory, name).get("max_num_batched_tokens")

    assert tokens({}, "serve", "cuda", h100, "NVIDIA H100 80GB HBM3") == 8192
    assert tokens({}, "serve", "cuda", a100, "NVIDIA A100-SXM4-80GB") == 2048
    assert tokens({}, "llm", "cuda", h100, "NVIDIA H100 80GB HBM3") == 16384
    assert with_batch_default({"max_num_batched_tokens": 512, "max_num_seqs": 64}, "serve", "cuda", h100) == \
        {"max_num_batched_tokens": 512, "max_num_seqs": 64}
    assert with_batch_default({"enable_chunked_prefill": False}, "serve", "cuda", h100) == \
        {"enable_chunked_prefill": False, "max_num_seqs": 1024}
    assert with_batch_default({}, "serve", "cpu", 64 * GIB) == {"max_num_seqs": 128, "max_num_batched_tokens": 2048}
    # vLLM's own bounds on its defaults (_set_default_max_num_seqs_and_batched_tokens_args): sequences at most the
    # token budget, a token budget at most the sequences x max_model_len (the config's, else the model's), 256 tokens
    # for a batched data-parallel mixture, both doubled in throughput mode
    assert with_batch_default({"max_num_batched_tokens": 512}, "serve", "cuda", h100)["max_num_seqs"] == 512
    assert tokens({"max_num_seqs": 4, "max_model_len": 1024}, "serve", "cuda", h100) == 4096
    assert with_batch_default({"max_num_seqs": 4}, "serve", "cuda", h100, "", 1024)["max_num_batched_tokens"] == 4096
    deepep = with_batch_default({"all2all_backend": "deepep_low_latency", "enable_expert_parallel": True,
                                 "data_parallel_size": 2}, "serve", "cuda", h100)
    assert (deepep["max_num_seqs"], deepep["max_num_batched_tokens"]) == (256, 256)
    fast = with_batch_default({"performance_mode": "throughput"}, "serve", "cuda", h100, "NVIDIA H100 80GB HBM3")
    assert (fast["max_num_seqs"], fast["max_num_batched_tokens"]) == (2048, 16384)
    # the CPU build's defaults scale with its tensor x pipeline parallel ranks (get_batch_defaults' world_size)
    assert tokens({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "serve", "cpu", 64 * GIB) == 4 * 2048


def test_a_model_whose_every_layer_slides_keeps_its_windows_on_the_cpu_build_too():
    """Its specs are uniform: vLLM has nothing to promote to full attention (kv_cache_utils), hybrid manager or not."""
    mistral = model_info({**MISTRAL_7B_V01, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                          "max_position_embeddings": 32768}, "mistral", weights_bytes=14 * GIB)
    cpu = DeviceMemory(total_bytes=64 * GIB, available_bytes=60 * GIB)
    est = estimate({"max_model_len": 32768, "max_num_batched_tokens": 2048}, mistral, "cpu", cpu, 1000)
    assert est.kv_one_sequence_bytes == 32 * (2 * 8 * 128 * 2) * (4095 + 2048)  # not every one of 32768 tokens
    off = estimate({"max_model_len": 32768, "disable_sliding_window": True}, mistral, "cpu", cpu, 1000)
    assert off.kv_one_sequence_bytes == mistral.kv_bytes_per_token * 32768


def test_vllm_s_defaults_for_gemma3_27b_fit_an_h100_and_not_the_cpu_build_s_cache():
    """The helper's case from vLLM 0.32's code: 62 layers, 52 of them with a 1024-token window; at 131k tokens and
    0.92 of an H100, one sequence needs about 17 GiB on the GPU (10 full layers, 52 windows and two batches of 8192
    tokens in flight under async scheduling; 14 without it), 62 GiB as full attention, with ~21 GiB left for the cache
    beside 51 GiB of weights."""
    gemma = model_info(GEMMA3_27B, "google/gemma-3-27b-it", weights_bytes=int(54.9e9))
    h100 = DeviceMemory(total_bytes=int(79.6 * GIB), available_bytes=int(79 * GIB))
    defaults = {"max_model_len": 131072, "max_num_batched_tokens": 8192}
    on_gpu = estimate(defaults, gemma, "cuda", h100, 1000)
    assert memory_problems(on_gpu) == [] and 16 * GIB < on_gpu.kv_one_sequence_bytes < 18 * GIB
    in_turn = estimate({**defaults, "async_scheduling": False}, gemma, "cuda", h100, 1000)
    assert 13 * GIB < in_turn.kv_one_sequence_bytes < 15 * GIB
    assert on_gpu.kv_one_sequence_bytes - in_turn.kv_one_sequence_bytes == 52 * (2 * 16 * 128 * 2) * 8192
    # left to vLLM, the token budget is the one `vllm serve` gets on an H100 (params/deploy.py): the same 8192
    unset = estimate(with_batch_default({"max_model_len": 131072}, "serve", "cuda", h100.total_bytes,
                                        "NVIDIA H100 80GB HBM3"), gemma, "cuda", h100, 1000)
    assert unset.kv_one_sequence_bytes == on_gpu.kv_one_sequence_bytes
    # and its 1024 sequences: the V2 sampler's counts of 262,208 tokens each (1.0 GiB) and two bitmasks, beside the
    # profile run's logits of 1024 rows (0.59 GiB, more than the MLP's peak over 8192 tokens): 1.66 GiB of runtime,
    # still room for the sequence
    logits = 2 * (8192 + 1024) * 5376 + 2 * 1024 * 262208
    assert logits > 2 * 8192 * (5376 + 21504)
    assert unset.reserve_bytes == 4 * 1024 * 262208 + 2 * 4 * 1024 * 8194 + logits
    assert memory_problems(unset) == []
    full = estimate({**defaults, "disable_hybrid_kv_cache_manager": True}, gemma, "cuda", h100, 1000)
    assert full.kv_one_sequence_bytes == gemma.kv_bytes_per_token * 131072  # ~62 GiB: every layer as full attention
    assert "one max_model_len sequence needs" in memory_problems(full)[0]
    big_cpu = DeviceMemory(total_bytes=512 * GIB, available_bytes=500 * GIB)  # the CPU build: no hybrid manager
    assert estimate(defaults, gemma, "cpu", big_cpu, 1000).kv_one_sequence_bytes == gemma.kv_bytes_per_token * 131072


def test_kv_cache_memory_bytes_is_the_cache_whatever_the_fraction():
    """vLLM's kv_cache_memory_bytes takes the place of the profiled budget (gpu_worker.py): a fraction too small for
    the weights does not stop it."""
    llama = model_info({"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "hidden_size": 4096, "max_position_embeddings": 8192}, "m",
                       weights_bytes=16 * GIB)
    h100 = DeviceMemory(total_bytes=80 * GIB, available_bytes=79 * GIB)
    low = {"gpu_memory_utilization": 0.15, "max_model_len": 8192}
    assert "leave no room for the KV cache" in memory_problems(estimate(low, llama, "cuda", h100, 1000))[0]
    fixed = estimate({**low, "kv_cache_memory_bytes": 8 * GIB}, llama, "cuda", h100, 1000)
    assert fixed.kv_budget_bytes == 8 * GIB and memory_problems(fixed) == []
    assert estimate({**low, "kv_cache_memory_bytes": 8.0e9}, llama, "cuda", h100, 1000).kv_budget_bytes == 8_000_000_000


@pytest.mark.parametrize("config", [GPT_OSS_120B, JAMBA])
def test_pipeline_ranks_split_the_sliding_layers_too(config):
    info = model_info({**config, "num_attention_heads": 8, "hidden_size": 512}, "m")
    half = per_gpu(info, {"pipeline_parallel_size": 2})
    assert half.num_layers == -(-info.num_layers // 2) and half.sliding_layers <= half.num_layers
    assert half.sliding_layers == -(-info.sliding_layers // 2)


def test_the_mlp_width_the_gpu_reserve_counts():
    """intermediate_size where it is a dense MLP's output (gpu_reserve_bytes counts it beside the residual); Granite 4's
    dense models run a shared MLP of shared_intermediate_size; LFM2 adjusts its own, a mixture's is not counted: 0."""
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_hidden_layers": 32}
    assert model_info(llama, "l").mlp_size == 14336 and model_info(llama, "l").hidden_size == 4096
    granite = {**llama, "model_type": "granitemoehybrid", "shared_intermediate_size": 8192, "num_local_experts": 0}
    assert model_info(granite, "g").mlp_size == 8192
    assert model_info({**llama, "model_type": "lfm2"}, "f").mlp_size == 0
    assert model_info({**llama, "num_local_experts": 8}, "m").mlp_size == 0  # Mixtral's experts
    assert model_info({**llama, "intermediate_size": [8192, 16384]}, "o").mlp_size == 0  # a width a layer


def test_gemma_4_s_full_layers_and_the_layers_that_share_their_cache():
    """Gemma 4's full-attention layers cache num_global_key_value_heads x global_head_dim (vLLM's per_layer_config; the
    form of Gemma-4-31B's config: 4 x 512 where its sliding layers keep 16 x 256): every layer counts at the smaller
    shape. The last num_kv_shared_layers (Gemma 3n, Gemma 4 E2B/E4B) keep no cache of their own."""
    gemma4 = {"model_type": "gemma4_text", "num_hidden_layers": 60, "num_attention_heads": 32,
              "num_key_value_heads": 16, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
              "attention_k_eq_v": True, "sliding_window": 1024, "hidden_size": 5376, "max_position_embeddings": 262144,
              "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10}
    info = model_info(gemma4, "google/gemma-4-31b")
    assert (info.num_kv_heads, info.head_dim) == (4, 512) and info.kv_bytes_per_token == 60 * 2 * 4 * 512 * 2
    assert cache_layers(gemma4) == CacheLayers(60, 50, 1024)
    no_override = model_info({**gemma4, "attention_k_eq_v": False}, "m")  # full layers: the model's own 16 heads
    assert (no_override.num_kv_heads, no_override.head_dim) == (16, 256)  # 16 x 256 < 16 x 512
    shared = {**gemma4, "num_kv_shared_layers": 20}
    assert cache_layers(shared) == CacheLayers(40, 40, 1024)  # the 10 full layers go first, then 10 sliding ones
    assert model_info({**GEMMA3_27B["text_config"], "num_kv_shared_layers": 5}, "m").num_layers == 57
    assert cache_layers({"model_type": "gemma3n_text", "num_hidden_layers": 35}).attention == 20  # transformers' 15
    # per rank, the smallest shape a rank keeps: at TP=16 the sliding layers' 16 heads split to 1 x 256, under the
    # full layers' 4 heads replicated to 1 x 512
    rank = per_gpu(info, {"tensor_parallel_size": 16})
    assert (rank.num_kv_heads, rank.head_dim) == (1, 256)
    two = per_gpu(info, {"tensor_parallel_size": 2})
    assert (two.num_kv_heads, two.head_dim) == (2, 512)  # 2 x 512 < 8 x 256
    # a config.json transformers 5 saved: the overrides in per_layer_config, not the global keys
    saved = {k: v for k, v in gemma4.items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    saved["per_layer_config"] = {"5": {"head_dim": 512, "num_key_value_heads": 4}}
    assert (model_info(saved, "m").num_kv_heads, model_info(saved, "m").head_dim) == (4, 512)
    # a bidirectional Gemma's window is halved as transformers loads it, and vLLM runs that one
    assert cache_layers({**gemma4, "use_bidirectional_attention": "all"}).window == 513
