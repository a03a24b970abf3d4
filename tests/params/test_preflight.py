"""The memory estimate on hand-computed numbers; memory another process holds.

The sampler learning to avoid an infeasible region is in tests/search/test_study.py (the study's own sampler)."""

import asyncio
from dataclasses import replace

import optuna
import pytest

from optimizer.config.model import ModelInfo
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.errors import OptimizerError
from tests.support.fake_engine import FakeEngine
from optimizer.params.preflight import (
    GIB, DeviceMemory, DeviceMemoryHeldError, estimate, held_elsewhere, memory_problems, wait_for_memory,
)
from optimizer.search.runner import prepare

# 2 layers x 4 KV heads x 64 dims x 2 bytes x (K and V) = 2048 bytes per token
MODEL = ModelInfo(path="m", vocab_size=1000, max_len=4096, num_layers=2, num_kv_heads=4, head_dim=64,
                  dtype_bytes=2, weights_bytes=1 * GIB)
MEM = DeviceMemory(total_bytes=10 * GIB, available_bytes=8 * GIB)


def test_kv_bytes_per_token():
    assert MODEL.kv_bytes_per_token == 2048


def test_fitting_config_has_no_problems():
    est = estimate({"gpu_memory_utilization": 0.5, "max_model_len": 4096}, MODEL, "cuda", MEM, 1024)
    assert est.requested_bytes == 5 * GIB
    assert est.kv_budget_bytes == 5 * GIB - 1 * GIB  # weights; no batch sizes, no runtime reserve counted
    assert est.kv_one_sequence_bytes == 2048 * 4096
    assert est.sequences_that_fit == pytest.approx(4 * GIB / (2048 * 1024))
    assert memory_problems(est) == []


def test_the_gpu_runtime_reserve_is_what_vllm_s_profiling_counts_at_least():
    """vLLM 0.32's start on a GPU (gpu_reserve_bytes): the V2 runner's sampler state (max_num_seqs x vocab int32
    counts, two bitmasks of a bit per token) and the profile run's larger peak, a dense MLP's residual and output over
    max_num_batched_tokens tokens or the logits of a row a sequence (2 bytes each); the V1 runner has no sampler state,
    and its logits' float32 copy beside them."""
    model = replace(MODEL, hidden_size=128, mlp_size=512)
    batch = {"gpu_memory_utilization": 0.5, "max_num_seqs": 256, "max_num_batched_tokens": 2048}
    state, mlp = 4 * 256 * 1000 + 2 * 4 * 256 * 32, 2 * 2048 * (128 + 512)  # ceil(1000 / 32) words a row
    logits = 2 * (2048 + 256) * 128 + 2 * 256 * 1000  # the last hidden states and 256 rows of logits
    est = estimate(batch, model, "cuda", MEM, 1024)
    assert est.reserve_bytes == state + mlp and mlp > logits
    assert est.kv_budget_bytes == 5 * GIB - 1 * GIB - est.reserve_bytes
    v1 = estimate(batch, model, "cuda", MEM, 1024, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert v1.reserve_bytes == mlp > logits + 4 * 256 * 1000
    assert estimate({**batch, "tensor_parallel_size": 2}, model, "cuda", MEM, 1024).reserve_bytes == \
        state + mlp // 2  # the MLP's share; every rank gathers the whole vocabulary's logits and keeps the counts
    # a mixture (no dense MLP counted): the logits peak, with their float32 copy on the V1 runner
    mixture = replace(model, mlp_size=0)
    assert estimate(batch, mixture, "cuda", MEM, 1024).reserve_bytes == state + logits
    assert estimate(batch, mixture, "cuda", MEM, 1024, {"VLLM_USE_V2_MODEL_RUNNER": "0"}).reserve_bytes == \
        logits + 4 * 256 * 1000
    # speculative decoding: the V2 runner uncertain, the draft's 1 + 3 queries a sequence left out of the tokens
    spec = {**batch, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    rest = 2048 - 256 * 4
    assert estimate(spec, model, "cuda", MEM, 1024).reserve_bytes == min(
        state + 2 * rest * (128 + 512), 2 * (rest + 256) * 128 + (2 + 4) * 256 * 1000)
    # a pipeline: the sampler and logits are the last stage's, whose layers may be fewer: the MLP's peak alone
    assert estimate({**batch, "pipeline_parallel_size": 2}, model, "cuda", MEM, 1024).reserve_bytes == mlp
    assert estimate({**batch, "convert": "embed"}, model, "cuda", MEM, 1024).reserve_bytes == mlp  # a pooler
    # prefill context parallelism: each rank runs its share of the tokens
    assert estimate({**batch, "prefill_context_parallel_size": 2}, model, "cuda", MEM, 1024).reserve_bytes == \
        state + mlp // 2
    assert estimate(batch, model, "cpu", MEM, 1024).reserve_bytes == int(0.6 * GIB)  # measured on the CPU build


def test_more_than_is_free_is_rejected_with_the_fix():
    problems = memory_problems(estimate({"gpu_memory_utilization": 0.9}, MODEL, "cuda", MEM, 1024))
    assert len(problems) == 1 and "only 8.00 GiB are free: lower it" in problems[0]


def test_no_room_for_kv_cache():
    problems = memory_problems(estimate({"gpu_memory_utilization": 0.1}, MODEL, "cuda", MEM, 1024))
    assert problems and "no room for the KV cache" in problems[0]


def test_one_sequence_must_fit():
    big = ModelInfo(**{**MODEL.__dict__, "num_layers": 2000})  # 2 MB per token
    problems = memory_problems(estimate({"gpu_memory_utilization": 0.5, "max_model_len": 4096}, big, "cuda", MEM,
                                        512))
    assert problems and "lower max_model_len" in problems[0]


def test_cpu_keeps_headroom_for_the_rest_of_the_machine():
    mem = DeviceMemory(total_bytes=24 * GIB, available_bytes=22 * GIB)
    # vLLM's default 0.92 of 24 GiB = 22.08 GiB: more than is free once 2.4 GiB stay for everything else
    problems = memory_problems(estimate({}, MODEL, "cpu", mem, 256))
    assert problems and "keeping 2.40 GiB for the rest of the machine" in problems[0]
    assert memory_problems(estimate({"gpu_memory_utilization": 0.5}, MODEL, "cpu", mem, 256)) == []


# Memory another process holds: wait for it, or stop the run; never a false out-of-memory.

def test_held_elsewhere_when_it_fitted_in_the_most_memory_seen_free():
    est = estimate({"gpu_memory_utilization": 0.5}, MODEL, "cuda", DeviceMemory(10 * GIB, 3 * GIB), 1024)
    assert memory_problems(est)  # 5 GiB asked, 3 GiB free now
    assert held_elsewhere(est, 8 * GIB, 10 * GIB)  # it fits in the 8 GiB that were free earlier
    assert not held_elsewhere(est, 4 * GIB, 10 * GIB)  # it never fitted: a real out-of-memory


def test_a_small_drift_of_free_memory_is_not_held_memory():
    est = estimate({"gpu_memory_utilization": 0.5}, MODEL, "cuda", DeviceMemory(10 * GIB, int(4.5 * GIB)), 1024)
    assert memory_problems(est) and not held_elsewhere(est, int(5.4 * GIB), 10 * GIB)  # 0.9 GiB < 1 GiB
    assert held_elsewhere(est, int(5.5 * GIB), 10 * GIB)  # exactly 1 GiB gone


class ScriptedClock:
    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    async def sleep_until(self, t):
        self.t = max(self.t, t)


def scripted_probe(*free_gib):
    seen = []

    def probe():
        seen.append(free_gib[min(len(seen), len(free_gib) - 1)])
        return DeviceMemory(10 * GIB, int(seen[-1] * GIB))

    return probe, seen


def test_wait_for_memory_returns_once_it_is_free():
    probe, seen = scripted_probe(3, 3, 8)
    clock = ScriptedClock()
    mem = asyncio.run(wait_for_memory(probe, lambda m: m.available_bytes >= 5 * GIB, clock, timeout_s=60,
                                      interval_s=2, needed_bytes=5 * GIB, most_free_bytes=8 * GIB))
    assert mem.available_bytes == 8 * GIB and seen == [3, 3, 8] and clock.t == 6.0


def test_memory_held_past_the_timeout_stops_the_run_with_the_fix():
    probe, seen = scripted_probe(3)
    clock = ScriptedClock()
    with pytest.raises(DeviceMemoryHeldError) as err:
        asyncio.run(wait_for_memory(probe, lambda m: m.available_bytes >= 5 * GIB, clock, timeout_s=10,
                                    interval_s=2, needed_bytes=5 * GIB, most_free_bytes=8 * GIB))
    assert len(seen) == 5 and clock.t == 10.0
    assert isinstance(err.value, OptimizerError) and err.value.exit_code == 1
    text = str(err.value)
    assert "needs 5.00 GiB" in text and "8.00 GiB were free" in text and "only 3.00 GiB are free" in text
    assert "run the same command again to resume" in text


@pytest.fixture
def objective(tmp_path, config_only_model):
    """The study's Objective (fake engine, cuda memory rules) with a scripted memory probe set per test."""
    config = StudyConfig(study_name="m", storage_url=f"sqlite:///{tmp_path}/m.db", ttft_p99_ms=30.0, budget=2,
                         model=str(config_only_model), dummy_weights=True, device="cuda",
                         workload=WorkloadSpec(num_requests=10, warmup_requests=0, input_len_min=16,
                                               input_len_max=32, output_len_min=2, output_len_max=4))
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=FakeEngine, memory_probe=lambda: None)
    obj = prepared.objective
    obj.model, obj.clock, obj.memory_wait_s, obj.memory_poll_s = MODEL, ScriptedClock(), 10.0, 2.0
    return obj, prepared.study


def preflight(obj, study, params):
    trial = study.ask()
    out = asyncio.run(obj._preflight(trial, FakeEngine(), params, obj.logs_dir / "t.log"))
    return out, trial


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_a_trial_waits_for_memory_an_earlier_trial_still_holds(objective):
    obj, study = objective
    obj.memory_probe, seen = scripted_probe(8, 3, 3, 8)
    preflight(obj, study, {"gpu_memory_utilization": 0.5})  # the first trial sees 8 GiB free
    params, trial = preflight(obj, study, {"gpu_memory_utilization": 0.5})  # then 3, 3, 8: it waits, then runs
    assert params == {"gpu_memory_utilization": 0.5} and seen == [8, 3, 3, 8]
    assert trial.user_attrs["memory_waited_for"] and trial.user_attrs["memory_estimate_gib"]["available_bytes"] == 8


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_held_memory_that_stays_held_ends_the_run_not_the_config(objective):
    obj, study = objective
    obj.memory_probe, _ = scripted_probe(8, 3)
    preflight(obj, study, {"gpu_memory_utilization": 0.5})
    with pytest.raises(DeviceMemoryHeldError):
        preflight(obj, study, {"gpu_memory_utilization": 0.5})


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_a_config_larger_than_ever_free_is_still_out_of_memory_at_once(objective):
    obj, study = objective
    obj.memory_probe, seen = scripted_probe(8)
    with pytest.raises(optuna.TrialPruned, match="out_of_memory"):
        preflight(obj, study, {"gpu_memory_utilization": 0.9})  # 9 GiB: more than was ever free
    assert seen == [8] and obj.clock.t == 0.0  # no waiting


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_a_layout_is_judged_on_the_gpus_its_ranks_use(objective):
    # two visible GPUs of 10 GiB; another job holds 7 GiB of the second. A one-GPU config (vLLM puts it on cuda:0)
    # fits in the first's 8 GiB free; one over both GPUs (tensor parallel 2) needs 5 GiB on each, and the second
    # has 3: out of memory at once (no waiting: 3 GiB is all the second was ever seen to have)
    obj, study = objective
    obj.gpu_count = 2
    obj.memory_probe = lambda: DeviceMemory(10 * GIB, 3 * GIB, ((10 * GIB, 8 * GIB), (10 * GIB, 3 * GIB)))
    params, trial = preflight(obj, study, {"gpu_memory_utilization": 0.5})
    assert params == {"gpu_memory_utilization": 0.5}
    assert trial.user_attrs["memory_estimate_gib"]["available_bytes"] == 8
    with pytest.raises(optuna.TrialPruned, match="out_of_memory"):
        preflight(obj, study, {"gpu_memory_utilization": 0.5, "tensor_parallel_size": 2})
    assert obj.clock.t == 0.0


def test_the_memory_of_a_layout_is_its_gpus_smallest():
    mem = DeviceMemory(40 * GIB, 2 * GIB, ((80 * GIB, 70 * GIB), (80 * GIB, 60 * GIB), (40 * GIB, 2 * GIB)))
    assert mem.for_gpus(1) == DeviceMemory(80 * GIB, 70 * GIB, mem.per_gpu)
    assert mem.for_gpus(2) == DeviceMemory(80 * GIB, 60 * GIB, mem.per_gpu)
    assert mem.for_gpus(3) == mem.for_gpus(8) == DeviceMemory(40 * GIB, 2 * GIB, mem.per_gpu)
    assert MEM.for_gpus(4) is MEM  # the CPU's memory, or GPUs not read one by one


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_cpu_defaults_that_fit_at_no_memory_fraction_cost_no_start(objective):
    """On the CPU build vLLM's defaults fall back to a smaller memory fraction where 0.92 does not fit beside the
    machine's other processes; where the model does not fit at that fraction either, the baseline is pruned before
    any start, with the fallback's reason."""
    from optimizer.search.attrs import BASELINE, ENGINE_PARAMS, PRUNED_DETAIL, PRUNED_REASON

    obj, study = objective
    obj.config = obj.config.model_copy(update={"device": "cpu"})
    obj.memory_probe, _ = scripted_probe(10)
    trial = study.ask()
    BASELINE.set(trial, True)
    params = asyncio.run(obj._preflight(trial, FakeEngine(), {}, obj.logs_dir / "t.log"))
    assert params["gpu_memory_utilization"] == 0.2  # the small model fits at the fallback
    assert ENGINE_PARAMS.of(study.trials[-1]) == params
    obj.model = replace(MODEL, weights_bytes=30 * GIB)  # a model larger than the machine
    trial = study.ask()
    BASELINE.set(trial, True)
    with pytest.raises(optuna.TrialPruned):
        asyncio.run(obj._preflight(trial, FakeEngine(), {}, obj.logs_dir / "t.log"))
    pruned = study.trials[-1]
    assert PRUNED_REASON.of(pruned) == "out_of_memory"
    assert "leave no room for the KV cache in 2.00 GiB" in PRUNED_DETAIL.of(pruned)  # 0.2 of its 10 GiB
