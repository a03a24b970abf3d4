"""The confirmation's intervals, checked by hand (Student t, 95%)."""

import math

import pytest

from optimizer.measurement.intervals import (
    Interval, additive_residual, block_gain_df, block_gain_interval, brackets_overlap, chance_inside, gain_interval,
    geometric_mean, interval, lower_prediction_factor, median_variance, rate_bracket_tok_s, relative_gain, t_975,
    t_quantile,
)


def test_three_values_by_hand():
    # mean 12, s = 2, t(2) = 4.303: half-width 4.303 x 2 / sqrt(3) = 4.969
    iv = interval([10.0, 14.0, 12.0])
    assert iv.median == 12.0 and iv.n == 3
    assert iv.low == pytest.approx(12 - 4.303 * 2 / math.sqrt(3))
    assert iv.high == pytest.approx(12 + 4.969, abs=1e-3)
    assert iv.known and iv.contains(12.0) and not iv.contains(17.0)


def test_one_value_has_no_interval_and_none_has_nothing():
    one = interval([5.0])
    assert one.median == 5.0 and not one.known and math.isnan(one.low)
    assert one.to_dict() == {"median": 5.0, "low": None, "high": None, "n": 1}
    assert interval([]).n == 0 and math.isnan(interval([]).median)


def test_an_interval_is_cut_at_its_floor():
    # 2 values far apart: t(1) = 12.706 puts the mean's lower bound far below 0, which no throughput is
    wide = interval([100.0, 300.0], floor=0.0)
    assert wide.low == 0.0 and wide.high == pytest.approx(200 + 12.706 * math.sqrt(20000) / math.sqrt(2))
    assert gain_interval([(100.0, 10.0), (100.0, 300.0)]).low == -1.0  # a gain is never below -100%


def test_t_quantiles():
    assert t_975(1) == 12.706 and t_975(2) == 4.303 and t_975(100) == 1.96
    with pytest.raises(ValueError):
        t_975(0)


def test_gain_is_per_pair():
    # ratios 1.1 and 1.2: gains 0.1 and 0.2, mean 0.15, s = 0.0707, t(1) = 12.706: half-width 0.635
    g = gain_interval([(100.0, 110.0), (200.0, 240.0)])
    assert g.median == pytest.approx(0.15)
    assert g.low == pytest.approx(0.15 - 12.706 * math.sqrt(0.005) / math.sqrt(2))
    assert g.contains(0.0)  # two rounds cannot exclude no gain here
    # a baseline that met the limit nowhere (0 tok/s) gives no ratio: the pair is left out
    assert gain_interval([(0.0, 50.0), (100.0, 110.0)]).n == 1


def test_a_gain_pools_the_spread_of_every_config_in_the_rounds():
    # three configs, three rounds, in log: defaults 0, 0.2, -0.1; b 0.1, 0.25, 0; c 0.05, 0.2, -0.05. By hand:
    # config means 1/30, 7/60, 1/15; round means 0.05, 0.21667, -0.05; grand 0.07222. Residuals y - config - round +
    # grand: defaults -1/90, 2/90, -1/90; b and c 1/180, -2/180, 1/180: SSE = 6/8100 + 2 x 6/32400 = 1/900, df 4,
    # MSE 1/3600. b over the defaults: d = 7/60 - 1/30 = 1/12, half-width t(4) x sqrt(2 x MSE / 3) = 2.776 x
    # sqrt(1/5400) = 0.03778 in log
    rows = [[math.exp(v) for v in row] for row in ([0.0, 0.2, -0.1], [0.1, 0.25, 0.0], [0.05, 0.2, -0.05])]
    g = block_gain_interval(rows, 0, 1)
    assert g.n == 3
    assert g.median == pytest.approx(math.exp(0.1) - 1)  # the median per-round gain: +10.5%, +5.1%, +10.5%
    assert g.low == pytest.approx(math.exp(1 / 12 - 2.776 * math.sqrt(1 / 5400)) - 1)
    assert g.high == pytest.approx(math.exp(1 / 12 + 2.776 * math.sqrt(1 / 5400)) - 1)
    # the pair alone: per-round log ratios 0.1, 0.05, 0.1 (s = 0.02887), t(2) = 4.303: almost twice as wide
    pair = block_gain_interval(rows[:2], 0, 1)
    assert pair.low == pytest.approx(math.exp(1 / 12 - 4.303 * 0.0288675 / math.sqrt(3)) - 1, abs=1e-6)
    assert pair.high - pair.low > 1.8 * (g.high - g.low)
    # a config that met the limit nowhere in a round (0 tok/s) has no log: it is left out of the fit
    assert block_gain_interval([*rows[:2], [0.0, 1.0, 1.0]], 0, 1) == pair
    # the defaults at 0 in a round: no ratio there, the other rounds' pairs alone
    assert block_gain_interval([[0.0, 1.0, 1.0], [1.0, 1.1, 1.2], rows[2]], 0, 1) == \
        gain_interval([(1.0, 1.1), (1.0, 1.2)])
    with pytest.raises(ValueError):
        block_gain_interval([[1.0, 2.0], [1.0]], 0, 1)


def test_a_config_that_dropped_out_keeps_its_rounds_in_the_spread():
    # 3 configs, 4 rounds, in log; the third dropped out after round 3. Yates' missing value of a complete block
    # design (the value the least-squares fit puts there): (C x its config's total + R x its round's total - the
    # grand total) / ((C - 1)(R - 1)), here (3 x 0.1 + 4 x 0.15 - 0.7) / 6 = 0.2 / 6. Filled in, the two-way fit of
    # the full table leaves the same residual sum of squares, on one degree of freedom fewer: 6 - 1 = 5
    logs = [[0.0, 0.2, -0.1, 0.05], [0.1, 0.25, 0.0, 0.1], [0.05, 0.2, -0.15, None]]
    assert sum(logs[2][:3]) == pytest.approx(0.1) and logs[0][3] + logs[1][3] == pytest.approx(0.15)
    assert sum(v for row in logs for v in row if v is not None) == pytest.approx(0.7)
    filled = [logs[0], logs[1], [*logs[2][:3], (3 * 0.1 + 4 * 0.15 - 0.7) / 6]]
    full_sse, full_df = additive_residual(filled)
    sse, df = additive_residual(logs)
    assert (df, full_df) == (5, 6) and sse == pytest.approx(full_sse, abs=1e-12)
    # the gain's interval uses it: d is the pair's mean log ratio, the spread the fit's, t on 5 degrees of freedom
    rows = [[None if v is None else math.exp(v) for v in row] for row in logs]
    g = block_gain_interval(rows, 0, 1)
    half = 2.571 * math.sqrt(2 * sse / 5 / 4)
    assert g.low == pytest.approx(math.exp(0.3 / 4 - half) - 1, abs=1e-4)
    assert g.high == pytest.approx(math.exp(0.3 / 4 + half) - 1, abs=1e-4)
    # the rule before left the third config out: the pair alone, on 3 degrees of freedom (t = 3.182)
    assert g != block_gain_interval(rows[:2], 0, 1)
    with pytest.raises(ValueError):  # the two compared need every round
        block_gain_interval([rows[0], rows[2]], 0, 1)


def test_an_early_looks_gain_interval_stays_finite_where_its_t_is_in_the_thousands():
    # the look after round 2 of a plan of 12 rounds of 2 configs is at 99.977% on 1 degree of freedom (t ~ 2750):
    # two rounds whose gains differ by 0.6 in log put the bound past exp(700); it is held there, not an overflow
    rows = [[1.0, 1.0], [math.exp(0.3), math.exp(-0.3)]]
    g = block_gain_interval(rows, 0, 1, confidence=1 - 0.05 * (2 / 12) ** 3)
    assert g.low == pytest.approx(math.exp(-700.0) - 1) and math.isfinite(g.high) and g.high > 1e300


def test_overlap_decides_ties():
    a, b, c = Interval(10, 9, 11, 3), Interval(10.5, 10.8, 12, 3), Interval(13, 12.5, 14, 3)
    assert a.overlaps(b) and b.overlaps(a) and not a.overlaps(c)
    lone = Interval(10.9, math.nan, math.nan, 1)  # no interval: its median alone
    assert lone.overlaps(a) and not lone.overlaps(c)


def test_rate_bracket_in_throughput():
    # passed at 10 req/s (100 tok/s), failed at 11 req/s: 100 to 110 tok/s; 5% noise widens both ends
    assert rate_bracket_tok_s(100.0, 10.0, 11.0) == (100.0, pytest.approx(110.0))
    low, high = rate_bracket_tok_s(100.0, 10.0, 11.0, noise=0.05)
    assert low == pytest.approx(95.0) and high == pytest.approx(115.5)
    assert rate_bracket_tok_s(100.0, None, None) == (100.0, 100.0)  # a burst or a lower bound: its point
    assert brackets_overlap((100, 110), (109, 120)) and not brackets_overlap((100, 110), (111, 120))


def test_t_quantiles_at_other_confidences_match_the_tables():
    from optimizer.measurement.intervals import t_quantile, t_within

    # two-sided 97.5% and 99% (one-sided 0.9875 and 0.995), from published t tables
    assert math.isclose(t_quantile(0.975, 1), 25.452, abs_tol=1e-3)
    assert math.isclose(t_quantile(0.975, 2), 6.205, abs_tol=1e-3)
    assert math.isclose(t_quantile(0.99, 2), 9.925, abs_tol=1e-3)
    assert math.isclose(t_quantile(0.99, 10), 3.169, abs_tol=1e-3)
    assert math.isclose(t_within(t_975(5), 5), 0.95, abs_tol=1e-4)  # the closed form, odd df
    assert math.isclose(t_within(t_975(8), 8), 0.95, abs_tol=1e-4)  # and even df
    wide = interval([1.0, 2.0, 3.0], confidence=0.99)
    assert math.isclose(wide.high - 2.0, 9.925 / math.sqrt(3), abs_tol=1e-3)


def test_the_gain_shown_beside_two_medians_is_their_ratio():
    # the confirmation of a demo: the defaults' rounds 409, 545, 195 tok/s, #4's 397, 465, 165 (paired by round)
    base, other = interval([409.0, 545.0, 195.0]), interval([397.0, 465.0, 165.0])
    assert relative_gain(base.median, other.median) == pytest.approx(397 / 409 - 1)  # -2.9%, from the medians shown
    per_round = gain_interval([(409.0, 397.0), (545.0, 465.0), (195.0, 165.0)])
    assert per_round.median == pytest.approx(465 / 545 - 1)  # -14.7%: not derivable from the medians shown
    assert per_round.low < relative_gain(base.median, other.median) < per_round.high
    assert math.isnan(relative_gain(0.0, 5.0)) and math.isnan(relative_gain(math.nan, 5.0))
    assert math.isnan(relative_gain(5.0, math.nan))


def test_a_rate_to_provision_for_is_a_lower_prediction_bound_by_hand():
    # logs 1.0, 1.2 (mean 1.1, squares 0.02) and 2.0, 2.2, 2.1 (mean 2.1, squares 0.02): s^2 = 0.04 / 3 on 3 degrees
    # of freedom; one-sided 95% t(3) = 2.353 (the two-sided 90% table); a config of 2 runs: sqrt(1 + 1/2)
    rows = [[math.e ** 1.0, math.e ** 1.2], [math.e ** 2.0, math.e ** 2.2, math.e ** 2.1]]
    expected = math.exp(-2.353 * math.sqrt(0.04 / 3) * math.sqrt(1.5))  # 0.7170
    assert lower_prediction_factor(rows, 2) == pytest.approx(expected, abs=1e-4)
    # one run to start from (the run as served) lies further from the next one than a mean of three
    assert lower_prediction_factor(rows, 1) < lower_prediction_factor(rows, 2) < lower_prediction_factor(rows, 3)
    assert geometric_mean([math.e ** 1.0, math.e ** 1.2]) == pytest.approx(math.e ** 1.1)
    # a run that met the limit nowhere (0) or a burst (inf) has no log: its row is left out
    assert lower_prediction_factor([*rows, [0.0, 5.0], [math.inf, 3.0]], 2) == pytest.approx(expected, abs=1e-4)
    assert lower_prediction_factor([[4.0], [5.0]], 1) is None  # one round: no spread to go by
    assert math.isnan(geometric_mean([])) and math.isnan(geometric_mean([2.0, 0.0]))


def test_one_more_run_lands_above_the_bound_19_times_in_20():
    """Log-normal runs around each config's own level (the same spread for every config): over many seeded studies
    of 3 configs x 3 rounds, a fourth round of a config lands above its bound in about 95% of them."""
    import random

    rnd = random.Random(7)
    above, studies = 0, 4000
    for _ in range(studies):
        levels = [rnd.uniform(20, 60) for _ in range(3)]
        rows = [[m * math.exp(rnd.gauss(0, 0.08)) for _ in range(3)] for m in levels]
        bound = geometric_mean(rows[0]) * lower_prediction_factor(rows, 3)
        above += levels[0] * math.exp(rnd.gauss(0, 0.08)) >= bound
    assert 0.94 <= above / studies <= 0.96


def test_the_degrees_of_freedom_behind_a_gains_interval():
    # 3 configs x 3 rounds: (3 - 1)(3 - 1) = 4; the third dropped out after 3 of 4 rounds: 11 values - 3 - 4 + 1 = 5
    # (as in test_a_config_that_dropped_out_keeps_its_rounds_in_the_spread); a config that met the limit nowhere is
    # left out: the pair, 2; the defaults at 0 in a round: their 2 other rounds' pairs alone, 1; the other config at
    # 0 in a round: the pairs of all 3 rounds, 2
    full = [[1.0, 1.2, 0.9], [1.1, 1.3, 1.0], [1.05, 1.2, 0.95]]
    assert block_gain_df(full, 0, 1) == 4
    assert block_gain_df([[1.0, 1.2, 0.9, 1.0], [1.1, 1.3, 1.0, 1.1], [1.0, 1.2, 0.8, None]], 0, 1) == 5
    assert block_gain_df([*full[:2], [0.0, 1.0, 1.0]], 0, 1) == 2
    assert block_gain_df([[0.0, 1.0, 1.0], *full[1:]], 0, 1) == 1
    assert block_gain_df([full[0], [0.0, 1.0, 1.0], full[2]], 0, 1) == 2
    # the t behind block_gain_interval's half-width is the one on those degrees of freedom
    g = block_gain_interval(full, 0, 1)
    logs = [[math.log(v) for v in row] for row in full]
    sse, _ = additive_residual(logs)
    half = t_quantile(0.95, block_gain_df(full, 0, 1)) * math.sqrt(2 * sse / 4 / 3)
    d = sum(math.log(b / a) for a, b in zip(full[0], full[1])) / 3
    assert (g.low, g.high) == (pytest.approx(math.exp(d - half) - 1), pytest.approx(math.exp(d + half) - 1))


def test_the_variance_of_a_median_by_hand_and_by_draws():
    import random

    assert median_variance(1) == 1.0 and median_variance(2) == 0.5  # one value; the mean of two
    assert median_variance(40) == pytest.approx(math.pi / 80)
    rnd = random.Random(3)
    for m in (3, 4, 6, 9):
        medians = [sorted(rnd.gauss(0, 1) for _ in range(m)) for _ in range(20000)]
        values = [(v[(m - 1) // 2] + v[m // 2]) / 2 for v in medians]
        mean = sum(values) / len(values)
        assert sum((x - mean) ** 2 for x in values) / len(values) == pytest.approx(median_variance(m), rel=0.04)
    with pytest.raises(ValueError):
        median_variance(0)


def test_a_right_interval_holds_a_noisy_re_measurement_as_often_as_its_chance_says():
    """Seeded studies of 3 configs x 8 rounds, log-normal runs (a spread of 4% a run, each round shifting all):
    the 95% interval of the gain holds the true gain ~95% of the time, but a re-measured median of 3 more rounds
    only as often as `chance_inside` says, and of 12 more rounds more often."""
    import random

    rnd = random.Random(11)
    studies, rounds, sd, gain = 3000, 8, 0.04, math.log(1.05)
    held = {"truth": 0, 3: 0, 12: 0}
    for _ in range(studies):
        shifts = [rnd.gauss(0, 0.05) for _ in range(rounds)]
        rows = [[math.exp(level + s + rnd.gauss(0, sd)) for s in shifts] for level in (0.0, gain, -0.02)]
        g = block_gain_interval(rows, 0, 1)
        held["truth"] += g.contains(math.exp(gain) - 1)
        for again in (3, 12):
            ratios = sorted(math.exp(gain + rnd.gauss(0, sd) - rnd.gauss(0, sd)) for _ in range(again))
            held[again] += g.contains((ratios[(again - 1) // 2] + ratios[again // 2]) / 2 - 1)
    t = t_quantile(0.95, 14)
    assert held["truth"] / studies == pytest.approx(0.95, abs=0.015)
    assert chance_inside(t, 14, rounds, 3) == pytest.approx(0.666, abs=0.001)  # P(|T14| <= 2.145 / sqrt(1 + 8 x 0.449))
    assert held[3] / studies == pytest.approx(chance_inside(t, 14, rounds, 3), abs=0.025)
    assert held[12] / studies == pytest.approx(chance_inside(t, 14, rounds, 12), abs=0.025)
    assert chance_inside(t, 14, rounds, 12) > chance_inside(t, 14, rounds, 3) + 0.1
    with pytest.raises(ValueError):
        chance_inside(t, 0, rounds, 3)
