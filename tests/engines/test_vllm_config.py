"""What the preflight reads from vLLM itself (optimizer/engines/vllm_config.py): the `VllmConfig` that the installed
vLLM builds for a trial, read into `Resolved`, compared with the same config built straight through vLLM's own
`EngineArgs.create_engine_config`; the trial's environment applied while it is built and restored after; and the
memory estimate taking vLLM's MLA and tokens in flight from it."""

import json
import os
from dataclasses import replace

import pytest

from optimizer.engines.vllm_config import resolved
from optimizer.engines.vllm_engine import VllmEngine
from optimizer.params.deploy import usage_context

DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json, the fields read
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
}


@pytest.fixture
def deepseek(tmp_path):
    d = tmp_path / "deepseek-v3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    return d


def vllms_own(base, params, env=None, read=resolved):
    """`read` of the config vLLM builds for the trial, straight through its EngineArgs, with the trial's env set
    around both (vLLM reads some of it lazily: ModelConfig.use_mla is a property over VLLM_MLA_DISABLE)."""
    from vllm import AsyncEngineArgs

    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        return read(AsyncEngineArgs(skip_tokenizer_init=True, disable_log_stats=True, **base, **params)
                    .create_engine_config(usage_context("serve")))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def config_part(got):
    """What vLLM's config alone says (the rank's build aside)."""
    return replace(got, kv_bytes_one_sequence=0, kv_bytes_per_token=0, weights_bytes=0)


@pytest.mark.parametrize("params", [{}, {"max_model_len": 1024, "max_num_seqs": 8}, {"enable_chunked_prefill": False},
                                    {"max_num_batched_tokens": 512, "max_model_len": 2048}])
def test_the_resolved_numbers_are_vllms_own(tiny_model, params):
    base = {"model": str(tiny_model), "enforce_eager": True}
    got = VllmEngine(base).validate(params)
    c = vllms_own(base, params, read=lambda c: c)
    assert config_part(got) == vllms_own(base, params)
    assert (got.max_model_len, got.max_num_seqs, got.max_num_batched_tokens, got.max_in_flight_tokens) == (
        c.model_config.max_model_len, c.scheduler_config.max_num_seqs, c.scheduler_config.max_num_batched_tokens,
        c.max_in_flight_tokens)


def test_the_trials_environment_decides_mla_and_is_restored(deepseek, monkeypatch):
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    base = {"model": str(deepseek), "load_format": "dummy", "enforce_eager": True}
    engine = VllmEngine(base)
    on, off = engine.validate({}), engine.validate({"env:VLLM_MLA_DISABLE": "1"})
    assert config_part(on) == vllms_own(base, {})
    assert config_part(off) == vllms_own(base, {}, {"VLLM_MLA_DISABLE": "1"})
    assert on.use_mla and not off.use_mla
    assert "VLLM_MLA_DISABLE" not in os.environ  # the trial's environment is not left behind
    # the cache is what vLLM's model builds under each: one latent a token and layer, or every head's K and V (V
    # padded to K's size): 85 times more
    assert off.kv_bytes_per_token > 50 * on.kv_bytes_per_token


def test_a_config_vllm_refuses_is_refused_as_before(tiny_model):
    from optimizer.core.errors import EngineStartError

    with pytest.raises(EngineStartError, match="vLLM rejects the config"):
        VllmEngine({"model": str(tiny_model), "enforce_eager": True}).validate({"max_num_seqs": 0})


LLAMA31_8B = {  # meta-llama/Llama-3.1-8B-Instruct config.json, the fields read
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN3_32B = {  # Qwen/Qwen3-32B config.json, the fields read
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600,
    "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
PHI3_MINI_128K = {  # microsoft/Phi-3-mini-128k-instruct config.json, the fields read (factors shortened)
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "longrope", "long_factor": [1.08] * 48, "short_factor": [1.0] * 48}}
GEMMA3_27B = {  # google/gemma-3-27b-it's text_config, the fields read
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 1024,
    "sliding_window_pattern": 6, "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "torch_dtype": "bfloat16"}
JAMBA = {  # ai21labs/Jamba-v0.1 config.json, the fields read: a hybrid of Mamba and attention layers
    "architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536,
    "num_experts": 16, "num_experts_per_tok": 2, "attn_layer_period": 8, "attn_layer_offset": 4,
    "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_dt_rank": 256, "max_position_embeddings": 262144, "torch_dtype": "bfloat16"}
PUBLISHED = {"Llama-3.1-8B": LLAMA31_8B, "Qwen3-32B": QWEN3_32B, "Phi-3-mini-128k": PHI3_MINI_128K,
             "DeepSeek-V3": DEEPSEEK_V3, "Gemma-3-27B": GEMMA3_27B, "Jamba": JAMBA}
# each one's layers as its model card describes them: the kinds of cache vLLM's model asks for, and how many
LAYERS = {"Llama-3.1-8B": {"FullAttentionSpec": 32}, "Qwen3-32B": {"FullAttentionSpec": 64},
          "Phi-3-mini-128k": {"FullAttentionSpec": 32}, "DeepSeek-V3": {"MLAAttentionSpec": 61},
          "Gemma-3-27B": {"SlidingWindowSpec": 52, "FullAttentionSpec": 10},  # five local layers to one global
          "Jamba": {"MambaSpec": 28, "FullAttentionSpec": 4}}  # one attention layer in eight


def published(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(PUBLISHED[name]))
    return VllmEngine({"model": str(d), "load_format": "dummy", "enforce_eager": True})


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8"])
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_one_sequence_is_what_vllm_s_own_model_and_memory_check_say(tmp_path, monkeypatch, name, kv_cache_dtype):
    """One rank of each published model as vLLM builds it (on the meta device): the layers' cache specs are the
    kinds its model card describes, and the preflight's cache of one max_model_len sequence is what vLLM's own start
    checks (`kv_cache_utils.get_kv_cache_configs`): enough with that much memory, refused with a byte less."""
    from collections import Counter

    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    from optimizer.engines.vllm_config import rank_model

    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    engine = published(tmp_path, name)
    params = {"max_model_len": 8192} if kv_cache_dtype is None else {"max_model_len": 8192, "kv_cache_dtype": "fp8"}
    got = engine.validate(params)
    rank = rank_model({"skip_tokenizer_init": True, **engine._base_args, **params}, "serve", {})
    assert Counter(type(spec).__name__ for spec in rank.specs.values()) == LAYERS[name]
    assert got.kv_bytes_one_sequence > 0 and got.max_model_len == 8192

    def check(available):  # what the engine core runs at start, with the cache layout it resolves
        config = engine.engine_config(params)
        config.cache_config.kv_cache_layout = rank.kv_cache_layout
        get_kv_cache_configs(config, [dict(rank.specs)], [available])

    check(got.kv_bytes_one_sequence)  # just enough
    with pytest.raises(ValueError, match="To serve at least one request"):
        check(got.kv_bytes_one_sequence - 1)
    if kv_cache_dtype is None or name == "Jamba":  # Jamba's state keeps its dtype; its 4 attention layers do not
        return
    bf16 = engine.validate({"max_model_len": 8192})
    assert got.kv_bytes_one_sequence == bf16.kv_bytes_one_sequence // 2  # fp8: a byte a value


def test_a_rank_s_weights_are_the_model_s_published_parameters_and_its_layout_s_share(tmp_path):
    """vLLM's own build of the model counts its weights: Llama-3.1-8B's 8.03B parameters in bf16, half of them (less
    what each rank keeps whole) at tensor parallel 2, and its cache's KV heads halved with them."""
    engine = published(tmp_path, "Llama-3.1-8B")
    one, two = engine.validate({"max_model_len": 8192}), engine.validate({"max_model_len": 8192,
                                                                          "tensor_parallel_size": 2})
    assert one.weights_bytes == pytest.approx(2 * 8.03e9, rel=0.005)  # and the rotary table vLLM keeps beside
    assert one.weights_bytes / 2 < two.weights_bytes < one.weights_bytes * 0.52
    assert two.kv_bytes_one_sequence == one.kv_bytes_one_sequence // 2


def test_a_model_vllm_cannot_build_leaves_its_memory_to_the_start(tmp_path):
    """Where vLLM's model cannot be built without weights, the preflight counts none of it (the lenient side)."""
    from optimizer.engines.vllm_config import rank_model

    assert rank_model({"model": str(tmp_path / "none"), "load_format": "dummy"}, "serve", {}) is None


def test_the_space_reaches_the_longest_context_vllm_accepts(tmp_path, monkeypatch):
    """Phi-3-mini-128k: vLLM runs 4096 tokens by default (its LongRoPE rule) and accepts its full 131072, which the
    space may search; a length past what vLLM accepts leaves its default."""
    from optimizer.engines.vllm_config import model_defaults

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    args = {"model": published(tmp_path, "Phi-3-mini-128k")._base_args["model"], "load_format": "dummy"}
    assert model_defaults(args) == (4096, False)
    assert model_defaults(args, 131072) == (131072, False)
    assert model_defaults(args, 10**7) == (4096, False)
    assert model_defaults({"model": str(tmp_path / "none")}) is None
