"""The P99's distribution-free confidence interval and the requests a stable P99 needs, checked by hand."""

import math

import numpy as np
import pytest

from optimizer.measurement.stability import (
    exponential_tail, min_requests_for_upper_bound, p99_stability, predicted_width, quantile_ci_ranks, requests_needed,
)


def test_ranks_of_the_p99_interval_over_120_requests():
    # Y = samples above the true P99 ~ Binomial(120, 0.01): P(Y=0..4) = .2994 .3629 .2181 .0866 .0256, so
    # P(Y >= 4) = .0330 > .025 but P(Y >= 5) = .0074 <= .025: the 116th smallest is the lowest rank that is
    # below the P99 with 97.5% confidence. And P(Y = 0) = .2994 > .025: even the maximum may be below it.
    assert quantile_ci_ranks(120) == (116, None)


def test_the_maximum_bounds_the_p99_from_368_requests_on():
    # 0.99^n <= 0.025  <=>  n >= ln(0.025) / ln(0.99) = 367.04
    assert min_requests_for_upper_bound() == 368
    assert quantile_ci_ranks(367)[1] is None
    assert quantile_ci_ranks(368)[1] == 368


def test_median_interval_matches_the_textbook_table():
    # n = 10, median, 95%: ranks 2 and 9 (P(Bin(10, .5) <= 1) = 11/1024 = .0107; <= 2 is 56/1024 = .0547)
    assert quantile_ci_ranks(10, q=0.5) == (2, 9)


def test_short_replay_is_never_stable_and_says_how_many_requests_would_be():
    ttft = [10.0] * 110 + [20.0, 22.0, 24.0, 26.0, 28.0, 30.0, 32.0, 34.0, 36.0, 40.0]
    s = p99_stability(ttft)
    assert s.n == 120 and s.p99_ms == pytest.approx(np.percentile(ttft, 99))
    assert s.low_ms == 30.0  # rank 116 of the sorted samples
    assert s.high_ms == math.inf and not s.stable
    assert s.requests_needed is not None and s.requests_needed >= 368


def test_long_replay_of_a_narrow_tail_is_stable():
    rng = np.random.default_rng(0)
    s = p99_stability(100.0 + rng.exponential(5.0, size=4000))
    assert s.stable and s.relative_width < 0.2
    assert s.low_ms <= s.p99_ms <= s.high_ms


def test_exponential_tail_fit_and_predicted_width_by_hand():
    # top decile of 0..99 (k = 10): threshold 89, excesses 1..10, mean excess 5.5
    tail = exponential_tail(list(range(100)))
    assert tail == (89.0, 5.5, 0.1)
    # n = 368: Y ~ Bin(368, .01) has P(Y >= 9) = .0128 <= .025 < P(Y >= 8) = .0336, so the lower rank is 360;
    # ranks (360, 368) sit at levels 360/369 and 368/369; Q(p) = 89 + 5.5 ln(0.1 / (1 - p))
    q = lambda p: 89 + 5.5 * math.log(0.1 / (1 - p))  # noqa: E731
    assert quantile_ci_ranks(368) == (360, 368)
    expected = (q(368 / 369) - q(360 / 369)) / q(0.99)
    assert predicted_width(368, tail) == pytest.approx(expected)


def test_requests_needed_grows_as_the_tolerance_tightens():
    rng = np.random.default_rng(1)
    ttft = 50.0 + rng.exponential(20.0, size=300)
    loose, tight = requests_needed(ttft, tolerance=0.6), requests_needed(ttft, tolerance=0.15)
    assert loose == 368 and tight is not None and tight > 2 * loose
    tail = exponential_tail(ttft)
    assert predicted_width(tight, tail) <= 0.15 < predicted_width(int(tight * 0.95), tail)


def test_a_study_measured_by_pooled_fits_ends_without_replay_length_advice(tmp_path, config_only_model):
    from optimizer.config.settings import StudyConfig
    from optimizer.config.workload_spec import WorkloadSpec
    from optimizer.engines.simulated import SimulatedEngine
    from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
    from optimizer.search.runner import p99_advice, prepare, run

    def engine():
        return SimulatedEngine(model_info({**DEFAULT_MODEL_CONFIG, "max_position_embeddings": 1024}, "sim"))

    config = StudyConfig(study_name="s", storage_url=f"sqlite:///{tmp_path}/s.db", ttft_p99_ms=30.0, budget=2,
                         model=str(config_only_model), dummy_weights=True, device="cpu",
                         workload=WorkloadSpec(num_requests=40, warmup_requests=2, input_len_min=64,
                                               input_len_max=256, output_len_min=2, output_len_max=6))
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=engine, memory_probe=lambda: None)
    run(prepared, quiet=True)
    from optimizer.search.attrs import RESULT
    from optimizer.search.confirmed import recommended

    assert RESULT.of(recommended(prepared.study)).get("rate_at_limit")  # measured by probes and a pooled fit
    assert p99_advice(prepared) is None  # its number rests on the fit's interval, not one replay's P99
    assert "p99_stability" not in prepared.study.user_attrs


def test_the_advice_names_the_replay_length_that_would_pin_the_p99():
    rng = np.random.default_rng(3)
    short = p99_stability(50.0 + rng.exponential(20.0, size=40))
    text = short.advice_text()
    assert "over 40 requests" in text and "open above" in text and "not stable" in text  # 40 < 368
    long = p99_stability(50.0 + rng.exponential(20.0, size=5000))
    assert long.stable and long.advice_text().endswith("stable (within 40% of it)")
    middle = p99_stability(50.0 + rng.exponential(20.0, size=400), tolerance=0.15)
    assert not middle.stable and middle.requests_needed is not None and middle.requests_needed > 400
    assert middle.advice_text(0.15).endswith(f"within 15% (--num-requests {middle.requests_needed}, or auto, in a "
                                             "new study)")


def test_lag1_autocorrelation_by_hand():
    # d = (-1.5, -0.5, 0.5, 1.5): sum d_i d_(i-1) = 0.75 - 0.25 + 0.75 = 1.25; sum d_i^2 = 5
    from optimizer.measurement.stability import lag1_autocorrelation

    assert lag1_autocorrelation([1, 2, 3, 4]) == pytest.approx(0.25)
    assert lag1_autocorrelation([5, 5, 5]) == 0.0 and lag1_autocorrelation([1, 2]) == 0.0


def test_correlated_ttfts_count_as_fewer_requests():
    from optimizer.measurement.stability import effective_fraction

    rng = np.random.default_rng(0)
    assert effective_fraction(100.0 + rng.exponential(20.0, size=2000)) == 1.0  # independent: rho within noise
    x = np.zeros(20000)
    for i in range(1, len(x)):  # AR(1) with rho 0.5: n_eff / n = 0.5 / 1.5
        x[i] = 0.5 * x[i - 1] + rng.normal()
    assert effective_fraction(x) == pytest.approx(1 / 3, abs=0.02)
    ttft = 50.0 + rng.exponential(20.0, size=300)
    assert requests_needed(ttft, fraction=0.25) == math.ceil(requests_needed(ttft) / 0.25)


def test_a_queue_with_bursts_is_not_stable_at_the_count_independent_draws_would_need():
    rng = np.random.default_rng(2)
    smooth = list(100.0 + rng.exponential(5.0, size=1000))
    bursty = sorted(smooth[:500]) + sorted(smooth[500:])  # the same values, slow ones bunched together
    assert p99_stability(smooth).stable and p99_stability(smooth).effective_fraction == 1.0
    s = p99_stability(bursty)
    assert s.p99_ms == p99_stability(smooth).p99_ms and s.effective_fraction < 0.1
    assert not s.stable and s.requests_needed > 1000
