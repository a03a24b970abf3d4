"""Tensor and data parallelism: memory is checked per GPU (a 70B model fits eight 80 GiB H100s at TP=8), every
visible GPU is probed, a layout larger than the host is invalid before any start, and compose reserves its GPUs."""


import pytest
import yaml

from optimizer.config.model import model_info
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
    return model_info(LLAMA_70B, "meta-llama/Meta-Llama-3-70B", weights_bytes=141_107_412_992)  # its files


def test_a_70b_model_fits_eight_h100s_at_tp8_and_not_one(llama70b):
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
    assert per_gpu(llama70b, {"kv_cache_dtype": "fp8"}).kv_bytes_per_token == per_token // 2


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
    H100, which counting the files' bytes rejected. At least half the bytes stay (ONLINE_WEIGHT_SHARE)."""
    qwen = model_info(QWEN3_32B, "Qwen/Qwen3-32B", weights_bytes=65_524_246_528)  # its files
    params = {"gpu_memory_utilization": 0.88, "max_model_len": 40960, "max_num_seqs": 256,
              "max_num_batched_tokens": 2048}
    assert "one max_model_len sequence needs" in memory_problems(estimate(params, qwen, "cuda", H100, 2000))[0]
    fp8 = estimate({**params, "quantization": "fp8_per_tensor"}, qwen, "cuda", H100, 2000)
    assert fp8.weights_bytes == qwen.weights_bytes // 2 and memory_problems(fp8) == []
    assert per_gpu(qwen, {"quantization": "awq"}).weights_bytes == qwen.weights_bytes  # the checkpoint's own format


def test_decode_context_parallel_ranks_each_keep_a_share_of_the_sequence():
    """vLLM's FullAttentionSpec.max_memory_usage_bytes: cdiv(max_model_len, decode_context_parallel_size) tokens."""
    qwen = model_info({**QWEN3_32B, "num_key_value_heads": 4}, "m")  # vLLM's dcp needs tp / kv heads >= dcp
    params = {"max_model_len": 40960, "tensor_parallel_size": 8}
    one = estimate(params, qwen, "cuda", H100, 2000).kv_one_sequence_bytes
    assert estimate({**params, "decode_context_parallel_size": 2}, qwen, "cuda", H100, 2000).kv_one_sequence_bytes \
        == one // 2
