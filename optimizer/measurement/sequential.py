"""Pure: when the confirmation's rounds have decided, and what they decided.

The confirmation (optimizer/search/confirm.py) measures vLLM's defaults and the search's best candidates again, in
paired rounds. It does not run a fixed number of rounds: after every full round from the second on it *looks* at
the gain intervals, and stops as soon as they decide. Looking after every round and stopping on the first look that
decides would make a 95% interval cover less than 95% of the time, so the 5% error is **spent over the looks the
plan allows**: with up to R rounds there are R - 1 looks (rounds 2..R), and by the look after round r the rounds
have spent ALPHA * (r / R)^3 of it (`look_alpha`: the increment is that look's share). The cubic curve is the power
family that approximates O'Brien-Fleming's boundary (Kim & DeMets): early looks, with few rounds and wide
intervals, decide only on a gain that is plain; the last look keeps most of the error, and with it the narrowest
interval.

How a look's share becomes its interval's confidence (`look_confidence_at`):

- **Group-sequential** (`"looks": "group-sequential"` in the plan): the boundary of each
  look is the one whose *first* crossing there has exactly that share under no gain, given that the looks before
  did not cross (measurement/boundaries.py, simulated for the block design the intervals come from: the looks share
  their rounds, so a look after another crosses less often than alone). These are repeated confidence intervals:
  all the looks' intervals cover the true gain at once with probability 95%. With 3 configs and 5 rounds: 99.7%,
  99.2%, 98.2% and 96.4% at rounds 2-5; with 3 rounds, 98.5% and 96.1%. The plan's configs count; one that drops
  out later leaves them as planned, and a default plan's rounds then grow (`spent`).
- **Bonferroni with unequal shares** (`"spending"` alone in the plan): each look's interval at
  1 - its share, the union bound; the shares add up to ALPHA. With 5 rounds: 99.7%, 99.2%, 98.5%, 97.6%.
- A plan with neither keeps one confidence for every look (1 - 0.05 / (R - 1)).

A gain interval *decides* when it lies wholly above 0 (better), wholly below 0 (worse), or within +-3 points of 0
(no gain worth a change: `TIE_HALF_WIDTH`). The confirmation stops when:

- the leader (the config with the highest median so far) is not vLLM's defaults, and its gain over the defaults
  decides: when it lies within +-3 points of 0 or below 0, `Outcome.KEEP`; when it lies above 0, `Outcome.BETTER`
  once its half-width is at most 5 points or the planned rounds ran out, and until then the rounds go on
  (`PRECISE_HALF_WIDTH`, stored in the plan as `"precise_half_width"`; a gain of +13.6% [+3.2%, +21.6%] after 4 of
  6 rounds says "better" but not by how much to plan for: the planned rounds go on narrowing it, and the repeated
  confidence intervals below stay valid whichever look the rounds stop at; a plan without it stops on any width);
- the leader is vLLM's defaults, and every other candidate still measured decides against them: `Outcome.KEEP`;
- else, when the planned rounds ran out: `Outcome.UNDECIDED`, with the interval as it stands (across 0 and wider
  than +-3 points).

A candidate clearly behind the leader (its interval of the gain over the leader wholly below 0) drops out: it is
not measured in later rounds (`behind`). Its rounds before stay in the residual spread the gain's interval pools
(intervals.py::block_gain_interval, least squares over the runs there are), and in a plan made by default the runs it
leaves go to more rounds of the configs still measured (search/split.py::rounds_after_drop). A plan that grows so
keeps the error its looks had spent by then and spends the rest over the looks after, along the larger plan's
curve (`spent`): the looks of both plans together spend ALPHA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum

from optimizer.measurement.boundaries import spending_boundaries
from optimizer.measurement.intervals import Interval, t_quantile, t_within

ALPHA = 0.05  # the error the confirmation's interval allows, over all its looks together
FIRST_LOOK_ROUND = 2  # one round gives no interval: the first look is after the second round
SPENDING_POWER = 3  # the error spent by the look after round r of R: ALPHA * (r / R) ** SPENDING_POWER
TIE_HALF_WIDTH = 0.03  # a gain interval within +-3 points of 0 decides: no gain worth a change
PRECISE_HALF_WIDTH = 0.05  # a gain above 0 stops the rounds once its interval's half-width is at most 5 points
GROUP_SEQUENTIAL = "group-sequential"  # a plan's "looks": each look's boundary given the looks before it
PROJECTED_ROUNDS = 6  # `rounds_to_decide` looks this many rounds ahead at most


class Outcome(str, Enum):
    """What the confirmation's rounds say of the recommendation against vLLM's defaults."""

    RUNNING = "running"  # not decided, and rounds are left
    BETTER = "better"  # the recommendation's gain interval lies above 0 (within +-5 points, or the rounds ran out)
    KEEP = "keep"  # vLLM's defaults are as good as any candidate (within +-3 points) or better
    UNDECIDED = "undecided"  # the rounds ran out with an interval across 0, wider than +-3 points


def spent(max_rounds: int, round_: int, power: float = SPENDING_POWER,
          grown: Sequence[tuple[int, int]] = ()) -> float:
    """Pure: the error spent by the looks up to the one after round `round_` of a plan of up to `max_rounds` rounds:
    ALPHA * (r / R) ** `power`. A plan whose rounds grew while it ran (`grown`: each growth as (the full rounds done
    then, the rounds planned before it), in order) keeps what its looks had spent by each growth and spends the rest
    of ALPHA over the looks after it along the same curve of the larger plan: the looks already taken keep the error
    they spent (their boundaries move by the simulation's noise alone, measurement/boundaries.py), and the looks of
    all the plans together still spend ALPHA."""
    starts = [0, *(done for done, _ in grown)]
    plans = [*(before for _, before in grown), max_rounds]
    used = 0.0
    for i, (start, rounds) in enumerate(zip(starts, plans)):
        end = starts[i + 1] if i + 1 < len(starts) else math.inf
        frac = (min(round_, end) / rounds) ** power
        first = (start / rounds) ** power
        value = used + (ALPHA - used) * (frac - first) / (1 - first) if first < 1 else used
        if round_ <= end:
            return min(value, ALPHA)
        used = min(value, ALPHA)
    return used


def look_alpha(max_rounds: int, round_: int, power: float = SPENDING_POWER,
               grown: Sequence[tuple[int, int]] = ()) -> float:
    """Pure: the error allowed to the look after round `round_` of a plan of up to `max_rounds` rounds: the increment
    of `spent` (ALPHA * (r / R) ** `power`; a plan that grew, `grown`: see `spent`) from the look before (the first
    look: all of it up to round 2). Rounds are clamped to the looks the plan has, so the shares of rounds 2..R add up
    to ALPHA."""
    last = max(max_rounds, FIRST_LOOK_ROUND)
    r = min(max(round_, FIRST_LOOK_ROUND), last)
    return spent(last, r, power, grown) - (spent(last, r - 1, power, grown) if r > FIRST_LOOK_ROUND else 0.0)


def look_confidence_at(max_rounds: int, round_: int, power: float = SPENDING_POWER,
                       group_sequential: bool = True, configs: int = 3,
                       grown: Sequence[tuple[int, int]] = ()) -> float:
    """Pure: the two-sided confidence of the interval shown at the look after round `round_` of a plan of up to
    `max_rounds` rounds of `configs` configs (`grown`: how its rounds grew while it ran, `spent`). Group-sequential:
    Student's t's coverage at that look's boundary on its (configs - 1)(round_ - 1) degrees of freedom, the
    boundaries spending `look_alpha`'s shares exactly in the block design (measurement/boundaries.py); else 1 - the
    share itself (Bonferroni)."""
    last = max(max_rounds, FIRST_LOOK_ROUND)
    r = min(max(round_, FIRST_LOOK_ROUND), last)
    grown = tuple((int(done), int(before)) for done, before in grown)
    if not group_sequential or r == FIRST_LOOK_ROUND:  # the first look has none before it: its share alone
        return 1 - look_alpha(max_rounds, round_, power, grown)
    configs = max(configs, 2)
    shares = tuple(look_alpha(last, k, power, grown) for k in range(FIRST_LOOK_ROUND, last + 1))
    bound = spending_boundaries(configs, shares)[r - FIRST_LOOK_ROUND]
    return t_within(bound, (configs - 1) * (r - 1))


def decides(gain: Interval, tie_half_width: float = TIE_HALF_WIDTH) -> bool:
    """True when the gain interval lies above 0, below 0, or within +-`tie_half_width` of 0."""
    if not gain.known:
        return False
    return gain.low > 0 or gain.high < 0 or (gain.low >= -tie_half_width and gain.high <= tie_half_width)


def behind(difference: Interval) -> bool:
    """True when a config's gain over the leader lies wholly below 0: it drops out of the later rounds."""
    return difference.known and difference.high < 0


def outcome(gains: Sequence[Interval], leader_is_defaults: bool, rounds_done: int, max_rounds: int,
            precise_half_width: float = PRECISE_HALF_WIDTH) -> Outcome:
    """What the rounds say so far. `gains` are gains over vLLM's defaults: the leader's alone when the leader is not
    the defaults; each other candidate still measured when it is (none: nothing left to beat them). A gain above 0
    stops the rounds once its half-width is at most `precise_half_width` (a plan stored without one: infinity,
    any width)."""
    if rounds_done >= FIRST_LOOK_ROUND:
        if not leader_is_defaults and gains:
            gain = gains[0]
            if decides(gain) and gain.low <= 0:
                return Outcome.KEEP
            if decides(gain) and ((gain.high - gain.low) / 2 <= precise_half_width or rounds_done >= max_rounds):
                return Outcome.BETTER
        elif leader_is_defaults and all(decides(g) for g in gains):
            return Outcome.KEEP
    return Outcome.UNDECIDED if rounds_done >= max_rounds else Outcome.RUNNING


def rounds_to_decide(gain: Interval, confidence: float, rounds_done: int, configs: int = 3,
                     most: int = PROJECTED_ROUNDS) -> int | None:
    """Pure: how many more rounds would be expected to decide `gain` if its point and the runs' spread stay as
    measured: 0 when it decides already, else the fewest k <= `most` whose plan of `rounds_done` + k rounds gives,
    at its last look, an interval that excludes 0 or lies within +-TIE_HALF_WIDTH (`decides`); None when no k up to
    `most` does.

    `gain` is a block-design interval (intervals.py::block_gain_interval: exp(d +- t * sqrt(2 MSE / R)) - 1) at
    `confidence` after `rounds_done` full rounds of `configs` configs, the last look of its plan; its log bounds give d
    and the half-width, which with that look's t give sqrt(2 MSE). A plan of R rounds then shows, at its last look,
    t_R * sqrt(2 MSE / R), t_R on (configs - 1)(R - 1) degrees of freedom at the same `confidence`: the last look's
    confidence barely moves with the plan's length (96.5-96.7% for 6 to 10 rounds of 3 configs), and finding each
    plan's boundaries takes a simulation each. A projection, not a promise: the next rounds' spread and gain are
    measured anew."""
    if not gain.known or rounds_done < FIRST_LOOK_ROUND or gain.low <= -1:
        return None
    if decides(gain):
        return 0
    low, high = math.log1p(gain.low), math.log1p(gain.high)
    d, half = (low + high) / 2, (high - low) / 2
    spread = half / t_quantile(confidence, (configs - 1) * (rounds_done - 1)) * math.sqrt(rounds_done)
    tie_low, tie_high = math.log1p(-TIE_HALF_WIDTH), math.log1p(TIE_HALF_WIDTH)
    for k in range(1, most + 1):
        r = rounds_done + k
        h = t_quantile(confidence, (configs - 1) * (r - 1)) * spread / math.sqrt(r)
        if h < abs(d) or (d - h >= tie_low and d + h <= tie_high):
            return k
    return None
