"""Pure: how noisy a measurement is, and whether one config really beats another.

The same config measured again on a shared machine gives another throughput. Each study measures its baseline
several times (and every trial, with `--repeats N`); the coefficient of variation (CV = standard deviation /
mean) of those repeats is the study's noise level. A challenger counts as better only when its gain exceeds
`Z` standard errors of the difference of two means:

    gain > Z * CV * sqrt(1/n_challenger + 1/n_incumbent)

so with CV 3% and single measurements a gain must exceed 2 x 3% x 1.41 = 8.5%; with 3 repeats each, 4.9%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z = 2.0  # about 95% one-sided confidence under a normal error


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Sample standard deviation / mean; NaN with fewer than two values or a mean of 0."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    if mean == 0:
        return math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(var) / abs(mean)


def noise_threshold(cv: float, n_challenger: int = 1, n_incumbent: int = 1) -> float:
    """The relative gain below which a difference is measurement noise (0 when the noise is unknown)."""
    if math.isnan(cv) or n_challenger < 1 or n_incumbent < 1:
        return 0.0
    return Z * cv * math.sqrt(1 / n_challenger + 1 / n_incumbent)


def required_gain(cv: float, n_challenger: int = 1, n_incumbent: int = 1, resolution: float = 0.0) -> float:
    """The relative gain a challenger needs: the larger of the noise threshold and the incumbent's `resolution`
    (how precisely its own number is known, e.g. the gap between the rate it passed and the next it failed)."""
    return max(noise_threshold(cv, n_challenger, n_incumbent), resolution)


def beats(challenger: float, incumbent: float, cv: float, n_challenger: int = 1, n_incumbent: int = 1,
          resolution: float = 0.0) -> bool:
    """True when `challenger` exceeds `incumbent` by more than the noise (and resolution) allows."""
    if incumbent <= 0:
        return challenger > 0
    return challenger / incumbent - 1 > required_gain(cv, n_challenger, n_incumbent, resolution)


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    if not n:
        return math.nan
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
