"""Group-sequential boundaries for the confirmation's block design (measurement/boundaries.py): against published
constants where the spread is known, and against independent simulations where it is estimated."""

import math

import pytest

from optimizer.measurement.boundaries import crossing_probabilities, spending_boundaries
from optimizer.measurement.intervals import t_quantile, t_within

SHARES_5 = (0.0032, 0.0076, 0.0148, 0.0244)  # 5% x (r/5)^3 spent by rounds 2..5 (measurement/sequential.py)


def test_published_boundaries_for_equal_looks_cross_with_five_percent_when_the_spread_is_known():
    # Jennison & Turnbull (2000), tables 2.1 and 2.3: two-sided 5%, K = 4 equally spaced looks: Pocock's constant
    # 2.361, O'Brien & Fleming's 2.024 x sqrt(4 / k). Looks after rounds 2, 3, 4, 5 are not equally spaced, so the
    # rounds here are 2, 4, 6, 8 (looks after every other round: information 1, 2, 3, 4 in units of 2 rounds).
    rounds = 8
    every_other = [k for k in range(2, rounds + 1)]
    pocock = [2.361 if r % 2 == 0 else math.inf for r in every_other]
    obf = [2.024 * math.sqrt(4 / (r // 2)) if r % 2 == 0 else math.inf for r in every_other]
    assert sum(crossing_probabilities(pocock, None)) == pytest.approx(0.05, abs=0.0015)
    assert sum(crossing_probabilities(obf, None)) == pytest.approx(0.05, abs=0.0015)


def test_one_look_is_students_t_on_its_degrees_of_freedom():
    # 3 configs, 2 rounds: one look on (3 - 1)(2 - 1) = 2 degrees of freedom; 2 configs: on 1
    # (the quantile of 100000 simulated |T| on 2 degrees of freedom, where the density is thin: within 3% of 4.303)
    assert spending_boundaries(3, (0.05,)) == pytest.approx((t_quantile(0.95, 2),), rel=0.03)
    assert spending_boundaries(None, (0.05,)) == pytest.approx((1.95996,), rel=0.01)


def test_the_boundaries_spend_their_shares_on_other_simulations_too():
    bounds = spending_boundaries(3, SHARES_5)
    assert crossing_probabilities(bounds, 3) == pytest.approx(list(SHARES_5), abs=1e-4)  # its own simulation
    # independent ones: 3 x 100000 studies spend 5% within 0.15 points (the boundaries' own sampling error included)
    again = [sum(crossing_probabilities(bounds, 3, seed=seed)) for seed in (1, 2, 3)]
    assert sum(again) / 3 == pytest.approx(0.05, abs=0.0015)
    assert list(bounds) == sorted(bounds, reverse=True)  # later looks keep more of the error: lower boundaries
    # the looks share their rounds, so each later boundary is below the one its share alone would need
    alone = [t_quantile(1 - s, 2 * (r - 1)) for s, r in zip(SHARES_5, (2, 3, 4, 5))]
    assert t_within(bounds[0], 2) == pytest.approx(1 - SHARES_5[0], abs=5e-4)  # the first look: alone
    assert all(b < a for b, a in zip(bounds[1:], alone[1:]))


def test_bad_plans_are_refused():
    with pytest.raises(ValueError):
        spending_boundaries(1, (0.05,))
    with pytest.raises(ValueError):
        spending_boundaries(3, (0.5, 0.6))
    with pytest.raises(ValueError):
        spending_boundaries(3, ())
