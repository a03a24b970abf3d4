import math

from optimizer.config import WorkloadSpec
from optimizer.workload import build_workload


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
