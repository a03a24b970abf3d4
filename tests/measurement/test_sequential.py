"""The confirmation's stopping rule (measurement/sequential.py), on intervals built by hand."""

import math

import pytest

from optimizer.measurement.intervals import Interval, gain_interval
from optimizer.measurement.sequential import ALPHA, Outcome, behind, decides, look_alpha, outcome, spent


def iv(low: float, high: float, n: int = 3) -> Interval:
    return Interval((low + high) / 2, low, high, n)


def test_the_error_is_split_over_the_looks_most_of_it_kept_for_the_last():
    # by hand, 3 rounds: ALPHA x (2/3)^3 = 0.05 x 8/27 = 0.014815 at round 2, the rest (0.035185) at round 3
    assert math.isclose(look_alpha(3, 2), 0.05 * 8 / 27) and math.isclose(look_alpha(3, 3), 0.05 * 19 / 27)
    assert look_alpha(2, 2) == ALPHA  # one look: all of it
    # 5 rounds: 0.05 x (8, 27 - 8, 64 - 27, 125 - 64) / 125
    assert [round(look_alpha(5, r), 6) for r in (2, 3, 4, 5)] == [0.0032, 0.0076, 0.0148, 0.0244]
    for rounds in range(2, 11):
        shares = [look_alpha(rounds, r) for r in range(2, rounds + 1)]
        assert math.isclose(sum(shares), ALPHA)  # the union bound: 95% whichever look stops the rounds
        assert shares == sorted(shares)  # each later look keeps more of the error than the one before
    assert look_alpha(5, 9) == look_alpha(5, 5) and look_alpha(5, 1) == look_alpha(5, 2)  # clamped to the looks


def test_a_plan_that_grew_keeps_what_its_looks_spent_and_spends_the_rest_after():
    # 8 rounds planned, grown to 9 after 6 (a config dropped out, its runs went to another round). By hand: the looks
    # up to round 6 spent 0.05 x (r / 8)^3, 0.0210938 by round 6; the rest, 0.0289063, is spent over rounds 7-9
    # along (r / 9)^3 from (6 / 9)^3: by round 7, 0.0210938 + 0.0289063 x ((7/9)^3 - (6/9)^3) / (1 - (6/9)^3)
    grown = ((6, 8),)
    for r in range(2, 7):
        assert spent(9, r, grown=grown) == pytest.approx(0.05 * (r / 8) ** 3)
    s6 = 0.05 * (6 / 8) ** 3
    assert spent(9, 7, grown=grown) == pytest.approx(s6 + (0.05 - s6) * ((7 / 9) ** 3 - (6 / 9) ** 3)
                                                      / (1 - (6 / 9) ** 3))
    assert spent(9, 9, grown=grown) == pytest.approx(ALPHA)
    shares = [look_alpha(9, r, grown=grown) for r in range(2, 10)]
    assert math.isclose(sum(shares), ALPHA)  # all the looks of both plans together: still 5%
    assert shares[:5] == pytest.approx([look_alpha(8, r) for r in range(2, 7)])  # the looks taken keep their shares
    # grown twice (after 3 of 5 to 6, then after 5 of 6 to 7): each growth keeps what was spent by then
    twice = ((3, 5), (5, 6))
    assert spent(7, 3, grown=twice) == pytest.approx(0.05 * (3 / 5) ** 3)
    s5 = spent(6, 5, grown=((3, 5),))
    assert spent(7, 5, grown=twice) == pytest.approx(s5) and spent(7, 7, grown=twice) == pytest.approx(ALPHA)
    assert spent(5, 4) == pytest.approx(0.05 * (4 / 5) ** 3)  # a plan that never grew: as before


def test_the_intervals_of_a_plan_grown_after_a_drop_cover_at_every_look_together():
    """3 configs planned for 4 rounds; the third drops out after round 2 and its runs go to 2 more rounds of the other
    two (6 rounds, split.py::rounds_after_drop), its first 2 rounds kept in the spread: the gain intervals of all
    five looks still cover the true gain together in about 95% of the studies."""
    import random

    from optimizer.measurement.intervals import block_gain_interval
    from optimizer.measurement.sequential import look_confidence_at

    rng = random.Random(5)
    true_gain, studies, grown = 0.05, 2000, ((2, 4),)
    missed = 0
    for _ in range(studies):
        shifts = [rng.gauss(0.0, 0.05) for _ in range(6)]
        rows = [[math.exp(math.log(50.0) + shifts[r] + rng.gauss(0.0, 0.04)) for r in range(6)],
                [math.exp(math.log(50.0 * (1 + true_gain)) + shifts[r] + rng.gauss(0.0, 0.04)) for r in range(6)],
                [math.exp(math.log(48.0) + shifts[r] + rng.gauss(0.0, 0.04)) if r < 2 else None for r in range(6)]]
        for r in range(2, 7):
            confidence = look_confidence_at(6 if r > 2 else 4, r, configs=3, grown=grown if r > 2 else ())
            if not (g := block_gain_interval([row[:r] for row in rows], 0, 1, confidence)).low <= true_gain <= g.high:
                missed += 1
                break
    assert 0.035 <= missed / studies <= 0.065  # ~0.05: 3 standard errors of 2000 studies either side


def test_a_gain_interval_decides_above_below_or_within_three_points():
    assert decides(iv(0.01, 0.20))  # above 0: better
    assert decides(iv(-0.20, -0.01))  # below 0: worse
    assert decides(iv(-0.025, 0.029))  # within +-3 points: no gain worth a change
    assert not decides(iv(-0.02, 0.05))  # across 0 and wider than +-3 points
    assert not decides(Interval(0.1, math.nan, math.nan, 1))  # one round: no interval


def test_the_rounds_stop_when_the_leaders_gain_over_the_defaults_decides():
    assert outcome([iv(0.03, 0.12)], False, 2, 3) == Outcome.BETTER  # above 0, +-4.5 points
    assert outcome([iv(0.02, 0.13)], False, 2, 3) == Outcome.RUNNING  # above 0, +-5.5 points
    # above 0 but +-9.2 points wide (a real run after 4 of 6 rounds): the planned rounds
    # go on narrowing it; the last one reports it as it stands
    assert outcome([iv(0.032, 0.216)], False, 4, 6) == Outcome.RUNNING
    assert outcome([iv(0.032, 0.216)], False, 6, 6) == Outcome.BETTER
    # a plan stored before the rule (no "precise_half_width": any width) stopped there, and still reads so
    assert outcome([iv(0.032, 0.216)], False, 4, 6, precise_half_width=math.inf) == Outcome.BETTER
    assert outcome([iv(-0.25, -0.05)], False, 4, 6) == Outcome.KEEP  # a leader worse than the defaults stops them
    assert outcome([iv(-0.02, 0.02)], False, 2, 3) == Outcome.KEEP
    assert outcome([iv(-0.05, 0.12)], False, 2, 3) == Outcome.RUNNING
    assert outcome([iv(-0.05, 0.12)], False, 3, 3) == Outcome.UNDECIDED
    assert outcome([iv(0.02, 0.12)], False, 1, 3) == Outcome.RUNNING  # no look before the second round


def test_with_the_defaults_leading_every_other_candidate_must_decide():
    assert outcome([iv(-0.2, -0.05), iv(-0.02, 0.01)], True, 2, 4) == Outcome.KEEP
    assert outcome([iv(-0.2, -0.05), iv(-0.08, 0.04)], True, 2, 4) == Outcome.RUNNING
    assert outcome([], True, 2, 4) == Outcome.KEEP  # every other candidate dropped out


def test_a_candidate_clearly_behind_drops_out():
    assert behind(iv(-0.2, -0.01))
    assert not behind(iv(-0.2, 0.01))
    # by hand: per-round gains -10%, -12%, -11%: mean -11%, s = 1%, t(0.975, 2) = 4.303: [-13.5%, -8.5%]
    g = gain_interval([(100.0, 90.0), (100.0, 88.0), (100.0, 89.0)])
    assert math.isclose(g.low, -0.11 - 4.303 * 0.01 / math.sqrt(3), abs_tol=1e-9) and behind(g)


def test_group_sequential_looks_pay_less_than_the_union_bound_for_the_same_spending():
    from optimizer.measurement.sequential import look_confidence_at

    exact = [look_confidence_at(5, r) for r in (2, 3, 4, 5)]
    assert exact == pytest.approx([0.9967, 0.9923, 0.9818, 0.9639], abs=1e-3)
    union = [look_confidence_at(5, r, group_sequential=False) for r in (2, 3, 4, 5)]
    assert union == pytest.approx([1 - look_alpha(5, r) for r in (2, 3, 4, 5)])
    assert exact[0] == union[0]  # the first look has no look before it to share with
    assert all(e < u for e, u in zip(exact[1:], union[1:]))  # every later look is narrower than the union bound's
    assert look_confidence_at(2, 2) == 0.95  # one look: a plain 95% interval
    assert look_confidence_at(5, 9) == look_confidence_at(5, 5)  # clamped to the looks


def test_the_block_designs_intervals_cover_at_every_look_together():
    """3 configs, up to 5 rounds, log values = config + round + noise (sd 4%, a run's residual spread on the demo):
    the gain intervals of all four looks cover the true gain together in about 95% of the studies, not fewer
    (coverage kept with an estimated spread, through t), and not many more (the union bound's are wider)."""
    import random

    from optimizer.measurement.intervals import block_gain_interval
    from optimizer.measurement.sequential import look_confidence_at

    rng = random.Random(4)
    true_gain, studies = 0.05, 3000
    missed = {True: 0, False: 0}
    for _ in range(studies):
        shifts = [rng.gauss(0.0, 0.05) for _ in range(5)]
        rows = [[math.exp(math.log(50.0) + shifts[r] + rng.gauss(0.0, 0.04)) for r in range(5)],
                [math.exp(math.log(50.0 * (1 + true_gain)) + shifts[r] + rng.gauss(0.0, 0.04)) for r in range(5)],
                [math.exp(math.log(48.0) + shifts[r] + rng.gauss(0.0, 0.04)) for r in range(5)]]
        for exact in (True, False):
            for r in (2, 3, 4, 5):
                confidence = look_confidence_at(5, r, group_sequential=exact)
                g = block_gain_interval([row[:r] for row in rows], 0, 1, confidence)
                if not g.low <= true_gain <= g.high:
                    missed[exact] += 1
                    break
    assert 0.035 <= missed[True] / studies <= 0.065  # ~0.05: 3 standard errors of 3000 studies either side
    assert missed[False] / studies < missed[True] / studies  # the union bound overpays


def test_rounds_to_decide_by_hand():
    from optimizer.measurement.intervals import Interval
    from optimizer.measurement.sequential import rounds_to_decide

    def gain(d, h):  # a block-design interval: exp(d +- h) - 1
        return Interval(math.exp(d) - 1, math.exp(d - h) - 1, math.exp(d + h) - 1, 4)

    # 2 configs, 4 rounds, at 95%: t(3) = 3.182, so sqrt(2 MSE) = 0.06 / 3.182 x sqrt(4) = 0.037712. A plan of 5
    # rounds shows t(4) = 2.776 x 0.037712 / sqrt(5) = 0.04682, of 6 rounds t(5) = 2.571 x 0.037712 / sqrt(6) = 0.03959
    assert rounds_to_decide(gain(0.05, 0.04), 0.95, 4, configs=2) == 0  # excludes 0 already
    assert rounds_to_decide(gain(0.05, 0.06), 0.95, 4, configs=2) == 1  # 0.04682 < 0.05: excludes 0
    assert rounds_to_decide(gain(0.04, 0.06), 0.95, 4, configs=2) == 2  # 0.04682 > 0.04 > 0.03959
    assert rounds_to_decide(gain(-0.04, 0.06), 0.95, 4, configs=2) == 2  # below 0 decides as well
    # d = 0, h = 0.04: sqrt(2 MSE) = 0.025141; within +-3 points needs h <= ln 1.03 = 0.02956: 5 rounds give 0.03121,
    # 6 give 0.02639
    assert rounds_to_decide(gain(0.0, 0.04), 0.95, 4, configs=2) == 2
    assert rounds_to_decide(gain(0.0, 0.30), 0.95, 4, configs=2) is None  # no gain, a wide spread: not in 6 rounds
    assert rounds_to_decide(gain(0.0, 0.30), 0.95, 4, configs=2, most=200) is not None
    assert rounds_to_decide(Interval(0.1, math.nan, math.nan, 1), 0.95, 1) is None  # one round: no spread to project
