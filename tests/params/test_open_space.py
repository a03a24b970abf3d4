"""An open space: any EngineArgs field may be searched, checked against its type before any trial; vLLM's
environment variables as `env:NAME`; the CUDA defaults add the GPU knobs; the KV estimate follows kv_cache_dtype;
what was searched is exported."""

import json
import shlex

import pytest
import yaml

from optimizer.config.model import model_info
from optimizer.config.settings import Choice, IntRange, SpaceSpec
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.errors import UsageError
from optimizer.decision.export import export_all, serve_args, serve_launcher
from optimizer.params.open_space import cuda_knobs, split_env
from optimizer.params.parallel import per_gpu
from optimizer.params.preflight import GIB, DeviceMemory, estimate, memory_problems
from optimizer.params.space import parse_space_yaml, resolve
from optimizer.search.confirmed import recommended
from tests.support import synthetic

try:
    import vllm.engine.arg_utils  # noqa: F401
    VLLM_ERROR = None
except Exception as exc:  # noqa: BLE001
    VLLM_ERROR = f"vLLM not importable: {exc}"
needs_vllm = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")


def space(yaml_text):
    return resolve(parse_space_yaml(yaml.safe_load(yaml_text)), "cpu", 2048, WorkloadSpec())


@needs_vllm
def test_any_engine_argument_may_be_searched_by_its_type():
    s = space("tensor_parallel_size: [1, 2]\nkv_cache_dtype: [auto, fp8]\nasync_scheduling: [true, false]\n"
              "max_cudagraph_capture_size: {min: 64, max: 512, log: true}\n"
              "cudagraph_capture_sizes: [[1, 2, 4], [1, 2, 4, 8, 16]]\nenv:VLLM_USE_FLASHINFER_SAMPLER: ['0', '1']\n")
    assert s.dists["kv_cache_dtype"] == Choice(choices=["auto", "fp8"])
    assert isinstance(s.dists["max_cudagraph_capture_size"], IntRange)
    assert "env:VLLM_USE_FLASHINFER_SAMPLER" in s.dists


@needs_vllm
@pytest.mark.parametrize("text, message", [
    ("kv_cache_dtype: [auto, fp7]\n", "choice 'fp7' is not of that type"),
    ("enable_expert_parallel: {min: 0, max: 1}\n", "a min/max range needs an int or float field"),
    ("tensor_parallel_size: [1, 2.5]\n", "choice 2.5 is not of that type"),
    ("max_num_partial_prefills: [1, 2]\n", "unknown parameter 'max_num_partial_prefills'"),  # gone in vLLM 0.32
    ("env:VLLM_NO_SUCH_THING: ['1']\n", "not an environment variable vLLM reads"),
    ("env:VLLM_USE_FLASHINFER_SAMPLER: {min: 0, max: 1}\n", "takes choices"),
])
def test_a_space_that_does_not_fit_the_types_is_refused_with_the_fix(text, message):
    with pytest.raises(UsageError, match=message):
        space(text)


def test_env_entries_are_the_engines_environment_not_its_arguments():
    engine, env = split_env({"max_num_seqs": 8, "env:VLLM_USE_FLASHINFER_SAMPLER": "1", "env:X": True})
    assert engine == {"max_num_seqs": 8} and env == {"VLLM_USE_FLASHINFER_SAMPLER": "1", "X": "1"}


def test_the_cuda_defaults_add_the_gpu_knobs_and_nothing_lossy():
    # fp8 KV cache changes the outputs: only a space that names it searches it (it was added on compute 8.9+)
    assert cuda_knobs() == {"async_scheduling": Choice(choices=[True, False]),
                            "max_cudagraph_capture_size": Choice(choices=[128, 256, 512])}
    dists = resolve(SpaceSpec(), "cuda", 8192, WorkloadSpec()).dists
    assert "async_scheduling" in dists and "max_cudagraph_capture_size" in dists and "kv_cache_dtype" not in dists
    # eager mode captures no CUDA graph (vLLM sets the size to 0): its size is not searched
    eager = resolve(SpaceSpec(), "cuda", 8192, WorkloadSpec(), engine_args={"enforce_eager": True}).dists
    assert "max_cudagraph_capture_size" not in eager and "async_scheduling" in eager
    fixed = resolve(SpaceSpec(fixed={"enforce_eager": True}), "cuda", 8192, WorkloadSpec()).dists
    assert "max_cudagraph_capture_size" not in fixed


def test_an_mla_model_leaves_the_block_size_to_vllm():
    # FlashMLA takes 64, CUTLASS MLA 128: a size set by hand turns away the MLA kernels that do not take it
    for device in ("cuda", "cpu"):
        assert "block_size" in resolve(SpaceSpec(), device, 8192, WorkloadSpec()).dists
        assert "block_size" not in resolve(SpaceSpec(), device, 8192, WorkloadSpec(), mla=True).dists
    asked = SpaceSpec(ranges={"block_size": Choice(choices=[64])})  # a space that names it still searches it
    assert resolve(asked, "cuda", 8192, WorkloadSpec(), mla=True).dists["block_size"] == Choice(choices=[64])


def test_the_kv_estimate_follows_kv_cache_dtype():
    model = model_info({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}, "llama-8b",
                       weights_bytes=16_060_522_496)
    assert per_gpu(model, {"kv_cache_dtype": "fp8"}).kv_bytes_per_token == model.kv_bytes_per_token // 2
    memory = DeviceMemory(80 * GIB, 80 * GIB)
    auto = estimate({"gpu_memory_utilization": 0.9}, model, "cuda", memory, 500)
    fp8 = estimate({"gpu_memory_utilization": 0.9, "kv_cache_dtype": "fp8"}, model, "cuda", memory, 500)
    assert fp8.sequences_that_fit == pytest.approx(2 * auto.sequences_that_fit)
    # a packed dtype the table has no size for (vLLM's nvfp4): its KV cache goes unchecked, not costed at bf16,
    # which refused a max_model_len that fits; the weights are still checked
    long = {"gpu_memory_utilization": 0.35, "max_model_len": 131072}  # 28 GiB: 10.5 left past weights and runtime
    assert memory_problems(estimate(long, model, "cuda", memory, 500))  # bf16: 16 GiB for one sequence
    assert memory_problems(estimate({**long, "kv_cache_dtype": "nvfp4"}, model, "cuda", memory, 500)) == []
    assert memory_problems(estimate({"gpu_memory_utilization": 0.1, "kv_cache_dtype": "nvfp4"}, model, "cuda",
                                    DeviceMemory(16 * GIB, 16 * GIB), 500))  # 1.6 GiB: not the 16.5 GiB of weights


def test_what_was_searched_beyond_the_defaults_is_exported(tmp_path):
    study, config = synthetic.build(tmp_path, device="cuda")
    trial = recommended(study)
    ran = {"max_num_seqs": 128, "kv_cache_dtype": "fp8", "async_scheduling": False,
           "env:VLLM_USE_FLASHINFER_SAMPLER": "1"}
    trial.user_attrs["engine_params"] = ran
    args = serve_args(trial, config, config.model)
    assert args["kv_cache_dtype"] == "fp8" and args["async_scheduling"] is False
    assert not any(k.startswith("env:") for k in args)
    done = export_all(trial, config, tmp_path / "out", config.model)
    assert done.command.startswith(f"VLLM_USE_FLASHINFER_SAMPLER=1 {shlex.join(serve_launcher())} ")
    assert done.config_command == f"VLLM_USE_FLASHINFER_SAMPLER=1 {shlex.join(serve_launcher())} --config " \
                                  f"{shlex.quote(str(done.yaml_path))}"  # the YAML holds no environment
    assert "no-async-scheduling" in yaml.safe_load(done.yaml_path.read_text())
    header = "# Environment (set before starting the server): VLLM_USE_FLASHINFER_SAMPLER=1."
    assert header in done.yaml_path.read_text()
    compose = yaml.safe_load(done.compose_path.read_text())["services"]["vllm"]
    assert compose["environment"] == ["VLLM_USE_FLASHINFER_SAMPLER=1", "VLLM_API_KEY"]  # the API key passed through
    assert json.loads(done.json_path.read_text())["metadata"]["environment"] == {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
