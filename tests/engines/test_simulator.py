"""The simulator's scheduler and virtual-time replay, checked by hand against vLLM V1's scheduling rules."""

import asyncio

import pytest

from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.errors import EngineStartError, UsageError
from optimizer.engines.sim.scheduler import Scheduler, SchedulerConfig
from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.engines.sim.virtual import simulate
from optimizer.engines.simulated import SimulatedEngine
from optimizer.measurement.metrics import summarize
from optimizer.measurement.replay import replay
from optimizer.measurement.workload import Request, build_workload

# step = 1 s + 0.01 s per prefill token + 0.1 s per decode sequence + 0.001 s per context token: easy to add up
MODEL = StepTimeModel(fixed_s=1.0, prefill_token_s=0.01, decode_seq_s=0.1, context_token_s=0.001)
BIG = dict(max_num_seqs=8, max_num_batched_tokens=4096, block_size=16, num_kv_blocks=1000)


def req(index: int, input_len: int, output_len: int, first_token: int = 1000) -> Request:
    return Request(index=index, prompt_token_ids=tuple(range(first_token, first_token + input_len)),
                   output_len=output_len, unit_arrival_s=0.0)


def cfg(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{**BIG, **kw})


def test_one_request_prefill_then_decode_steps():
    r = simulate([req(0, 100, 3)], [0.0], cfg(), MODEL)
    rec = r.records[0]
    prefill = 1.0 + 0.01 * 100  # 2.0 s, and the first token comes with it
    decode1 = 1.0 + 0.1 + 0.001 * 100  # 1.2 s: context of 100 tokens
    decode2 = 1.0 + 0.1 + 0.001 * 101  # 1.201 s
    assert rec.first_token_s == pytest.approx(prefill)
    assert rec.chunk_times_s == pytest.approx([prefill, prefill + decode1, prefill + decode1 + decode2])
    assert rec.output_tokens == 3 and rec.ok
    assert r.duration_s == pytest.approx(prefill + decode1 + decode2)


def test_max_num_seqs_queues_the_second_request():
    r = simulate([req(0, 10, 2), req(1, 10, 2, first_token=5000)], [0.0, 0.0], cfg(max_num_seqs=1), MODEL)
    a, b = r.records
    first_done = (1.0 + 0.1) + (1.0 + 0.1 + 0.01)  # prefill of 10, one decode with context 10
    assert a.finish_s == pytest.approx(first_done)
    assert b.first_token_s == pytest.approx(first_done + 1.1)  # waited for a, then its own prefill
    assert r.stats.peak_running == 1 and r.stats.peak_waiting == 1


def test_chunked_prefill_splits_a_prompt_over_steps_and_decodes_alongside():
    r = simulate([req(0, 300, 1)], [0.0], cfg(max_num_batched_tokens=128), MODEL)
    # 128 + 128 + 44 prompt tokens; the context grows by the chunks already computed
    expected = (1 + 1.28) + (1 + 1.28 + 0.128) + (1 + 0.44 + 0.256)
    assert r.records[0].first_token_s == pytest.approx(expected)
    assert r.stats.steps == 3


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    c = cfg(max_num_batched_tokens=256, enable_chunked_prefill=False)
    r = simulate([req(0, 200, 1), req(1, 200, 1, first_token=5000)], [0.0, 0.0], c, MODEL)
    a, b = r.records
    assert a.first_token_s == pytest.approx(3.0)  # alone: 200 tokens
    assert b.first_token_s == pytest.approx(6.0)  # did not fit beside it: the next step
    chunked = simulate([req(0, 200, 1), req(1, 200, 1, first_token=5000)], [0.0, 0.0],
                       cfg(max_num_batched_tokens=256), MODEL)
    # with chunking the first 56 tokens of b ride along in the first step: a is later, b is computed in 2 steps
    assert chunked.records[0].first_token_s == pytest.approx(1 + 2.56)
    assert chunked.records[1].first_token_s == pytest.approx(1 + 2.56 + 1 + 1.44 + 0.056)


def test_long_prefill_token_threshold_caps_a_request_per_step_while_others_wait():
    c = cfg(long_prefill_token_threshold=64)
    r = simulate([req(0, 200, 1), req(1, 8, 1, first_token=5000)], [0.0, 0.0], c, MODEL)
    # step 1: 64 of A (capped: B is there too) + 8 of B; step 2: A alone takes its other 136 (no one to starve)
    assert r.stats.steps == 2
    assert r.records[1].first_token_s == pytest.approx(1 + 0.72)
    assert r.records[0].first_token_s == pytest.approx(1 + 0.72 + 1 + 1.36 + 0.064)
    alone = simulate([req(0, 200, 1)], [0.0], c, MODEL)
    assert alone.stats.steps == 1


def test_full_kv_cache_preempts_and_every_request_still_gets_all_its_tokens():
    requests = [req(i, 40, 30, first_token=1000 * (i + 1)) for i in range(6)]
    # 6 x (40 + 30) tokens need 6 x 5 blocks of 16; 12 blocks hold at most two such sequences
    r = simulate(requests, [0.0] * 6, cfg(num_kv_blocks=12), MODEL)
    assert r.stats.preemptions > 0
    assert [x.output_tokens for x in r.records] == [30] * 6 and all(x.ok for x in r.records)
    roomy = simulate(requests, [0.0] * 6, cfg(), MODEL)
    assert roomy.stats.preemptions == 0
    assert summarize(roomy.records, float("inf")).output_throughput_tok_s > \
        summarize(r.records, float("inf")).output_throughput_tok_s


def test_a_request_larger_than_the_whole_cache_fails_alone():
    r = simulate([req(0, 100, 2), req(1, 10, 2, first_token=9000)], [0.0, 0.0], cfg(num_kv_blocks=4), MODEL)
    assert not r.records[0].ok and "KV cache" in r.records[0].error
    assert r.records[1].ok


def test_prefix_cache_hits_whole_blocks_and_reset_forgets_them():
    sched = Scheduler(cfg())
    first = simulate([req(0, 100, 1)], [0.0], sched.config, MODEL, sched)
    again = simulate([req(1, 100, 1)], [0.0], sched.config, MODEL, sched)
    assert sched.stats.prefix_hit_tokens == 96  # six full blocks of 16; the last 4 tokens are computed
    assert again.records[0].first_token_s < first.records[0].first_token_s
    sched.reset_prefix_cache()
    cold = simulate([req(2, 100, 1)], [0.0], sched.config, MODEL, sched)
    assert cold.records[0].first_token_s == pytest.approx(first.records[0].first_token_s)
    assert sched.stats.prefix_hit_tokens == 96
    off = Scheduler(cfg(enable_prefix_caching=False))
    simulate([req(0, 100, 1)], [0.0], off.config, MODEL, off)
    simulate([req(1, 100, 1)], [0.0], off.config, MODEL, off)
    assert off.stats.prefix_hit_tokens == 0


def test_idle_engine_waits_for_the_next_arrival():
    r = simulate([req(0, 10, 1), req(1, 10, 1, first_token=5000)], [0.0, 100.0], cfg(), MODEL)
    assert r.records[1].ttft_s == pytest.approx(1.1)  # arrived at 100 s to an idle engine


def test_more_sequences_per_step_serve_more_under_load():
    w = build_workload(WorkloadSpec(num_requests=200, input_len_min=32, input_len_max=256, output_len_min=16,
                                    output_len_max=64), 16000)
    real_like = StepTimeModel()
    def tput(seqs):
        return summarize(simulate(w.requests, w.arrivals_s(float("inf")), cfg(max_num_seqs=seqs,
                                                                                num_kv_blocks=10000),
                                  real_like).records, float("inf")).output_throughput_tok_s
    assert tput(32) > 2 * tput(2)


# -- the engine -------------------------------------------------------------------------------------------

def sim_engine(**kw) -> SimulatedEngine:
    return SimulatedEngine(model_info(DEFAULT_MODEL_CONFIG, "sim"), **kw)


def test_engine_resolves_vllm_defaults_and_kv_blocks_from_memory():
    resolved = sim_engine().resolve({"gpu_memory_utilization": 0.3})
    assert resolved["max_num_seqs"] == 128 and resolved["block_size"] == 128
    info = model_info(DEFAULT_MODEL_CONFIG, "sim")
    kv = 0.3 * 24 * 1024**3 - info.weights_bytes - 0.6 * 1024**3
    assert resolved["num_kv_blocks"] == int(kv // (info.kv_bytes_per_token * 128))


def test_engine_takes_the_defaults_of_its_deployment_on_its_gpu():
    # vLLM 0.32's get_batch_defaults (optimizer/params/deploy.py): 80 GB on an H100 is 1024 sequences, on an A100
    # 256; `vllm serve` 8192 batched tokens, vllm.LLM 16384; on the CPU, vllm.LLM 256 and 4096
    h100 = sim_engine(device="cuda", device_memory_bytes=80 * 1024**3, device_name="NVIDIA H100 80GB HBM3")
    a100 = sim_engine(device="cuda", device_memory_bytes=80 * 1024**3, device_name="NVIDIA A100-SXM4-80GB")
    llm = sim_engine(device="cuda", device_memory_bytes=80 * 1024**3, device_name="NVIDIA H100 80GB HBM3",
                     deploy_as="llm")
    fit = {"gpu_memory_utilization": 0.9}
    picked = [(e.resolve(fit)["max_num_seqs"], e.resolve(fit)["max_num_batched_tokens"]) for e in (h100, a100, llm)]
    assert picked == [(1024, 8192), (256, 2048), (1024, 16384)]
    cpu_llm = sim_engine(deploy_as="llm").resolve({"gpu_memory_utilization": 0.3})
    assert (cpu_llm["max_num_seqs"], cpu_llm["max_num_batched_tokens"]) == (256, 4096)


def test_engine_refuses_what_vllm_refuses():
    with pytest.raises(EngineStartError, match="max_num_batched_tokens"):
        sim_engine().resolve({"max_num_seqs": 64, "max_num_batched_tokens": 32})
    with pytest.raises(EngineStartError) as err:
        sim_engine().resolve({"gpu_memory_utilization": 0.001})
    assert err.value.reason == "out_of_memory"


def test_replay_uses_virtual_time_and_matches_real_time_generate():
    """The fast path and the real-time path run the same scheduler: same token counts, same order of firsts."""
    w = build_workload(WorkloadSpec(num_requests=12, warmup_requests=0, input_len_min=8, input_len_max=40,
                                    output_len_min=3, output_len_max=6), 16000)
    fast_model = StepTimeModel(fixed_s=0.001, prefill_token_s=1e-6, decode_seq_s=1e-4, context_token_s=0)

    async def run(engine):
        await engine.start({"max_num_seqs": 4, "gpu_memory_utilization": 0.2})
        try:
            return await replay(engine, w.requests, w.arrivals_s(200.0), _NoClock())
        finally:
            await engine.shutdown()

    engine = sim_engine(time_model=fast_model)
    records = asyncio.run(run(engine))
    assert [r.output_tokens for r in records] == [r.output_len for r in w.requests]
    assert engine.virtual_s > fast_model.engine_start_s  # start + replay + shutdown, in modelled seconds


class _NoClock:
    """The virtual-time path must never read or wait on the clock."""

    def now(self):
        raise AssertionError("a simulated replay read the clock")

    async def sleep_until(self, t):
        raise AssertionError("a simulated replay waited")


def test_calibration_file_errors_name_the_fix(tmp_path):
    with pytest.raises(UsageError, match="optimize calibrate"):
        StepTimeModel.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(UsageError, match="optimize calibrate"):
        StepTimeModel.load(bad)
    good = tmp_path / "good.json"
    MODEL.save(good)
    assert StepTimeModel.load(good) == MODEL
