"""What the preflight reads from vLLM itself (optimizer/engines/vllm_config.py): the `VllmConfig` that the installed
vLLM builds for a trial, read into `Resolved`, compared with the same config built straight through vLLM's own
`EngineArgs.create_engine_config`; the trial's environment applied while it is built and restored after; and the
memory estimate taking vLLM's MLA and tokens in flight from it."""

import json
import os

import pytest

from optimizer.config.model import model_info
from optimizer.engines.vllm_config import resolved
from optimizer.engines.vllm_engine import VllmEngine
from optimizer.params.deploy import usage_context
from optimizer.params.preflight import GIB, DeviceMemory, as_resolved, estimate

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


@pytest.mark.parametrize("params", [{}, {"max_model_len": 1024, "max_num_seqs": 8}, {"enable_chunked_prefill": False},
                                    {"max_num_batched_tokens": 512, "max_model_len": 2048}])
def test_the_resolved_numbers_are_vllms_own(tiny_model, params):
    base = {"model": str(tiny_model), "enforce_eager": True}
    got = VllmEngine(base).validate(params)
    c = vllms_own(base, params, read=lambda c: c)
    assert got == vllms_own(base, params)
    assert (got.max_model_len, got.max_num_seqs, got.max_num_batched_tokens, got.max_in_flight_tokens) == (
        c.model_config.max_model_len, c.scheduler_config.max_num_seqs, c.scheduler_config.max_num_batched_tokens,
        c.max_in_flight_tokens)


def test_the_trials_environment_decides_mla_and_is_restored(deepseek, monkeypatch):
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    base = {"model": str(deepseek), "load_format": "dummy", "enforce_eager": True}
    engine = VllmEngine(base)
    on, off = engine.validate({}), engine.validate({"env:VLLM_MLA_DISABLE": "1"})
    assert on == vllms_own(base, {})
    assert off == vllms_own(base, {}, {"VLLM_MLA_DISABLE": "1"})
    assert on.use_mla and not off.use_mla
    assert "VLLM_MLA_DISABLE" not in os.environ  # the trial's environment is not left behind
    # the estimate caches what vLLM resolved: one latent a token and layer, or every head's keys and values
    info = model_info(DEEPSEEK_V3, "deepseek-ai/DeepSeek-V3", weights_bytes=int(671e9))
    memory = DeviceMemory(total_bytes=1400 * GIB, available_bytes=1390 * GIB)
    latent = estimate(as_resolved({}, on), info, "cuda", memory, 2000, {}, on)
    heads = estimate(as_resolved({}, off), info, "cuda", memory, 2000, {}, off)
    assert latent.kv_one_sequence_bytes == 61 * (512 + 64) * 2 * on.max_model_len
    assert heads.kv_one_sequence_bytes == 61 * 2 * 128 * (128 + 64) * 2 * off.max_model_len


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
PUBLISHED = {"Llama-3.1-8B": LLAMA31_8B, "Qwen3-32B": QWEN3_32B, "Phi-3-mini-128k": PHI3_MINI_128K,
             "DeepSeek-V3": DEEPSEEK_V3}


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8"])
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_one_sequence_is_what_vllms_own_kv_cache_specs_need(tmp_path, monkeypatch, name, kv_cache_dtype):
    """The preflight's cache of one max_model_len sequence is vLLM's `kv_cache_utils.max_memory_usage_bytes` over
    the specs vLLM gives each attention layer; the config reader the simulator uses agrees with vLLM on each number."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.core.kv_cache_utils import max_memory_usage_bytes
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    config = PUBLISHED[name]
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    params = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
    engine = VllmEngine({"model": str(d), "load_format": "dummy", "enforce_eager": True})
    got = engine.validate(params)
    c = engine.engine_config(params)
    m, p = c.model_config, c.parallel_config
    spec = (MLAAttentionSpec if m.use_mla else FullAttentionSpec)(
        block_size=1, num_kv_heads=m.get_num_kv_heads(p), head_size=m.get_head_size(),
        dtype=kv_cache_dtype_str_to_dtype(c.cache_config.cache_dtype, m))
    layers = m.get_num_layers_by_block_type(p, "attention")
    assert (got.kv_bytes_per_layer, got.attention_layers, got.max_model_len) == (spec.page_size_bytes, layers,
                                                                                 m.max_model_len)
    info = model_info(config, name, weights_bytes=1)
    memory = DeviceMemory(total_bytes=10_000 * GIB, available_bytes=10_000 * GIB)
    est = estimate(as_resolved(params, got), info, "cuda", memory, 2000, {}, got)
    assert est.kv_one_sequence_bytes == max_memory_usage_bytes(c, [spec] * layers)
    # the config reader (the simulator's, which has no vLLM config) reads the same from config.json
    from optimizer.params.parallel import per_gpu

    ours = per_gpu(info, params)
    assert (ours.kv_bytes_per_layer, ours.num_layers, info.default_len or info.max_len) == (
        got.kv_bytes_per_layer, got.attention_layers, got.max_model_len)
