"""The baseline is what `vllm serve` runs: trials are built under the deployment's usage context, vLLM's batch
defaults per GPU are copied exactly, the CUDA space holds them, and the output names whose defaults it beat."""

import pytest

from optimizer.config.settings import IntRange, SpaceSpec
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.decision.report import summary_text
from optimizer.params.deploy import GIB, batch_defaults
from optimizer.params.space import resolve
from tests.support import synthetic

GPUS = [("NVIDIA H100 80GB HBM3", 80 * GIB), ("NVIDIA H200", 141 * GIB), ("NVIDIA A100-SXM4-80GB", 80 * GIB),
        ("NVIDIA B200", 180 * GIB), ("NVIDIA L4", 24 * GIB), ("NVIDIA L40S", 48 * GIB)]

try:
    import vllm.engine.arg_utils as arg_utils
    from vllm.usage.usage_lib import UsageContext
    VLLM_ERROR = None
except Exception as exc:  # noqa: BLE001 - a broken vLLM install raises more than ImportError
    VLLM_ERROR = f"vLLM not importable: {exc}"
needs_vllm = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")


class GpuPlatform:
    """Only what `EngineArgs.get_batch_defaults` asks of the platform: a GPU's memory and name."""

    def __init__(self, name, memory_bytes):
        self.name, self.memory_bytes = name, memory_bytes

    def get_device_total_memory(self):
        return self.memory_bytes

    def get_device_name(self):
        return self.name

    def is_tpu(self):
        return False

    def is_cpu(self):
        return False


@needs_vllm
@pytest.mark.parametrize("name, memory_bytes", GPUS)
def test_batch_defaults_are_vllms_own(monkeypatch, name, memory_bytes):
    monkeypatch.setattr(arg_utils, "current_platform", GpuPlatform(name, memory_bytes))
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
    for deploy_as, context in (("serve", UsageContext.OPENAI_API_SERVER), ("llm", UsageContext.LLM_CLASS)):
        assert batch_defaults(deploy_as, "cuda", memory_bytes, name) == (seqs[context], tokens[context])
    assert UsageContext.ENGINE_CONTEXT not in seqs  # what trials were built under: the scheduler's 128 and 2048


@needs_vllm
@pytest.mark.parametrize("world_size", [1, 2])
def test_cpu_batch_defaults_are_vllms_own(world_size):
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size=world_size)  # this machine: the CPU platform
    assert batch_defaults("serve", "cpu", world_size=world_size) == (seqs[UsageContext.OPENAI_API_SERVER],
                                                                     tokens[UsageContext.OPENAI_API_SERVER])


@pytest.mark.parametrize("name, memory_bytes", GPUS)
def test_the_cuda_space_holds_what_vllm_serve_runs_on_every_gpu(name, memory_bytes):
    dists = resolve(SpaceSpec(), "cuda", 8192, WorkloadSpec()).dists
    seqs, tokens = batch_defaults("serve", "cuda", memory_bytes, name)
    for param, value in (("max_num_seqs", seqs), ("max_num_batched_tokens", tokens)):
        dist = dists[param]
        assert isinstance(dist, IntRange) and dist.low <= value <= dist.high, (param, value)


@needs_vllm
def test_trials_are_built_as_vllm_serve_builds_them(tiny_model):
    """On the CPU build the contexts differ once there are two workers: `vllm serve` gets 128 x 2 sequences and
    2048 x 2 tokens, the engine context the scheduler's 128 and 2048. A trial's config is `vllm serve`'s."""
    from optimizer.engines.vllm_engine import VllmEngine, resolved_config
    from tests.support.serve_parser import parse_serve

    params = {"tensor_parallel_size": 2, "enforce_eager": True}
    trial = resolved_config(VllmEngine({"model": str(tiny_model)}).engine_config(params))
    ns = parse_serve([str(tiny_model), "--tensor-parallel-size", "2", "--enforce-eager", "--skip-tokenizer-init"])
    served = resolved_config(arg_utils.AsyncEngineArgs.from_cli_args(ns).create_engine_config(
        UsageContext.OPENAI_API_SERVER))
    assert (trial["max_num_seqs"], trial["max_num_batched_tokens"]) == \
        (served["max_num_seqs"], served["max_num_batched_tokens"]) == batch_defaults("serve", "cpu", world_size=2)
    engine_context = resolved_config(arg_utils.AsyncEngineArgs(model=str(tiny_model), skip_tokenizer_init=True,
                                                               **params).create_engine_config())
    assert engine_context["max_num_seqs"] == 128  # the old baseline: not what `vllm serve` runs


def test_the_output_names_whose_defaults_the_baseline_is(tmp_path):
    study, config = synthetic.build(tmp_path)
    text = summary_text(study, config)
    assert "vLLM defaults (vllm serve)" in text and "gain over vLLM's defaults (vllm serve): +83.3%" in text
    text = summary_text(study, config.model_copy(update={"deploy_as": "llm"}))
    assert "vLLM defaults (vllm.LLM)" in text


def test_the_simulated_gpu_baseline_is_what_vllm_serve_runs():
    from optimizer.engines.simulated import SimulatedEngine
    from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info

    info = model_info(DEFAULT_MODEL_CONFIG, "sim")
    h100 = SimulatedEngine(info, device="cuda", device_memory_bytes=80 * GIB, max_memory_fraction=0.95).resolve({})
    l4 = SimulatedEngine(info, device="cuda", device_memory_bytes=24 * GIB, max_memory_fraction=0.95).resolve({})
    assert (h100["max_num_seqs"], h100["max_num_batched_tokens"]) == (1024, 8192)
    assert (l4["max_num_seqs"], l4["max_num_batched_tokens"]) == (256, 2048)


def test_deploy_as_is_a_flag_stored_with_the_study_and_part_of_what_it_measures(tmp_path):
    from optimizer.cli.run import build_parser, resolve_config

    ns = build_parser().parse_args(["--ttft-p99", "150ms", "--studies-dir", str(tmp_path)])
    assert resolve_config(ns)[0].deploy_as == "serve"  # vllm serve unless told otherwise
    ns = build_parser().parse_args(["--ttft-p99", "150ms", "--deploy-as", "llm", "--studies-dir", str(tmp_path)])
    config = resolve_config(ns)[0]
    assert config.deploy_as == "llm" and config.identity()["deploy_as"] == "llm"
