"""The embedded default by device (config/demo.py), and the GPU demo's shipped config.json as transformers and vLLM's
own code read it (on the CPU build: vLLM's config, not its CUDA engine)."""

from __future__ import annotations

import json

import pytest

from optimizer.config.demo import GPU_DEMO_CONFIG, GPU_DEMO_NAME, GPU_DEMO_REQUESTS, Demo, demo_for, embedded_model
from optimizer.config.model import inspect_model
from optimizer.config.presets import get
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec
from optimizer.core.errors import UsageError

# Llama-3.2-1B's parameters, as its model card counts them (embeddings tied: counted once)
LLAMA_3_2_1B_PARAMETERS = 1_235_814_400


def test_the_cpu_demo_is_what_it_was():
    """The probe picks the shape of the CPU ladder; its workload is the CPU scale."""
    assert demo_for("cpu") == Demo("tiny-llama-17m", dummy_weights=False, probe=True, workload=CPU_DEMO_WORKLOAD)
    assert demo_for("cpu").settings() == {"model": "tiny-llama-17m", "model_is_default": True, "demo_probe": True,
                                          "workload": CPU_DEMO_WORKLOAD}  # a --dummy-weights given stays


def test_a_gpu_gets_the_1b_model_with_dummy_weights_and_chat_traffic_at_gpu_scale():
    demo = demo_for("cuda")
    assert (demo.model, demo.dummy_weights, demo.probe) == (GPU_DEMO_NAME, True, False)
    assert demo.workload == {**get("chat").fields, "num_requests": GPU_DEMO_REQUESTS}
    spec = WorkloadSpec(**demo.workload)
    assert spec.num_requests == 2000 and spec.input_len_max == 2048 and spec.output_len_max == 1024
    assert demo.settings()["dummy_weights"] is True


def test_given_fields_and_presets_win_at_the_demos_scale():
    assert demo_for("cuda", {"num_requests": 500}).workload["num_requests"] == 500
    rag = demo_for("cuda", {"preset": "rag"}).workload
    assert rag == {**get("rag").fields, "num_requests": GPU_DEMO_REQUESTS, "preset": "rag"}
    assert demo_for("cpu", {"preset": "rag"}).workload == {**get("rag").cpu_demo, "preset": "rag"}


def test_a_named_embedded_model_keeps_its_own_scale_on_either_device():
    assert demo_for("cuda", model="tiny-llama-7m") == Demo("tiny-llama-7m", False, False, CPU_DEMO_WORKLOAD)
    assert demo_for("cpu", model=GPU_DEMO_NAME) == demo_for("cuda")
    with pytest.raises(UsageError, match=r"no embedded model 'llama-9b'.*tiny-llama-17m.*llama3\.2-1b-dummy"):
        demo_for("cuda", model="llama-9b")


def test_the_shipped_config_builds_llama_3_2_1b(model_cache):
    """transformers reads it as Llama-3.2-1B's config, the architecture it builds (on the meta device: no memory)
    has that model's parameter count, and the tool's own weight estimate agrees."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(GPU_DEMO_CONFIG.parent)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size, config.tie_word_embeddings) \
        == ("llama", 2048, 16, 32, 8, 8192, 128256, True)
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 32.0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == LLAMA_3_2_1B_PARAMETERS
    info = inspect_model(str(embedded_model(GPU_DEMO_NAME)), dummy_weights=True)
    assert info.weights_bytes == 0  # random weights: vLLM's own build of the model counts them at each trial
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.max_len) == (16, 8, 64, 131072)


def test_the_gpu_demo_folder_is_the_shipped_config_and_a_tokenizer(model_cache):
    path = embedded_model(GPU_DEMO_NAME)
    assert path.parent == model_cache / "models"
    assert (path / "config.json").read_text() == GPU_DEMO_CONFIG.read_text()
    assert not list(path.glob("*.safetensors"))  # vLLM's dummy weights: nothing to download or generate
    with pytest.raises(UsageError, match="--dummy-weights"):
        inspect_model(str(path))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # another version's config
    assert (embedded_model(GPU_DEMO_NAME) / "config.json").read_text() == GPU_DEMO_CONFIG.read_text()


def test_vllm_builds_its_engine_config_from_it(model_cache):
    """vLLM's own EngineArgs -> VllmConfig (the CPU platform here: the config, not a CUDA engine) reads the model as a
    1B Llama with dummy weights, and vLLM's tokenizer loader reads the word tokenizer `vllm serve` detokenizes with."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers.registry import cached_tokenizer_from_config

    path = embedded_model(GPU_DEMO_NAME)
    vllm_config = EngineArgs(model=str(path), load_format="dummy").create_engine_config()
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    assert model.architectures == ["LlamaForCausalLM"] and model.hf_config.tie_word_embeddings
    assert (model.get_num_layers(parallel), model.get_num_kv_heads(parallel), model.get_head_size(),
            model.get_vocab_size(), model.max_model_len) == (16, 8, 64, 128256, 131072)
    assert vllm_config.load_config.load_format == "dummy"
    tokenizer = cached_tokenizer_from_config(model)
    assert len(tokenizer) == 128256 and tokenizer.decode([5, 128255]) == "w5 w128255"


def test_a_gpu_demo_study_config_holds_the_workload(model_cache):
    """The settings resolve_config gives a GPU study without --model make a valid StudyConfig whose longest request
    fits the model."""
    config = StudyConfig(study_name="d", storage_url="sqlite:///:memory:", ttft_p99_ms=150.0, budget=40,
                         device="cuda", **demo_for("cuda").settings())
    assert config.dummy_weights and config.model_is_default and not config.demo_probe
    assert config.workload.max_total_len <= inspect_model(str(embedded_model(GPU_DEMO_NAME)), True).max_len
