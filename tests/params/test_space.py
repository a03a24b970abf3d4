import optuna
import pytest

from optimizer.config.model import DEMO_LADDER, ModelInfo
from optimizer.config.settings import IntRange
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.errors import UsageError
from optimizer.params.preflight import GIB, DeviceMemory, estimate, memory_problems
from optimizer.params.space import check_constraints, parse_space_yaml, resolve
from optimizer.search.objective import CPU_BASELINE_MEMORY_FALLBACK

WL = WorkloadSpec(input_len_min=10, input_len_max=100, output_len_min=5, output_len_max=28)  # longest 128


def test_vllm_rules_between_parameters():
    assert check_constraints({"max_num_seqs": 64, "max_num_batched_tokens": 32}, 128) == [
        "max_num_batched_tokens (32) must be >= max_num_seqs (64)"]
    msgs = check_constraints({"enable_chunked_prefill": False, "max_num_batched_tokens": 512,
                              "max_model_len": 1024}, 128)
    assert len(msgs) == 1 and "without chunked prefill" in msgs[0]
    assert check_constraints({"enable_chunked_prefill": True, "max_num_batched_tokens": 512,
                              "max_model_len": 1024, "max_num_seqs": 8}, 128) == []
    assert "below the workload" in check_constraints({"max_model_len": 100}, 128)[0]
    assert check_constraints({}, 128) == []  # vLLM's defaults are vLLM's business


def test_default_space_never_puts_max_model_len_below_the_workload():
    space = resolve(parse_space_yaml({}), "cpu", 2048, WL)
    assert space.dists["max_model_len"] == IntRange(low=128, high=2048, log=True)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(30):
        params = space.suggest(study.ask())
        assert 128 <= params["max_model_len"] <= 2048
        assert params["gpu_memory_utilization"] <= 0.94


def test_gpu_defaults_cap_memory_below_095():
    space = resolve(parse_space_yaml({}), "cuda", 4096, WL)
    assert space.dists["gpu_memory_utilization"].high < 0.95


def test_yaml_overrides_ranges_and_fixes_values():
    spec = parse_space_yaml({"max_num_seqs": {"min": 2, "max": 16, "log": True}, "block_size": [16],
                             "enable_prefix_caching": False, "dtype": "bfloat16"})
    space = resolve(spec, "cpu", 2048, WL)
    assert space.dists["max_num_seqs"] == IntRange(low=2, high=16, log=True)
    assert "enable_prefix_caching" not in space.dists
    params = space.suggest(optuna.create_study().ask())
    assert params["enable_prefix_caching"] is False and params["dtype"] == "bfloat16"
    assert params["block_size"] == 16


@pytest.mark.parametrize("data,hint", [
    ({"max_num_sequences": {"min": 1, "max": 4}}, "unknown parameter 'max_num_sequences'"),
    ({"max_num_seqs": {"min": 8, "max": 4}}, "min 8 > max 4"),
    ({"max_num_seqs": {"low": 1, "high": 4}}, "needs 'min' and 'max'"),
    ({"block_size": []}, "empty list"),
    ({"max_model_len": {"min": 64, "max": 512}}, "below the workload's longest request"),
    ({"gpu_memory_utilization": {"min": 0.5, "max": 1.5}}, "(0, 1]"),
])
def test_bad_spaces_say_what_to_fix(data, hint):
    with pytest.raises(UsageError) as err:
        resolve(parse_space_yaml(data), "cpu", 2048, WL)
    assert hint in str(err.value)


def test_workload_longer_than_the_context_is_refused():
    with pytest.raises(UsageError, match="exceeds the model's context"):
        resolve(parse_space_yaml({}), "cpu", 100, WL)


def test_sampled_configs_never_break_vllms_rules():
    space = resolve(parse_space_yaml({}), "cpu", 2048, WL)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen_off = 0
    for _ in range(60):
        params = space.suggest(study.ask())
        assert space.violations(params) == []
        if params["enable_chunked_prefill"] is False:
            seen_off += 1
            assert params["max_num_batched_tokens"] == max(params["max_model_len"], params["max_num_seqs"])
            assert "long_prefill_token_threshold" not in params
        assert params["block_size"] % 32 == 0  # the CPU attention backend's rule
    assert seen_off > 0


@pytest.mark.parametrize("shape", DEMO_LADDER, ids=lambda s: s.name)
def test_cpu_memory_range_starts_the_demo_on_a_small_machine_and_stays_cheap_to_start(shape):
    """On the CPU build every start touches the whole KV cache (3.3-3.9 s per GiB measured: docs/machines.md), so
    the range stays low; its low end must still start every demo model, in float32 at its full context, on an
    8 GiB machine, and on 16 GiB hold 64 of the demo workload's mean sequences (the preflight's own estimate)."""
    space = resolve(parse_space_yaml({}), "cpu", 2048, WL)
    mem = space.dists["gpu_memory_utilization"]
    assert mem.low <= CPU_BASELINE_MEMORY_FALLBACK <= mem.high
    assert mem.high <= 0.3  # ~3.3 GiB at most on the 2-core VMs' 13 GiB node: 13 s of a start
    cfg = shape.config
    model = ModelInfo(path=shape.name, vocab_size=cfg["vocab_size"], max_len=2048, num_layers=cfg["num_hidden_layers"],
                      num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                      head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
                      weights_bytes=2 * 17_000_000).served_as("float32")
    params = {"gpu_memory_utilization": mem.low, "max_model_len": 2048}
    for total_gib, sequences in ((8, 1), (16, 64)):
        est = estimate(params, model, "cpu", DeviceMemory(total_gib * GIB, total_gib * GIB),
                       WorkloadSpec().mean_total_len)
        assert memory_problems(est) == []
        assert est.sequences_that_fit >= sequences
