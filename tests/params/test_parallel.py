"""Tensor and data parallelism: memory is checked per GPU (a 70B model fits eight 80 GiB H100s at TP=8), every
visible GPU is probed, a layout larger than the host is invalid before any start, and compose reserves its GPUs."""

from dataclasses import replace

import pytest
import yaml

from optimizer.config.model import model_info, uses_mla
from optimizer.decision.export import export_all
from optimizer.params.parallel import gpus_needed, layout_problems, per_gpu, per_gpu_curve
from optimizer.params.preflight import GIB, DeviceMemory, estimate, memory_problems
from optimizer.search.confirmed import recommended
from tests.support import synthetic
from tests.support.fake_nvml import FakeNvml

LLAMA_70B = {  # meta-llama/Meta-Llama-3-70B config.json
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
H100 = DeviceMemory(total_bytes=80 * GIB, available_bytes=79 * GIB)


@pytest.fixture
def llama70b():
    return model_info(LLAMA_70B, "meta-llama/Meta-Llama-3-70B")


def test_a_70b_model_fits_eight_h100s_at_tp8_and_not_one(llama70b):
    assert 120 * GIB < llama70b.weights_bytes < 140 * GIB  # ~70.6e9 parameters in bf16
    params = {"gpu_memory_utilization": 0.9, "max_model_len": 8192}
    one = estimate(params, llama70b, "cuda", H100, 500)
    assert memory_problems(one) and "leave no room for the KV cache" in memory_problems(one)[0]
    eight = estimate({**params, "tensor_parallel_size": 8}, llama70b, "cuda", H100, 500)
    assert memory_problems(eight) == []
    assert eight.weights_bytes == pytest.approx(llama70b.weights_bytes / 8, abs=1)


def test_kv_heads_split_over_tensor_parallel_ranks_and_replicate_past_their_count(llama70b):
    per_token = llama70b.kv_bytes_per_token  # 2 x 80 layers x 8 heads x 128 x 2 bytes
    assert per_token == 2 * 80 * 8 * 128 * 2
    assert per_gpu(llama70b, {"tensor_parallel_size": 4}).kv_bytes_per_token == per_token // 4
    assert per_gpu(llama70b, {"tensor_parallel_size": 16}).num_kv_heads == 1  # vLLM: max(1, 8 // 16)
    assert per_gpu(llama70b, {"pipeline_parallel_size": 2}).num_layers == 40
    assert per_gpu(llama70b, {"data_parallel_size": 4}) == llama70b  # each replica holds everything


DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json, the fields read
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
}


def test_an_mla_model_caches_one_latent_per_token_and_layer(monkeypatch):
    """vLLM's MLAAttentionSpec: one head of kv_lora_rank + qk_rope_head_dim, no V, on every tensor rank alike. Read
    as 128 heads of K and V it was 25x too large, and a 128k context looked as if it could not fit."""
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    v3 = model_info(DEEPSEEK_V3, "deepseek-ai/DeepSeek-V3", weights_bytes=int(671e9))  # fp8 weights
    assert v3.mla and v3.kv_bytes_per_token == 61 * (512 + 64) * 2  # 70,272 bytes a token
    assert per_gpu(v3, {"tensor_parallel_size": 8}).kv_bytes_per_token == v3.kv_bytes_per_token  # replicated
    h200 = DeviceMemory(total_bytes=140 * GIB, available_bytes=139 * GIB)
    est = estimate({"gpu_memory_utilization": 0.7, "tensor_parallel_size": 8, "max_model_len": 131072}, v3, "cuda",
                   h200, 2000)
    # 98 GiB, 78.1 of weights a rank and 1 of runtime: 18.9 left, 8.6 for one 128k sequence (read as 16 heads of K
    # and V a rank: 26.7, "lower max_model_len")
    assert memory_problems(est) == [] and est.kv_one_sequence_bytes == 70272 * 131072
    assert not uses_mla(DEEPSEEK_V3, env={"VLLM_MLA_DISABLE": "1"})  # vLLM then caches K and V of every head
    assert uses_mla(DEEPSEEK_V3, env={"VLLM_MLA_DISABLE": "00"})  # vllm/envs.py: bool(int(...))
    assert not uses_mla({**DEEPSEEK_V3, "kv_lora_rank": None}) and not uses_mla(LLAMA_70B)
    # MiniCPM3 has a kv_lora_rank, but vLLM runs it with ordinary attention: not a model type of its MLA list
    assert not uses_mla({**DEEPSEEK_V3, "model_type": "minicpm3"}, env={})
    # DeepSeek V4's compressed, sparse cache (compress_ratios, a head_dim): MLA, its KV cache not modelled (unchecked)
    v4 = model_info({**DEEPSEEK_V3, "model_type": "deepseek_v4", "compress_ratios": [4], "head_dim": 512}, "v4")
    assert v4.mla == uses_mla({**DEEPSEEK_V3, "compress_ratios": [4], "head_dim": 512}, env={}) and v4.mla
    assert v4.kv_bytes_per_token == 0
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")  # vLLM then caches K and V of 128 heads of qk_nope + qk_rope
    off = model_info(DEEPSEEK_V3, "deepseek-ai/DeepSeek-V3", weights_bytes=int(671e9))
    assert not off.mla and off.kv_bytes_per_token == 2 * 61 * 128 * (128 + 64) * 2


def test_a_trial_s_own_vllm_mla_disable_chooses_the_cache_its_preflight_checks(monkeypatch):
    """A space with `env:VLLM_MLA_DISABLE` runs some trials with the latent and some with every head's K and V
    (DeepseekV2Attention: num_attention_heads of K, and V padded to it, of qk_nope + qk_rope): 128k tokens fit
    eight H200s with the one, not the other. The process's own environment decides only where the trial says
    nothing."""
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    v3 = model_info({**DEEPSEEK_V3, "num_key_value_heads": 1}, "deepseek-ai/DeepSeek-V3", weights_bytes=int(671e9))
    h200 = DeviceMemory(total_bytes=140 * GIB, available_bytes=139 * GIB)
    params = {"gpu_memory_utilization": 0.7, "tensor_parallel_size": 8, "max_model_len": 131072}
    assert memory_problems(estimate(params, v3, "cuda", h200, 2000)) == []
    off = estimate({**params, "env:VLLM_MLA_DISABLE": True}, v3, "cuda", h200, 2000)  # split_env: True -> "1"
    assert off.kv_one_sequence_bytes == 2 * 61 * (128 // 8) * (128 + 64) * 2 * 131072  # heads, not kv heads
    assert "one max_model_len sequence needs" in memory_problems(off)[0]
    on = estimate({**params, "env:VLLM_MLA_DISABLE": "0"}, v3, "cuda", h200, 2000)
    assert on.kv_one_sequence_bytes == 61 * (512 + 64) * 2 * 131072
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")  # off for the process: a trial may turn it on again
    v3_off = model_info(DEEPSEEK_V3, "deepseek-ai/DeepSeek-V3", weights_bytes=int(671e9))
    assert not v3_off.mla and v3_off.under_env({"VLLM_MLA_DISABLE": "0"}).kv_bytes_per_token == 61 * 576 * 2
    assert v3_off.under_env({}) == v3_off
    assert model_info(LLAMA_70B, "m").under_env({"VLLM_MLA_DISABLE": "1"}) == model_info(LLAMA_70B, "m")
    # LongCat-Flash's class builds its MLA whatever the variable says (only DeepSeek V2's kin read use_mla)
    longcat = model_info({**DEEPSEEK_V3, "model_type": "longcat_flash"}, "longcat")
    assert longcat.mla and longcat.kv_bytes_per_token == 61 * 576 * 2 and not longcat.mla_switch
    # DeepSeek V4 (compress_ratios, an index_topk of its own) with MLA off for the process: unchecked, not a crash
    v4 = {**DEEPSEEK_V3, "model_type": "deepseek_v4", "compress_ratios": [4], "head_dim": 512, "index_topk": 512}
    v4.pop("kv_lora_rank")
    assert model_info(v4, "v4").kv_bytes_per_token == 0


DEEPSEEK_V32 = {**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}


def test_a_sparse_model_caches_its_indexer_keys_beside_the_latent(monkeypatch):
    """DeepSeek V3.2: each layer's indexer keeps 128 fp8 keys and a 4-byte scale a token (DeepseekV32IndexerCache,
    uint8 whatever the KV cache's dtype), on every tensor rank, beside the latent; VLLM_MLA_DISABLE does not change
    its attention (DeepseekV32Attention is MLA on CUDA). IndexCache skips some layers' indexers."""
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    v32 = model_info(DEEPSEEK_V32, "deepseek-ai/DeepSeek-V3.2", weights_bytes=int(671e9))
    assert v32.mla and v32.kv_bytes_per_token == 61 * (576 * 2 + 132)  # 78,324 bytes a token
    assert per_gpu(v32, {"tensor_parallel_size": 8}).kv_bytes_per_token == v32.kv_bytes_per_token
    assert per_gpu(v32, {"kv_cache_dtype": "fp8"}).kv_bytes_per_token == 61 * (576 + 132)  # the indexer stays
    # DeepSeek's packed layouts (the MLA layer's state_content_bytes): 656 and 352 bytes a layer, the indexer beside
    assert per_gpu(v32, {"kv_cache_dtype": "fp8_ds_mla"}).kv_bytes_per_token == 61 * (656 + 132)
    assert per_gpu(v32, {"kv_cache_dtype": "nvfp4_ds_mla"}).kv_bytes_per_token == 61 * (352 + 132)
    assert per_gpu(model_info(LLAMA_70B, "m"), {"kv_cache_dtype": "fp8_ds_mla"}).kv_bytes_per_token == 0  # unchecked
    # the largest stage: 31 of the 61 layers, their latents and their indexers
    assert per_gpu(v32, {"pipeline_parallel_size": 2}).kv_bytes_per_token == 31 * (576 * 2 + 132)
    assert v32.under_env({"VLLM_MLA_DISABLE": "1"}) == v32
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    assert model_info(DEEPSEEK_V32, "v32").kv_bytes_per_token == v32.kv_bytes_per_token
    # every second layer from the second (index_skip_topk_offset 2): layers 0, 1, 3, 5, ..., 59 keep theirs
    assert model_info({**DEEPSEEK_V32, "index_topk_freq": 2}, "m").indexer_bytes == 31 * 132
    assert model_info({**DEEPSEEK_V32, "index_topk_pattern": "FS" * 30 + "F"}, "m").indexer_bytes == 31 * 132
    assert model_info(DEEPSEEK_V3, "m").indexer_bytes == 0


def test_every_visible_gpu_is_probed_and_a_layout_gets_its_own(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = [("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0))] * 7 + [("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0))]
    nvml = FakeNvml(devices=devices, script=[(0, 0)] * 7 + [(0, 30 * GIB)])  # the 8th read holds 30 GiB
    mem = DeviceMemory.probe("cuda", nvml)
    assert (mem.total_bytes, mem.available_bytes) == (80 * GIB, 50 * GIB)  # every GPU: the smallest
    assert mem.for_gpus(1).available_bytes == mem.for_gpus(7).available_bytes == 80 * GIB  # cuda:0 to cuda:6
    assert mem.for_gpus(8).available_bytes == 50 * GIB


def test_a_layout_larger_than_the_host_is_invalid_with_the_fix():
    assert gpus_needed({"tensor_parallel_size": 4, "data_parallel_size": 2}) == 8
    assert layout_problems({"tensor_parallel_size": 8}, 8) == []
    problem = layout_problems({"tensor_parallel_size": 8, "data_parallel_size": 2}, 8)[0]
    assert "needs 16 GPUs" in problem and "8 are visible" in problem and "CUDA_VISIBLE_DEVICES" in problem
    assert layout_problems({"tensor_parallel_size": 64}, None) == []  # unknown host: the real start decides


def test_throughput_is_compared_per_gpu():
    curve = [{"output_throughput_tok_s": 8000.0, "offered_rate_rps": 4.0}]
    assert per_gpu_curve(curve, gpus_needed({"tensor_parallel_size": 8}))[0]["output_throughput_tok_s"] == 1000.0
    assert per_gpu_curve(curve, gpus_needed({}))[0]["output_throughput_tok_s"] == 8000.0


def test_compose_reserves_the_gpus_the_layout_takes(tmp_path):
    study, config = synthetic.build(tmp_path, device="cuda")
    config = config.model_copy(update={"engine_args": {"tensor_parallel_size": 4, "data_parallel_size": 2}})
    done = export_all(recommended(study), config, tmp_path, config.model)
    service = yaml.safe_load(done.compose_path.read_text())["services"]["vllm"]
    device = service["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["count"] == 8 and device["capabilities"] == ["gpu"]
    assert service["command"][service["command"].index("--tensor-parallel-size") + 1] == "4"


def test_layouts_that_differ_are_ranked_per_gpu(tmp_path):
    """Trial #2 serves 770 tok/s on two GPUs (385 per GPU), trial #1 576 tok/s on one: per GPU, #1 wins."""
    import optuna

    from optimizer.decision.decide import decide
    from optimizer.search.objective import CONSTRAINT
    from optimizer.search.attrs import STUDY_CONFIG
    from optimizer.search.study import DIRECTIONS

    config = synthetic.make_config(tmp_path, "tp", device="cuda")
    study = optuna.create_study(study_name="tp", storage=config.storage_url, directions=DIRECTIONS)
    STUDY_CONFIG.set(study, config.model_dump_json())
    for n, params in ((0, {}), (1, {}), (2, {"tensor_parallel_size": 2})):
        attrs = {**synthetic.stored(synthetic.curve(n)), "engine_params": params, "engine_config": {},
                 **({"baseline": True} if n == 0 else {})}
        study.add_trial(optuna.trial.create_trial(values=[1.0, 1.0], user_attrs=attrs,
                                                  constraints={CONSTRAINT: 0.0}))
    d = decide(study, config)
    assert d.best.number == 1 and d.best.ranked.output_throughput_tok_s == pytest.approx(576)
    by_number = {v.number: v for v in d.views}
    assert by_number[2].ranked.output_throughput_tok_s == pytest.approx(770 / 2)
    assert any("compared per GPU" in note for note in d.notes)
    (tmp_path / "one").mkdir()
    same = decide(*synthetic.build(tmp_path / "one"))
    assert same.best.number == 2 and not any("per GPU" in note for note in same.notes)  # one layout: as before


QWEN3_32B = {  # Qwen/Qwen3-32B config.json: the fields read
    "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_a_checkpoint_quantized_as_it_loads_holds_its_quantized_bytes():
    """`quantization: fp8_per_tensor` on a bf16 checkpoint: vLLM quantizes each layer as it loads (its online
    shorthands), ~31 GiB for Qwen3-32B where the files hold ~61: one 40,960-token sequence (10 GiB) then fits an
    H100, which counting the files' bytes rejected. At least half the bytes stay (ONLINE_WEIGHT_SHARE); experts_int8
    halves a mixture's experts alone."""
    qwen = model_info(QWEN3_32B, "Qwen/Qwen3-32B")
    assert 60 * GIB < qwen.weights_bytes < 62 * GIB  # its 32.8B parameters in bf16
    params = {"gpu_memory_utilization": 0.88, "max_model_len": 40960, "max_num_seqs": 256,
              "max_num_batched_tokens": 2048}
    assert "one max_model_len sequence needs" in memory_problems(estimate(params, qwen, "cuda", H100, 2000))[0]
    fp8 = estimate({**params, "quantization": "fp8_per_tensor"}, qwen, "cuda", H100, 2000)
    assert fp8.weights_bytes == qwen.weights_bytes // 2 and memory_problems(fp8) == []
    mixture = replace(qwen, expert_bytes=40 * GIB)
    int8 = per_gpu(mixture, {"quantization": "experts_int8"})
    assert (int8.weights_bytes, int8.expert_bytes) == (qwen.weights_bytes - 20 * GIB, 20 * GIB)
    assert per_gpu(qwen, {"quantization": "awq"}).weights_bytes == qwen.weights_bytes  # the checkpoint's own format


def test_decode_context_parallel_ranks_each_keep_a_share_of_the_sequence():
    """vLLM's FullAttentionSpec.max_memory_usage_bytes: cdiv(max_model_len, decode_context_parallel_size) tokens."""
    qwen = model_info({**QWEN3_32B, "num_key_value_heads": 4}, "m")  # vLLM's dcp needs tp / kv heads >= dcp
    params = {"max_model_len": 40960, "tensor_parallel_size": 8}
    one = estimate(params, qwen, "cuda", H100, 2000).kv_one_sequence_bytes
    assert estimate({**params, "decode_context_parallel_size": 2}, qwen, "cuda", H100, 2000).kv_one_sequence_bytes \
        == one // 2
