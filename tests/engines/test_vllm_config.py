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
