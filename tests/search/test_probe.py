"""The probe that sizes the embedded demo: hand-checked predictions, the choice of shape, the probe itself."""

import asyncio

import pytest

from optimizer.config.model import DEMO_LADDER, demo_shape, model_info
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec
from optimizer.core.clock import MonotonicClock
from optimizer.engines.simulated import SimulatedEngine
from optimizer.search.probe import (
    BASELINE_EXTRA_REPLAYS, KNEE_FRACTION_OF_CEILING, REPLAYS_PER_TRIAL, ProbeResult, choose_scale, estimate_study_s,
    predicted_prefill_ms, probe,
)


def result(prefill_ms, decode_ms=5.0, burst_rps=20.0, start_s=17.0, shutdown_s=5.0):
    return ProbeResult(model=DEMO_LADDER[0].name, dtype="float32", start_s=start_s, shutdown_s=shutdown_s,
                       prefill_ms=prefill_ms, decode_ms=decode_ms, burst_rps=burst_rps, prompt_tokens=256)


def test_the_ladder_is_ordered_by_compute_and_named_shapes_resolve():
    flops = [s.flops_per_token for s in DEMO_LADDER]
    assert flops == sorted(flops, reverse=True) and len(set(flops)) == len(flops)
    # 17M: 2 x 6 layers x (4 x 384^2 + 3 x 384 x 1024) multiply-adds per token
    assert DEMO_LADDER[0].flops_per_token == 2 * 6 * (4 * 384**2 + 3 * 384 * 1024)
    assert all(s.config["hidden_size"] // s.config["num_attention_heads"] == 64 for s in DEMO_LADDER)
    assert demo_shape("tiny-llama-7m") is DEMO_LADDER[1]
    with pytest.raises(Exception, match="tiny-llama-17m, tiny-llama-7m, tiny-llama-4m"):
        demo_shape("tiny-llama-1b")


def test_prefill_prediction_scales_the_compute_past_the_per_step_overhead():
    r = result(prefill_ms=105.0, decode_ms=5.0)
    small = DEMO_LADDER[1]
    ratio = small.flops_per_token / DEMO_LADDER[0].flops_per_token
    assert predicted_prefill_ms(r, DEMO_LADDER[0]) == pytest.approx(105.0)
    assert predicted_prefill_ms(r, small) == pytest.approx(5.0 + 100.0 * ratio)


def test_the_largest_shape_that_fits_the_limit_is_chosen():
    fast = choose_scale(result(prefill_ms=20.0), 150.0, 40, 120)
    assert fast.model == DEMO_LADDER[0].name and fast.fits  # 20 ms <= 20% of 150 ms
    slow = choose_scale(result(prefill_ms=70.0, decode_ms=10.0), 150.0, 40, 120)  # float32 here: 67 ms measured
    assert slow.model == DEMO_LADDER[1].name and slow.fits and slow.predicted_prefill_ms <= 30.0
    slower = choose_scale(result(prefill_ms=200.0, decode_ms=10.0), 150.0, 40, 120)  # 7m: 66.6 ms > 30 ms
    assert slower.model == DEMO_LADDER[2].name and slower.fits
    hopeless = choose_scale(result(prefill_ms=200.0, decode_ms=40.0), 150.0, 40, 120)  # overhead alone is 40 ms
    assert hopeless.model == DEMO_LADDER[-1].name and not hopeless.fits
    # a looser limit keeps the larger model
    assert choose_scale(result(prefill_ms=70.0, decode_ms=10.0), 400.0, 40, 120).model == DEMO_LADDER[0].name


def test_study_duration_estimate_by_hand():
    r = result(prefill_ms=20.0, burst_rps=20.0, start_s=17.0, shutdown_s=5.0)
    # a probe of 1000 requests at the knee (the burst's pace) 50 s; a trial 17 + 5 + 1 x 50 = 72 s
    replay_s = 1000 / (KNEE_FRACTION_OF_CEILING * 20.0)
    trial_s = 17.0 + 5.0 + REPLAYS_PER_TRIAL * replay_s
    assert replay_s == pytest.approx(50.0) and trial_s == pytest.approx(72.0)
    assert estimate_study_s(r, 40, 1000) == pytest.approx(40 * trial_s + BASELINE_EXTRA_REPLAYS * replay_s)
    assert estimate_study_s(r, 40, 1000, speedup=2.0) < estimate_study_s(r, 40, 1000)
    # a warm-up of 300 requests at the knee before each trial's probes: 15 s more a trial, 40 x 15 s more in all
    warm = estimate_study_s(r, 40, 1000, warmup_load_requests=300)
    assert warm - estimate_study_s(r, 40, 1000) == pytest.approx(40 * 300 / 20.0)
    # it holds in confirmation runs too (5 of the 40), and is counted as a fixed cost per engine when the requests
    # per replay are fitted to the time: fewer requests per replay with it than without
    assert estimate_study_s(r, 40, 1000, confirm_runs=5, warmup_load_requests=300) \
        - estimate_study_s(r, 40, 1000, confirm_runs=5) == pytest.approx(40 * 15.0)
    slow = result(prefill_ms=20.0, burst_rps=14.0)
    assert choose_scale(slow, 150.0, 40, 1000, warmup_load_requests=300).num_requests \
        < choose_scale(slow, 150.0, 40, 1000).num_requests < 1000


def test_probe_measures_prefill_decode_and_the_ceiling():
    """On the simulator (its step time model scales with prompt tokens): the probe's own arithmetic."""
    spec = WorkloadSpec(**CPU_DEMO_WORKLOAD)
    big = model_info(DEMO_LADDER[0].config, "sim")
    r = asyncio.run(probe(lambda: SimulatedEngine(big), spec, big.vocab_size, MonotonicClock(), DEMO_LADDER[0].name,
                          "bfloat16", {"gpu_memory_utilization": 0.3}))
    assert r.prompt_tokens == spec.input_len_max and r.model == DEMO_LADDER[0].name
    assert r.prefill_ms > r.decode_ms > 0 and r.burst_rps > 0
    assert r.start_s >= 0 and r.shutdown_s >= 0
    assert ProbeResult.from_dict(r.to_dict()) == r


def test_a_slow_study_takes_a_smaller_shape():
    from optimizer.search.probe import TARGET_S_PER_TRIAL, estimate_shape_s

    # engine start 25 s, burst ceiling 40/s: the 17M model's 40 trials are estimated past 54 s a trial
    slow = result(prefill_ms=20.0, decode_ms=5.0, burst_rps=40.0, start_s=25.0)
    in_time = [s for s in DEMO_LADDER if estimate_shape_s(slow, s, 40, 1000) <= TARGET_S_PER_TRIAL * 40]
    assert DEMO_LADDER[0] not in in_time and in_time
    assert choose_scale(slow, 150.0, 40, 1000).model == in_time[0].name
    # smaller models replay faster: the estimates fall down the ladder
    estimates = [estimate_shape_s(slow, s, 40, 1000) for s in DEMO_LADDER]
    assert estimates == sorted(estimates, reverse=True)
    # a start so slow that no shape is in time: the smallest, whose prefill fits too
    hopeless = result(prefill_ms=20.0, decode_ms=5.0, burst_rps=40.0, start_s=80.0)
    assert choose_scale(hopeless, 150.0, 40, 1000).model == DEMO_LADDER[-1].name


def test_when_even_the_smallest_shape_is_late_each_replay_sends_fewer_requests():
    from optimizer.search.probe import MIN_DEMO_REQUESTS, TARGET_S_PER_TRIAL, estimate_shape_s, requests_in_time

    # slow replays (ceiling 16/s): the 4M shape with 1000 requests is estimated past 54 s a trial
    slow = result(prefill_ms=20.0, decode_ms=5.0, burst_rps=16.0, start_s=25.0)
    smallest = DEMO_LADDER[-1]
    assert estimate_shape_s(slow, smallest, 40, 1000) > TARGET_S_PER_TRIAL * 40
    scale = choose_scale(slow, 150.0, 40, 1000)
    assert scale.model == smallest.name and MIN_DEMO_REQUESTS < scale.num_requests < 1000
    assert scale.num_requests % 10 == 0
    # the count is the largest that fits: ten more would not
    assert estimate_shape_s(slow, smallest, 40, scale.num_requests) <= TARGET_S_PER_TRIAL * 40
    assert estimate_shape_s(slow, smallest, 40, scale.num_requests + 10) > TARGET_S_PER_TRIAL * 40
    assert scale.estimated_s == pytest.approx(estimate_shape_s(slow, smallest, 40, scale.num_requests))
    # a start so slow that no count is in time: the floor, never fewer
    assert requests_in_time(result(prefill_ms=20.0, burst_rps=5.0, start_s=80.0), smallest, 40, 1000) == \
        MIN_DEMO_REQUESTS
    # in time already: the count asked for
    assert choose_scale(result(prefill_ms=20.0, burst_rps=60.0), 150.0, 40, 1000).num_requests == 1000
