"""Pure: group-sequential boundaries for the confirmation's block design, so that intervals looked at after every
round keep their coverage together.

The confirmation (optimizer/search/confirm.py) looks at its gain interval after every round from the second on and
stops once it decides (measurement/sequential.py). Each look's interval must be wider than a single 95% interval,
or stopping on the first look that decides covers less than 95% of the time. Splitting the 5% over the looks and
adding the shares up (Bonferroni, the union bound) is safe but pays for the looks as if they were independent, and
they are not: the look after round 4 holds the rounds the look after round 3 held.

The exact price: the gain's statistic at the look after round r is the block design's
T_r = d_r / sqrt(2 MSE_r / r) (measurement/intervals.py::block_gain_interval: d_r the mean log ratio of the pair
over r rounds, MSE_r the residual mean square of log value = config + round over every config, on (C - 1)(r - 1)
degrees of freedom). Under no gain and normal residuals its joint law over the looks depends on C and the rounds
alone (the configs' levels and the rounds' shifts drop out of the fit), so it is simulated once: `SIMULATIONS`
studies of C x R standard normal residuals from a fixed seed, every look's |T_r| computed as the interval computes
it. The boundary of look k is then the one whose *first* crossing there has exactly the share of the error that
look may spend (Lan & DeMets' alpha spending), among the studies that did not cross before (`spending_boundaries`).
The intervals whose half-widths are those boundaries' standard errors are repeated confidence intervals (Jennison &
Turnbull, *Group Sequential Methods*, 2000, ch. 9): they cover the true gain at every look at once with probability
1 - the error spent in all, whichever look the rounds stop at.

With known variance (many configs) the boundaries are the classical ones: O'Brien & Fleming's and Pocock's
published boundaries for 4 equal looks cross with 0.050 (tests/measurement/test_boundaries.py). With 3 configs and
5 rounds, the confirmation's spending (5% x (r / R)^3) gives the looks after rounds 2-5 the confidences 99.7%, 99.2%,
98.2% and 96.4%, where the union bound gave 99.7%, 99.2%, 98.5% and 97.6%. (Boundaries on the normal scale,
converted to t on each look's degrees of freedom, the usual stand-in, spent 5.9% in a simulation of this design:
each look's estimated spread moves the looks apart, so they share less than a known one would.)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

SIMULATIONS = 100_000  # studies simulated: a share of 2.4% is then known within +-0.1 points (2 standard errors)
SEED = 20261204  # fixed: the same plan gets the same boundaries in every process, on every machine


def _statistics(configs: int | None, max_rounds: int, simulations: int, seed: int) -> np.ndarray:
    """|T_r| at the looks after rounds 2..`max_rounds` of `simulations` studies of `configs` configs with no gain
    (shape: simulations x looks); the pair is config 1 against config 0, every config in the residual. `configs`
    None: the spread is known (the normal limit of many configs), |T_r| = |d_r| / sqrt(2 / r)."""
    if (configs is not None and configs < 2) or max_rounds < 2:
        raise ValueError("a look needs two configs and two rounds")
    e = np.random.default_rng(seed).standard_normal((simulations, configs or 2, max_rounds))
    out = np.empty((simulations, max_rounds - 1))
    for r in range(2, max_rounds + 1):
        x = e[:, :, :r]
        if configs is None:
            mse = np.ones(simulations)
        else:
            residual = x - x.mean(axis=2, keepdims=True) - x.mean(axis=1, keepdims=True) + x.mean(axis=(1, 2),
                                                                                                    keepdims=True)
            mse = (residual ** 2).sum(axis=(1, 2)) / ((configs - 1) * (r - 1))
        out[:, r - 2] = np.abs(x[:, 1, :].mean(axis=1) - x[:, 0, :].mean(axis=1)) / np.sqrt(2 * mse / r)
    return out


def crossing_probabilities(bounds: Sequence[float], configs: int | None, simulations: int = SIMULATIONS,
                           seed: int = SEED) -> list[float]:
    """Under no gain, the chance that the look after round k + 2 is the first whose |T| exceeds `bounds[k]`, for a
    block design of `configs` configs (None: a known spread) looked at after rounds 2..len(bounds) + 1."""
    t = _statistics(configs, len(bounds) + 1, simulations, seed)
    alive = np.ones(simulations, dtype=bool)
    out = []
    for k, bound in enumerate(bounds):
        crossed = alive & (t[:, k] > bound)
        out.append(float(crossed.sum()) / simulations)
        alive &= ~crossed
    return out


@lru_cache(maxsize=64)
def spending_boundaries(configs: int | None, shares: tuple[float, ...], simulations: int = SIMULATIONS,
                        seed: int = SEED) -> tuple[float, ...]:
    """The boundaries on |T| whose first crossing at the look after round k + 2 has the chance `shares[k]` under no
    gain (the error that look spends, not the running total), for a block design of `configs` configs: look by look,
    the quantile of |T| among the simulated studies that did not cross before that leaves the share above it."""
    if any(not 0 < s < 1 for s in shares) or sum(shares) >= 1 or not shares:
        raise ValueError("one share of the error per look, each in (0, 1), less than 1 in all")
    t = _statistics(configs, len(shares) + 1, simulations, seed)
    alive = np.ones(simulations, dtype=bool)
    bounds = []
    for k, share in enumerate(shares):
        left = t[alive, k]
        above = share * simulations / max(len(left), 1)
        bound = 0.0 if above >= 1 else float(np.quantile(left, 1 - above))
        alive &= t[:, k] <= bound
        bounds.append(bound)
    return tuple(bounds)
