import asyncio
import hashlib
import json
import math

import numpy as np
import pytest

from optimizer.config.settings import StudyConfig, build
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, LengthDist, WorkloadSpec
from optimizer.core.clock import MonotonicClock
from optimizer.core.errors import UsageError
from tests.support.fake_engine import FakeEngine
from optimizer.measurement.metrics import RequestRecord, measured_window, summarize
from optimizer.measurement.replay import replay_closed_loop
from optimizer.measurement.workload import build_workload, fixed_load_rate


def spec(**kw):
    return WorkloadSpec(**{"num_requests": 50, "input_len_min": 8, "input_len_max": 32, "output_len_min": 4,
                           "output_len_max": 9, "warmup_requests": 3, **kw})


def test_same_seed_same_requests_token_for_token():
    a, b = build_workload(spec(seed=7), 1000), build_workload(spec(seed=7), 1000)
    assert a == b
    assert build_workload(spec(seed=8), 1000).requests != a.requests


def test_lengths_in_range_and_tokens_in_vocab():
    w = build_workload(spec(), 1000)
    assert len(w.requests) == 50 and len(w.warmup) == 3
    for r in w.requests + w.warmup:
        assert 8 <= r.input_len <= 32 and 4 <= r.output_len <= 9
        assert all(100 <= t < 1000 for t in r.prompt_token_ids)
    assert len({r.index for r in w.requests + w.warmup}) == 53


def test_arrivals_scale_with_rate_and_average_exactly_the_rate():
    w = build_workload(spec(), 1000)
    at2 = w.arrivals_s(2.0)
    assert at2[0] == 0.0
    assert all(b >= a for a, b in zip(at2, at2[1:]))
    assert (len(at2) - 1) / at2[-1] == 2.0 or math.isclose((len(at2) - 1) / at2[-1], 2.0)
    assert w.arrivals_s(4.0)[10] * 2 == at2[10] or math.isclose(w.arrivals_s(4.0)[10] * 2, at2[10])
    assert w.arrivals_s(math.inf) == [0.0] * 50


def test_warmup_does_not_shift_measured_requests():
    assert build_workload(spec(warmup_requests=0), 1000).requests == build_workload(spec(warmup_requests=9), 1000).requests


def test_poisson_gaps_look_exponential():
    w = build_workload(spec(num_requests=2000), 1000)
    arr = w.arrivals_s(1.0)
    gaps = [b - a for a, b in zip(arr, arr[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 0.9 < cv < 1.1  # exponential gaps have a coefficient of variation of 1


def test_gamma_burstiness_clusters_arrivals():
    def cv(burstiness):
        w = build_workload(spec(num_requests=3000, burstiness=burstiness), 1000)
        arr = w.arrivals_s(1.0)
        gaps = [b - a for a, b in zip(arr, arr[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    # gamma(shape k) gaps have a coefficient of variation of 1/sqrt(k): 0.25 -> 2
    assert 1.8 < cv(0.25) < 2.2
    assert build_workload(spec(burstiness=1.0), 1000) == build_workload(spec(), 1000)


def test_long_prompt_mixture():
    w = build_workload(spec(num_requests=1000, long_prompt_fraction=0.3, long_input_len_min=900,
                            long_input_len_max=1000), 2000)
    long = [r for r in w.requests if r.input_len >= 900]
    assert 250 < len(long) < 350
    assert all(8 <= r.input_len <= 32 for r in w.requests if r.input_len < 900)
    assert spec(long_prompt_fraction=0.3, long_input_len_min=900, long_input_len_max=1000).max_total_len == 1009


# --- the workload spec: arrivals, length distributions, mixtures, shared prefixes, window ---------------------



def _digest(s):
    w = build_workload(s, 32000)
    key = [(r.index, r.prompt_token_ids, r.output_len, r.unit_arrival_s) for r in w.requests + w.warmup]
    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


@pytest.mark.parametrize("fields,expected", [
    (CPU_DEMO_WORKLOAD, "65b2118936ce793f"),  # 1000 requests since probes are sized by evidence (120 before)
    ({}, "a237a8356c031982"),
    (dict(long_prompt_fraction=0.3, long_input_len_min=600, long_input_len_max=900, seed=3), "20f06cbc38fa2bd1"),
    (dict(burstiness=0.5, seed=5, num_requests=50), "2b1333bf3a7f60fc"),
    (dict(num_requests=10, trace=[(10, 5, 100.0), (20, 6, 101.0), (30, 7, 103.0), (40, 8, 104.0)]),
     "017d86ce51861b80"),
    (dict(num_requests=10, trace=[(10, 5, None), (20, 6, None), (30, 7, None)]), "2e73450d7a01b4c1"),
])
def test_specs_without_the_new_fields_draw_exactly_the_requests_they_always_drew(fields, expected):
    # digests taken from the workload code before distributions, mixtures and prefixes existed: a stored study
    # resumed after the upgrade replays the same requests, token for token
    assert _digest(WorkloadSpec(**fields)) == expected


def test_an_old_stored_config_loads_and_keeps_its_identity():
    old_workload = {"num_requests": 120, "warmup_requests": 4, "input_len_min": 32, "input_len_max": 256,
                    "output_len_min": 16, "output_len_max": 64, "seed": 0, "burstiness": 1.0,
                    "long_prompt_fraction": 0.2, "long_input_len_min": 300, "long_input_len_max": 400, "trace": None}
    old = {"study_name": "s", "storage_url": "sqlite:///x.db", "ttft_p99_ms": 150.0, "budget": 3, "model": "m",
           "workload": old_workload}
    stored = StudyConfig.model_validate(json.loads(json.dumps(old)))
    # what resolve_config does on resume: the stored dump, merged with nothing, validated again
    again = build(StudyConfig, json.loads(json.dumps(stored.model_dump())), "settings")
    assert again.identity() == stored.identity()
    assert again.workload.input_components()[1][0] == 0.2 and again.workload.max_total_len == 464


def test_constant_arrivals_are_evenly_spaced_with_the_poisson_workloads_requests():
    poisson, constant = build_workload(spec(seed=4), 1000), build_workload(spec(seed=4, arrivals="constant"), 1000)
    assert constant.arrivals_s(2.0)[:4] == [0.0, 0.5, 1.0, 1.5]
    assert constant.arrivals_s(2.0)[-1] == 24.5  # 50 requests at 2 req/s
    strip = lambda w: [(r.prompt_token_ids, r.output_len) for r in w.requests]  # noqa: E731
    assert strip(constant) == strip(poisson)


def test_closed_loop_needs_a_concurrency_and_only_it_has_one():
    assert spec(arrivals="closed_loop", concurrency=4).concurrency == 4
    for bad in (dict(arrivals="closed_loop"), dict(concurrency=4), dict(arrivals="constant", burstiness=0.5)):
        with pytest.raises(UsageError, match="closed_loop|burstiness applies"):
            build(WorkloadSpec, {**bad, "num_requests": 20}, "workload")


def test_uniform_normal_lognormal_means_by_hand():
    assert LengthDist(min=10, max=30).expected() == 20
    # a normal centred in a symmetric clip keeps its mean: the clipped tails balance
    assert LengthDist(min=100, max=300, dist="normal", mean=200, std=50).expected() == pytest.approx(200)
    # clips far out of reach change nothing: the lognormal's own mean
    assert LengthDist(min=1, max=10**9, dist="lognormal", mean=300, std=100).expected() == pytest.approx(300)
    # a normal clipped at its mean: half the mass at 200, the upper half's mean is 200 + 50 * sqrt(2/pi)
    half = LengthDist(min=200, max=10**9, dist="normal", mean=200, std=50).expected()
    assert half == pytest.approx(0.5 * 200 + 0.5 * (200 + 50 * (2 / math.pi) ** 0.5))


@pytest.mark.parametrize("dist", ["normal", "lognormal"])
def test_clipped_draws_stay_in_bounds_and_average_the_expected_mean(dist):
    d = LengthDist(min=50, max=400, dist=dist, mean=120, std=150)
    x = d.draw(np.random.default_rng(0), 200_000)
    assert x.min() == 50 and x.max() == 400  # heavy clipping on both sides
    assert x.mean() == pytest.approx(d.expected(), rel=0.01)


def test_lognormal_workload_lengths_and_spec_totals():
    s = spec(num_requests=2000, input_len_dist="lognormal", input_len_min=16, input_len_max=600, input_len_mean=200,
             input_len_std=150, output_len_dist="normal", output_len_min=4, output_len_max=60, output_len_mean=30,
             output_len_std=10)
    w = build_workload(s, 1000)
    ins = [r.input_len for r in w.requests]
    assert 16 <= min(ins) and max(ins) <= 600 and len(set(ins)) > 100
    assert s.max_total_len == 660
    total = np.mean([r.input_len + r.output_len for r in w.requests])
    assert total == pytest.approx(s.mean_total_len, rel=0.03)


def test_mixture_thirty_percent_long_prompts():
    s = spec(num_requests=1000, input_mixture=[{"weight": 0.3, "min": 1000, "max": 2000}])
    w = build_workload(s, 3000)
    long = [r for r in w.requests if r.input_len >= 1000]
    assert 250 < len(long) < 350 and all(r.input_len <= 2000 for r in long)
    assert all(8 <= r.input_len <= 32 for r in w.requests if r.input_len < 1000)
    assert s.max_total_len == 2009
    assert s.mean_total_len == pytest.approx(0.7 * 20 + 0.3 * 1500 + 6.5)


def test_the_old_long_prompt_fields_are_one_mixture_component():
    legacy = spec(num_requests=300, long_prompt_fraction=0.3, long_input_len_min=900, long_input_len_max=1000)
    mixture = spec(num_requests=300, input_mixture=[{"weight": 0.3, "min": 900, "max": 1000}])
    assert build_workload(legacy, 2000).requests == build_workload(mixture, 2000).requests
    assert legacy.max_total_len == mixture.max_total_len == 1009


def test_weights_that_take_every_request_leave_the_base_range_out_of_max_total_len():
    s = spec(output_mixture=[{"weight": 0.5, "min": 2, "max": 3}, {"weight": 0.5, "min": 5, "max": 7}])
    assert s.max_total_len == 32 + 7
    assert {r.output_len for r in build_workload(s, 1000).requests} <= {2, 3, 5, 6, 7}


@pytest.mark.parametrize("fields,hint", [
    (dict(input_mixture=[{"weight": 0.7, "min": 1, "max": 2}, {"weight": 0.5, "min": 3, "max": 4}]),
     "input_mixture weights sum to 1.2"),
    (dict(long_prompt_fraction=0.5, long_input_len_min=50, long_input_len_max=60,
          input_mixture=[{"weight": 0.6, "min": 1, "max": 2}]), "with long_prompt_fraction"),
    (dict(input_len_dist="normal", input_len_mean=20, input_len_std=-3), "input_len_std must be > 0"),
    (dict(input_len_dist="lognormal"), "need input_len_mean and input_len_std"),
    (dict(output_len_dist="normal", output_len_mean=50, output_len_std=3), "output_len_mean 50 must lie between"),
    (dict(input_len_mean=20), "set input_len_dist to normal or lognormal"),
    (dict(input_mixture=[{"weight": 0.2, "min": 5, "max": 1}]), "min 5 > max 1"),
    (dict(input_mixture=[{"weight": 0.2, "min": 1, "max": 5, "dist": "normal", "mean": 3, "std": -1}]),
     "std"),
    (dict(input_mixture=[{"weight": 0, "min": 1, "max": 5}]), "weight"),
    (dict(input_len_dist="gaussian"), "input_len_dist"),
    (dict(prefix_fraction=0.5), "prefix_groups >= 1 and prefix_len >= 1"),
    (dict(skip_first_fraction=0.3, skip_last_fraction=0.3), "below 0.5"),
    (dict(trace_timing="original"), "needs a trace with timestamps"),
])
def test_bad_workload_fields_fail_in_one_line_that_names_the_fix(fields, hint):
    with pytest.raises(UsageError) as err:
        build(WorkloadSpec, {"num_requests": 20, **fields}, "workload")
    assert hint in str(err.value) and "\n" not in str(err.value)


def test_shared_prefixes_are_shared_token_for_token_by_the_given_fraction():
    s = spec(num_requests=200, prefix_groups=3, prefix_len=40, prefix_fraction=0.25)
    w = build_workload(s, 5000)
    prefixed = [r for r in w.requests if r.prefix_group is not None]
    assert len(prefixed) == 50  # exactly 25% of 200
    heads = {g: {r.prompt_token_ids[:40] for r in prefixed if r.prefix_group == g} for g in range(3)}
    assert all(len(h) == 1 for h in heads.values())  # every request of a group starts with the same 40 tokens
    assert len({next(iter(h)) for h in heads.values()}) == 3  # and the groups differ
    for r in prefixed:
        assert 8 + 40 <= r.input_len <= 32 + 40  # prefix + the request's own prompt
    for r in w.requests:
        if r.prefix_group is None:
            assert 8 <= r.input_len <= 32 and r.prompt_token_ids[:40] not in {next(iter(h)) for h in heads.values()}
    warm = [r for r in w.warmup if r.prefix_group is not None]
    assert all(r.prompt_token_ids[:40] == next(iter(heads[r.prefix_group])) for r in warm)
    assert s.max_total_len == 32 + 40 + 9
    assert s.mean_total_len == pytest.approx(20 + 0.25 * 40 + 6.5)
    assert build_workload(s, 5000) == w


def test_prefixes_do_not_apply_to_a_trace():
    with pytest.raises(UsageError, match="do not apply to a trace"):
        build(WorkloadSpec, {"num_requests": 10, "trace": [(5, 5, None), (6, 6, None)], "prefix_groups": 1,
                             "prefix_len": 4, "prefix_fraction": 0.5}, "workload")


def rec(index, sent, ttft, ok=True, tokens=3, tpot=0.01):
    first = sent + ttft
    chunks = [first + k * tpot for k in range(tokens)]
    return RequestRecord(index=index, input_len=10, planned_s=sent, sent_s=sent, first_token_s=first,
                         chunk_times_s=chunks if ok else [], output_tokens=tokens if ok else 0, ok=ok)


def test_measured_window_drops_the_first_and_last_requests_in_send_order():
    records = [rec(i, sent=float(9 - i), ttft=0.1) for i in range(10)]  # listed in reverse send order
    kept = measured_window(records, 0.2, 0.1)
    assert [r.index for r in kept] == [7, 6, 5, 4, 3, 2, 1]  # sent at 2..8 s: 2 first and 1 last dropped
    assert measured_window(records) == sorted(records, key=lambda r: r.sent_s)
    assert len(measured_window(records[:7], 0.29, 0.0)) == 5  # floor(0.29 * 7) = 2 (no float rounding down)


def test_summarize_window_changes_latencies_only():
    # TTFTs 1, 2, ..., 10 s: the first two (ramp-up, fast) and the last (drain) are left out of percentiles
    records = [rec(i, sent=float(i), ttft=[0.5, 0.6, 3, 4, 5, 6, 7, 8, 9, 20][i]) for i in range(10)]
    full, win = summarize(records, 1.0), summarize(records, 1.0, 0.2, 0.1)
    assert full.ttft.p50_ms == pytest.approx(5500.0)
    assert win.ttft.p50_ms == pytest.approx(6000.0)  # median of 3..9 s
    assert win.ttft.p99_ms == pytest.approx(8940.0)  # 8 + 0.94 x (9 - 8) s
    assert win.ttft.mean_ms == pytest.approx(6000.0)
    for same in ("completed", "failed", "duration_s", "output_throughput_tok_s", "sent_rate_rps",
                 "achieved_rate_rps"):
        assert getattr(win, same) == getattr(full, same)
    assert summarize(records, 1.0, 0.0, 0.0) == full


def test_closed_loop_replay_keeps_at_most_c_requests_in_flight():
    w = build_workload(spec(num_requests=24, warmup_requests=0, output_len_min=3, output_len_max=6), 1000)

    async def go(c):
        engine = FakeEngine(step_s=0.001, per_seq_s=0.0)
        await engine.start({"max_num_seqs": 64})
        try:
            return await replay_closed_loop(engine, w.requests, c, MonotonicClock())
        finally:
            await engine.shutdown()

    one = asyncio.run(go(1))
    assert [r.index for r in one] == list(range(24)) and all(r.ok for r in one)
    assert all(b.sent_s >= a.finish_s for a, b in zip(one, one[1:]))  # the next goes when the previous finished
    four = asyncio.run(go(4))
    assert sorted(r.index for r in four) == list(range(24)) and all(r.ok for r in four)
    assert sorted(r.sent_s for r in four)[3] < 0.01  # four clients open at once
    for r in four:  # never more than 4 in flight at any send
        assert sum(o.sent_s <= r.sent_s < o.finish_s for o in four) <= 4
    assert all(r.planned_s == r.sent_s for r in four)


def test_fixed_load_rates():
    assert fixed_load_rate(spec(), build_workload(spec(), 1000)) is None
    closed = spec(arrivals="closed_loop", concurrency=3)
    assert fixed_load_rate(closed, build_workload(closed, 1000)) == math.inf
