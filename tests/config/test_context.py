"""The context lengths vLLM 0.32 derives from config.json (optimizer/config/context.py), on published configs' fields,
and the memory check of a config that leaves max_model_len to vLLM: vLLM's defaults for Phi-3-mini-128k run 4096
tokens, not the 131072 the model may ask for."""

from optimizer.config.context import context_lengths
from optimizer.config.model import model_info
from optimizer.params.preflight import GIB, DeviceMemory, estimate, memory_problems, unset_model_len

PHI3_MINI_128K = {  # microsoft/Phi-3-mini-128k-instruct config.json: the fields read (factors shortened)
    "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "longrope", "long_factor": [1.08] * 48, "short_factor": [1.0] * 48}}


def test_the_lengths_vllm_derives():
    assert context_lengths(PHI3_MINI_128K) == (131072, 4096)  # LongRoPE: its original length where left out
    assert context_lengths({**PHI3_MINI_128K, "rope_scaling": {"type": "su"}}) == (131072, 4096)  # su is longrope
    llama31 = {"max_position_embeddings": 131072,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}
    assert context_lengths(llama31) == (131072, 131072)  # already the scaled length
    assert context_lengths({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}) \
        == (16384, 16384)
    yarn = {"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    assert context_lengths(yarn) == (32768, 32768)
    gemma3 = {"model_type": "gemma3_text", "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert context_lengths(gemma3) == (131072, 131072)  # vLLM leaves Gemma 3's alone
    assert context_lengths({"max_position_embeddings": 8192, "seq_length": 4096}) == (4096, 4096)  # the smallest
    assert context_lengths({"max_position_embeddings": 8192, "model_max_length": 131072}) == (131072, 131072)
    assert context_lengths({"n_positions": 1024}) == (1024, 1024)  # GPT-2
    assert context_lengths({}) == (2048, 2048)


def test_vllm_s_defaults_for_a_longrope_model_check_its_original_length():
    """The baseline leaves max_model_len to vLLM: one sequence of 4096 tokens, 1.5 GiB (on 131072 tokens, at 393,216
    bytes a token, 48 GiB: no room beside the weights in 0.9 of a 24 GiB GPU). A config that asks for 131072 is
    checked so."""
    phi3 = model_info(PHI3_MINI_128K, "microsoft/Phi-3-mini-128k-instruct", weights_bytes=int(7.6e9))
    gpu = DeviceMemory(total_bytes=24 * GIB, available_bytes=23 * GIB)
    defaults = estimate({"max_num_seqs": 256, "max_num_batched_tokens": 2048}, phi3, "cuda", gpu, 1000)
    assert defaults.kv_one_sequence_bytes == 32 * 2 * 32 * 96 * 2 * 4096 and memory_problems(defaults) == []
    asked = estimate({"max_model_len": 131072, "max_num_seqs": 256, "max_num_batched_tokens": 2048}, phi3, "cuda",
                     gpu, 1000)
    assert asked.kv_one_sequence_bytes == 32 * 2 * 32 * 96 * 2 * 131072
    assert "lower max_model_len" in memory_problems(asked)[0]


def test_a_disabled_sliding_window_caps_the_length_vllm_takes():
    mistral = model_info({"model_type": "mistral", "num_hidden_layers": 32, "sliding_window": 4096,
                          "max_position_embeddings": 32768, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "hidden_size": 4096}, "mistral-7b-v0.1")
    assert unset_model_len({}, mistral) == 32768
    assert unset_model_len({"disable_sliding_window": True}, mistral) == 4096
