"""The simulator's injectable noise and drift (optimizer/engines/sim/noise.py), checked by hand."""

import asyncio
import math

import numpy as np
import pytest

from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.engines.sim.noise import NoiseSource, SimNoise, drift_factor, lognormal_factor, scaled
from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.engines.simulated import SimulatedEngine
from optimizer.measurement.noise import coefficient_of_variation
from optimizer.measurement.workload import Request, build_workload

# step = 1 s + 0.01 s per prefill token + ...: one request of 100 prompt tokens alone has a TTFT of 2.0 s
MODEL = StepTimeModel(fixed_s=1.0, prefill_token_s=0.01, decode_seq_s=0.1, context_token_s=0.001,
                      engine_start_s=3600.0, engine_shutdown_s=1800.0)
WORKLOAD = build_workload(WorkloadSpec(num_requests=40, warmup_requests=0, input_len_min=8, input_len_max=200,
                                       output_len_min=3, output_len_max=20), 16000)
FAST = StepTimeModel(fixed_s=0.004, prefill_token_s=2e-5, decode_seq_s=3e-4, context_token_s=1e-7)


def engine(noise=None, time_model=MODEL) -> SimulatedEngine:
    return SimulatedEngine(model_info(DEFAULT_MODEL_CONFIG, "sim"), time_model, noise=noise)


def one_request() -> list[Request]:
    return [Request(index=0, prompt_token_ids=tuple(range(1000, 1100)), output_len=2, unit_arrival_s=0.0)]


def replays(eng: SimulatedEngine, count: int, requests=WORKLOAD.requests, rate_rps: float = 20.0) -> list:
    """Start `eng`, run `count` replays at `rate_rps` in virtual time, shut it down; every replay's records."""
    async def run():
        await eng.start({"max_num_seqs": 8, "gpu_memory_utilization": 0.2})
        out = []
        for _ in range(count):
            await eng.reset_prefix_cache()
            arrivals = WORKLOAD.arrivals_s(rate_rps) if requests is WORKLOAD.requests else [0.0] * len(requests)
            out.append(eng.simulate_replay(requests, arrivals))
        await eng.shutdown()
        return out

    return asyncio.run(run())


def ttfts(records_per_replay: list) -> list[list[float]]:
    return [[r.ttft_s for r in records] for records in records_per_replay]


def test_zero_noise_is_the_deterministic_simulator():
    plain, quiet = engine(), engine(NoiseSource(SimNoise.none()))
    assert replays(quiet, 3) == replays(plain, 3)  # the same records, to the last float
    assert quiet.virtual_s == plain.virtual_s
    noisy = engine(NoiseSource(SimNoise(run_cv=0.1, seed=0)))
    assert replays(noisy, 3) != replays(plain, 3)  # the comparison above is not vacuous


def test_a_seed_gives_the_same_numbers_twice_and_another_seed_others():
    def study(seed: int) -> list[list[list[float]]]:
        source = NoiseSource(SimNoise(run_cv=0.15, replay_cv=0.05, drift_per_hour=0.04, seed=seed))
        return [ttfts(replays(engine(source, FAST), 2)) for _ in range(3)]  # three engines on one source

    first, again, other = study(7), study(7), study(8)
    assert first == again
    assert first != other
    assert first[0] != first[1] and first[0][0] != first[0][1]  # engines differ, and replays of one engine


def test_scaling_multiplies_every_per_step_cost_and_keeps_start_and_shutdown():
    tm = StepTimeModel(fixed_s=1.0, prefill_token_s=0.01, decode_seq_s=0.1, context_token_s=0.001,
                       prefill_attention_s=1e-4, request_s=0.5, engine_start_s=17.0, engine_shutdown_s=4.7)
    s = scaled(tm, 2.0)
    assert (s.fixed_s, s.prefill_token_s, s.decode_seq_s, s.context_token_s, s.prefill_attention_s, s.request_s) \
        == (2.0, 0.02, 0.2, 0.002, 2e-4, 1.0)
    assert (s.engine_start_s, s.engine_shutdown_s) == (17.0, 4.7)
    # 100 prefill tokens, 3 decoding sequences, 50 context tokens, 1000 attended pairs, 1 new request:
    # 1 + 1 + 0.3 + 0.05 + 0.1 + 0.5 = 2.95 s nominal, 5.9 s scaled
    assert tm.step_s(100, 3, 50, 1000.0, 1) == pytest.approx(2.95)
    assert s.step_s(100, 3, 50, 1000.0, 1) == pytest.approx(5.9)
    assert scaled(tm, 1.0) is tm


def test_drift_grows_with_elapsed_virtual_time():
    assert drift_factor(0.05, 0.0) == 1.0
    assert drift_factor(0.05, 7200.0) == pytest.approx(1.10)  # two hours at +5%/h
    source = NoiseSource(SimNoise(drift_per_hour=0.05))
    source.advance(1800.0)
    assert source.drift_factor() == pytest.approx(1.025)
    # in the engine: its start costs 3600 virtual s, so its replay runs at +5% (a prefill step of 2.0 s and a
    # decode step of 1.2 s, each x 1.05), then 1800 s of shutdown; the next engine's start adds another 3600 s
    source = NoiseSource(SimNoise(drift_per_hour=0.05))
    first = replays(engine(source), 1, one_request())[0][0]
    assert first.ttft_s == pytest.approx(2.0 * 1.05)  # one prefill step of 100 tokens: 2.0 s nominal
    elapsed = source.elapsed_s
    assert elapsed == pytest.approx(3600 + 1800 + 1.05 * (2.0 + 1.0 + 0.1 + 0.001 * 100))
    second = replays(engine(source), 1, one_request())[0][0]
    assert second.ttft_s == pytest.approx(2.0 * drift_factor(0.05, elapsed + 3600))


def test_the_engine_factor_scales_a_whole_engine():
    source = NoiseSource(SimNoise(run_cv=0.2, seed=3))
    eng = engine(source)
    rec = replays(eng, 2, one_request())
    assert eng.engine_factor != 1.0
    # no replay noise, and a drift of 0: both replays run at exactly the engine's factor
    assert [r[0].ttft_s for r in rec] == pytest.approx([2.0 * eng.engine_factor] * 2)


def test_the_engine_factor_applies_in_real_time_too(monkeypatch):
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(seconds, *args):
        slept.append(seconds)
        await real_sleep(0)

    eng = engine(NoiseSource(SimNoise(run_cv=0.3, seed=5)))

    async def run():
        await eng.start({"max_num_seqs": 8, "gpu_memory_utilization": 0.2})
        monkeypatch.setattr(asyncio, "sleep", fake_sleep)
        try:
            return [n async for n in eng.generate(one_request()[0])]
        finally:
            monkeypatch.setattr(asyncio, "sleep", real_sleep)
            await eng.shutdown()

    assert len(asyncio.run(run())) == 2
    assert slept[0] == pytest.approx(2.0 * eng.engine_factor)  # the prefill step, at this engine's speed
    assert eng.engine_factor != 1.0


def test_factor_spread_is_near_the_configured_sigma():
    source = NoiseSource(SimNoise(run_cv=0.05, replay_cv=0.15, seed=11))
    replay = [source.replay_factor() for _ in range(20000)]
    start = [source.engine_factor() for _ in range(20000)]
    assert coefficient_of_variation(replay) == pytest.approx(0.15, abs=0.01)  # exactly sqrt(e^0.0225 - 1) = 0.151
    assert coefficient_of_variation(start) == pytest.approx(0.05, abs=0.005)
    assert np.median(replay) == pytest.approx(1.0, abs=0.01)
    assert lognormal_factor(1.0, 0.2) == pytest.approx(math.exp(0.2))


def test_replay_draws_do_not_depend_on_engine_draws():
    """Separate streams: the k-th engine's factor is the same however many replays the engines before it ran."""
    a, b = NoiseSource(SimNoise(run_cv=0.1, replay_cv=0.1, seed=2)), NoiseSource(SimNoise(run_cv=0.1, replay_cv=0.1,
                                                                                           seed=2))
    a_first = a.engine_factor()
    for _ in range(5):
        a.replay_factor()
    b_first = b.engine_factor()
    assert (a_first, a.engine_factor()) == (b_first, b.engine_factor())
    fresh = NoiseSource(SimNoise(run_cv=0.1, replay_cv=0.1, seed=2))
    assert fresh.engine_factor() != fresh.replay_factor()  # two streams, not one stream read twice
