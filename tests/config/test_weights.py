"""A model's weights estimated from its config.json (a hub id, or --dummy-weights): every expert of a mixture counted,
as vLLM holds them all, and quantized checkpoints at their stored width. Read as a dense model, Mixtral-8x7B looked
like 13 GiB and fit one 80 GiB GPU; it holds 87."""

import json

import pytest

from optimizer.config.model import inspect_model, model_info
from optimizer.config.weights import (
    MXFP4_BITS, NVFP4_BITS, attention_params, mixture_layers, quantized_bits, weights_split,
)
from optimizer.params.accuracy import accuracy_line
from optimizer.params.parallel import per_gpu
from optimizer.params.preflight import GIB, DeviceMemory, estimate, memory_problems


def estimated_weights_bytes(cfg, dtype_bytes, quantization=None) -> int:
    """`weights_split`'s total; 0 for a quantization it does not know."""
    split = weights_split(cfg, dtype_bytes, quantization)
    return split[0] if split else 0


MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 config.json, the fields read
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "max_position_embeddings": 32768,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3: MLA, 3 dense layers, 256 routed experts and 1 shared, FP8 weights
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
DEEPSEEK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
LLAMA4_SCOUT_TEXT = {  # meta-llama/Llama-4-Scout-17B-16E text_config
    "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 48,
    "num_local_experts": 16, "interleave_moe_layer_step": 1, "vocab_size": 202048, "tie_word_embeddings": False,
}
GPT_OSS_120B = {  # openai/gpt-oss-120b: MXFP4 experts, the rest in bf16
    "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
    "vocab_size": 201088, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
}
H100 = DeviceMemory(total_bytes=80 * GIB, available_bytes=79 * GIB)


@pytest.mark.parametrize("config, published", [
    (MIXTRAL_8X7B, 46.7e9), (QWEN3_30B_A3B, 30.5e9), (DEEPSEEK_V3, 671e9), (LLAMA4_SCOUT_TEXT, 108e9),
])
def test_a_mixture_counts_every_expert_as_its_published_total(config, published):
    params = estimated_weights_bytes(config, 2) / 2  # no quantization: two bytes a parameter
    assert params == pytest.approx(published, rel=0.02)


def test_which_layers_are_mixtures_follows_the_models_own_keys():
    assert mixture_layers(DEEPSEEK_V3)[:4] == [False, False, False, True]  # first_k_dense_replace 3
    assert sum(mixture_layers({**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [1]})) == 23
    assert mixture_layers({**LLAMA4_SCOUT_TEXT, "interleave_moe_layer_step": 2})[:4] == [False, True, False, True]
    assert not any(mixture_layers({**MIXTRAL_8X7B, "num_local_experts": 0}))  # a dense model
    assert not any(mixture_layers({**LLAMA4_SCOUT_TEXT, "interleave_moe_layer_step": 0}))  # vLLM: no mixture layers


def test_a_quantized_checkpoint_counts_its_stored_width():
    fp8 = estimated_weights_bytes(DEEPSEEK_V3, 2, DEEPSEEK_FP8)
    assert 660e9 < fp8 < 690e9  # ~669B linear parameters at 1 byte, the embeddings at 2
    oss = estimated_weights_bytes(GPT_OSS_120B, 2)
    assert 63e9 < oss < 67e9  # the checkpoint's ~65 GB: 114.7B expert parameters at 4.25 bits, 2.1B at 16
    awq = estimated_weights_bytes(MIXTRAL_8X7B, 2, {"quant_method": "awq", "bits": 4, "group_size": 128})
    assert awq == pytest.approx(0.26e9 * 2 + 46.4e9 / 2, rel=0.02)
    w8 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 8}}}}
    assert quantized_bits(w8) == (8.0, 8.0)
    mixed = {"quant_method": "compressed-tensors", "config_groups": {"attn": {"weights": {"num_bits": 8}},
                                                                      "experts": {"weights": {"num_bits": 4}}}}
    assert quantized_bits(mixed) == (4.0, 4.0)  # the narrowest: undercounted, never over
    assert quantized_bits({"quant_method": "bitsandbytes", "load_in_4bit": True}) is None  # not a vLLM 0.32 method
    # stored 4-bit whatever their names say: fp_quant's mxfp4/nvfp4, ModelOpt's NVFP4, DeepSeek V4's experts
    assert quantized_bits({"quant_method": "fp_quant", "forward_dtype": "mxfp4"}) == (MXFP4_BITS, MXFP4_BITS)
    assert quantized_bits({"quant_method": "fp_quant", "forward_dtype": "nvfp4"}) == (NVFP4_BITS, NVFP4_BITS)
    assert quantized_bits({"quant_method": "modelopt", "quant_algo": "NVFP4"}) == (NVFP4_BITS, NVFP4_BITS)
    assert quantized_bits({"quant_method": "modelopt", "quant_algo": "FP8"}) == (8.0, 8.0)
    v4 = {**DEEPSEEK_V3, "model_type": "deepseek_v4"}
    assert quantized_bits(DEEPSEEK_FP8, v4) == (MXFP4_BITS, 8.0)  # its attention and shared experts in FP8
    assert quantized_bits(DEEPSEEK_FP8, {**v4, "expert_dtype": "fp8"}) == (8.0, 8.0)


def test_a_quantization_it_does_not_know_leaves_the_weights_unknown():
    """Counted at full width it would prune configs as out of memory that fit; unknown, vLLM's start decides."""
    assert quantized_bits({"quant_method": "some_new_format"}) is None
    assert estimated_weights_bytes(MIXTRAL_8X7B, 2, {"quant_method": "some_new_format"}) == 0


def test_mixtral_from_its_config_needs_two_h100s(tmp_path):
    """The user-facing decision: at TP=1 the preflight says the weights leave no room (it said 13 GiB before, and the
    trial started only to run out of memory); at TP=2 it fits; its 4-bit AWQ checkpoint fits one."""
    d = tmp_path / "mixtral"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    info = inspect_model(str(d), dummy_weights=True)
    assert 85 * GIB < info.weights_bytes < 88 * GIB
    params = {"gpu_memory_utilization": 0.9, "max_model_len": 8192}
    assert "leave no room for the KV cache" in memory_problems(estimate(params, info, "cuda", H100, 500))[0]
    assert memory_problems(estimate({**params, "tensor_parallel_size": 2}, info, "cuda", H100, 500)) == []
    awq = model_info({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "awq", "bits": 4}}, "awq")
    assert memory_problems(estimate(params, awq, "cuda", H100, 500)) == []


def test_an_older_modelopt_checkpoint_is_read_from_its_hf_quant_config(tmp_path):
    """ModelOpt <= 0.29 wrote its quantization to hf_quant_config.json, not config.json; vLLM reads it there. Counted at
    bf16 an FP8 checkpoint of Mixtral looked twice its size."""
    d = tmp_path / "mixtral-fp8"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    (d / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.19.0"},
                                                        "quantization": {"quant_algo": "FP8"}}))
    assert 43 * GIB < inspect_model(str(d), dummy_weights=True).weights_bytes < 45 * GIB  # 46.4B at 1 byte, 0.26B at 2


def test_a_mixtures_experts_are_split_over_data_parallel_ranks_too():
    """vLLM's FusedMoE shards the experts over tensor x data parallel ranks; attention and embeddings are replicated
    on each data parallel rank. Mixtral at TP=1, DP=2 holds ~48 GB a GPU, not 93."""
    info = model_info(MIXTRAL_8X7B, "mixtral")
    assert info.expert_bytes == pytest.approx(2 * 45.1e9, rel=0.01)
    dp2 = per_gpu(info, {"data_parallel_size": 2})
    assert dp2.weights_bytes == pytest.approx((info.weights_bytes - info.expert_bytes) + info.expert_bytes / 2, abs=2)
    assert 46e9 < dp2.weights_bytes < 50e9
    tp2 = per_gpu(info, {"tensor_parallel_size": 2})
    assert tp2.weights_bytes == pytest.approx(info.weights_bytes / 2, abs=2)
    measured = model_info(MIXTRAL_8X7B, "mixtral", weights_bytes=int(90e9))  # files on disk: the estimate's share
    assert measured.expert_bytes == pytest.approx(90e9 * info.expert_bytes / info.weights_bytes, rel=1e-6)


def test_only_what_changes_the_models_numbers_asks_for_an_accuracy_check():
    assert "kv_cache_dtype=fp8" in accuracy_line({"kv_cache_dtype": "fp8"})
    assert "quantization=fp8" in accuracy_line({"quantization": "fp8"})  # made on the fly from a 16-bit checkpoint
    assert accuracy_line({"quantization": "gptq_marlin"}) is None  # a kernel of the checkpoint's own format
    assert accuracy_line({"kv_cache_dtype": "bfloat16", "max_num_seqs": 64}) is None
    # vLLM 0.32 warns that turning chunked prefill off for a model that supports it may crash or give wrong outputs
    off = accuracy_line({"enable_chunked_prefill": False, "kv_cache_dtype": "fp8"})
    assert "enable_chunked_prefill=False is not officially supported" in off and "kv_cache_dtype=fp8 changes" in off
    assert accuracy_line({"enable_chunked_prefill": True}) is None


def test_a_float32_checkpoint_counts_as_vllm_serves_it_in_16_bits():
    """vLLM's dtype auto downcasts a float32 checkpoint (on every GPU and CPU it supports): its files hold 4 bytes a
    parameter, its engine 2. Counted at 4 the preflight asked for twice the memory; served as float32 it is 4 again."""
    f32 = {**MIXTRAL_8X7B, "num_local_experts": 0, "torch_dtype": "float32"}
    info = model_info(f32, "m", weights_bytes=int(4 * 7.2e9))  # the files: 7.2B parameters in float32
    assert info.dtype == "float32" and info.dtype_bytes == 2 and info.weights_bytes == int(2 * 7.2e9)
    assert info.kv_bytes_per_token == model_info({**f32, "torch_dtype": "bfloat16"}, "m").kv_bytes_per_token
    assert info.served_as("float32").weights_bytes == int(4 * 7.2e9)


def test_what_the_layer_by_layer_estimate_leaves_unknown_or_counts_as_vllm_builds_it():
    """A hybrid's layers (Nemotron-H's Mamba, MLP and expert layers apart; here the form of Nemotron 3 Nano's config:
    the estimate made it 102B parameters for its 31.6B) and a NAS model's block_configs are not estimated (0: the real
    start decides), nor a NAS model's KV cache; a non-gated MLP is two matrices (StarCoder2-15B: 16B, not 21.7B);
    Falcon's KV heads are num_kv_heads, or one (multi_query)."""
    nano = {"model_type": "nemotron_h", "hidden_size": 2688, "num_hidden_layers": 52, "n_routed_experts": 128,
            "moe_intermediate_size": 1856, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
            "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "vocab_size": 131072}
    assert model_info(nano, "nemotron-3-nano").weights_bytes == 0
    assert model_info(nano, "nemotron-3-nano", weights_bytes=63 * 10**9).weights_bytes == 63 * 10**9  # from its files
    nas = {"model_type": "nemotron-nas", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
           "num_key_value_heads": None, "block_configs": [{"attention": {"n_heads_in_group": 8}}] * 80}
    assert model_info(nas, "nemotron-super").weights_bytes == 0 and model_info(nas, "m").kv_bytes_per_token == 0
    granite_dense = {"model_type": "granitemoehybrid", "hidden_size": 2048, "num_hidden_layers": 2,
                     "mamba_d_state": 256, "num_attention_heads": 16, "layer_types": ["attention", "attention"],
                     "vocab_size": 100352, "intermediate_size": 8192}
    assert model_info(granite_dense, "granite-4.0-micro").weights_bytes > 0  # every layer attends: estimated
    starcoder2 = {"model_type": "starcoder2", "hidden_size": 6144, "intermediate_size": 24576, "num_hidden_layers": 40,
                  "num_attention_heads": 48, "num_key_value_heads": 4, "vocab_size": 49152,
                  "tie_word_embeddings": False}
    assert 15.9e9 < estimated_weights_bytes(starcoder2, 2) / 2 < 16.0e9
    falcon_7b = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32,
                 "multi_query": True}
    assert model_info(falcon_7b, "f").num_kv_heads == 1
    # transformers fills num_kv_heads with every head where config.json leaves it out: vLLM reads it only under the
    # new decoder architecture; multi_query is Falcon's default
    saved = {**falcon_7b, "num_kv_heads": 71, "new_decoder_architecture": False}
    unsaid = {k: v for k, v in saved.items() if k != "multi_query"}
    assert model_info(saved, "f").num_kv_heads == 1 and model_info(unsaid, "f").num_kv_heads == 1
    assert model_info({**saved, "multi_query": False}, "f").num_kv_heads == 71
    # the estimate's attention has that one KV head too: 4544 x 64 for K and for V, not 4544 x 4544
    assert attention_params(falcon_7b) == 2 * 4544 * 4544 + 2 * 4544 * 64
    falcon_40b = {**falcon_7b, "hidden_size": 8192, "num_attention_heads": 128, "new_decoder_architecture": True,
                  "num_kv_heads": 8}
    assert model_info(falcon_40b, "f").num_kv_heads == 8
