"""Noise math by hand: the CV of repeats and when a gain is more than noise."""

import math

import pytest

from optimizer.measurement.noise import beats, coefficient_of_variation, median, noise_threshold


def test_cv_by_hand():
    # mean 100, deviations -10, 0, +10: sample variance 100, sd 10
    assert coefficient_of_variation([90, 100, 110]) == pytest.approx(0.1)
    assert math.isnan(coefficient_of_variation([100]))
    assert math.isnan(coefficient_of_variation([0, 0]))


def test_threshold_shrinks_with_repeats():
    assert noise_threshold(0.03) == pytest.approx(2 * 0.03 * math.sqrt(2))  # 8.5%
    assert noise_threshold(0.03, 3, 3) == pytest.approx(2 * 0.03 * math.sqrt(2 / 3))  # 4.9%
    assert noise_threshold(math.nan) == 0.0  # unknown noise: any gain counts


def test_beats_only_beyond_noise():
    assert not beats(105, 100, cv=0.03)  # +5% < 8.5%
    assert beats(110, 100, cv=0.03)
    assert beats(105, 100, cv=0.03, n_challenger=3, n_incumbent=30) is True  # 2*0.03*sqrt(1/3+1/30) = 3.6%
    assert beats(1, 0, cv=0.5) and not beats(0, 0, cv=0.5)


def test_median():
    assert median([3, 1, 2]) == 2 and median([4, 1, 3, 2]) == 2.5 and math.isnan(median([]))
