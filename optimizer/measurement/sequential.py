"""Pure: when the confirmation's rounds have decided, and what they decided.

The confirmation (optimizer/search/confirm.py) measures vLLM's defaults and the search's best candidates again, in
paired rounds. It does not run a fixed number of rounds: after every full round from the second on it *looks* at
the gain intervals, and stops as soon as they decide. Looking after every round and stopping on the first look that
decides would make a 95% interval cover less than 95% of the time, so the 5% error is **split over the looks the
plan allows** (Bonferroni with unequal shares): with up to R rounds there are R - 1 looks (rounds 2..R), and the
look after round r gets the share ALPHA * ((r / R)^3 - ((r - 1) / R)^3) of it, the first look all that the power
curve has spent by then (`look_alpha`). The shares add up to ALPHA, so whatever round the rounds stop at, the
interval reported then covers the true gain with probability at least 95% (the union bound). The cubic curve is the
power family that approximates O'Brien-Fleming's boundary (Kim & DeMets): early looks, with few rounds and wide
intervals, decide only on a gain that is plain; the last look keeps most of the error, and with it the narrowest
interval. With 3 rounds: 98.5% at round 2, 96.5% at round 3 (equal shares: 97.5% each); with 5: 99.7%, 99.2%,
98.5%, 97.6%. Plans stored before the split kept one confidence for every look (1 - 0.05 / (R - 1)) and still do.

A gain interval *decides* when it lies wholly above 0 (better), wholly below 0 (worse), or within +-3 points of 0
(no gain worth a change: `TIE_HALF_WIDTH`). The confirmation stops when:

- the leader (the config with the highest median so far) is not vLLM's defaults, and its gain over the defaults
  decides: `Outcome.BETTER` when the interval is above 0, else `Outcome.KEEP`;
- the leader is vLLM's defaults, and every other candidate still measured decides against them: `Outcome.KEEP`;
- else, when the planned rounds ran out: `Outcome.UNDECIDED`, with the interval as it stands.

A candidate clearly behind the leader (its interval of the gain over the leader wholly below 0) drops out: it is
not measured in later rounds (`behind`).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from optimizer.measurement.intervals import Interval

ALPHA = 0.05  # the error the confirmation's interval allows, over all its looks together
FIRST_LOOK_ROUND = 2  # one round gives no interval: the first look is after the second round
SPENDING_POWER = 3  # the error spent by the look after round r of R: ALPHA * (r / R) ** SPENDING_POWER
TIE_HALF_WIDTH = 0.03  # a gain interval within +-3 points of 0 decides: no gain worth a change


class Outcome(str, Enum):
    """What the confirmation's rounds say of the recommendation against vLLM's defaults."""

    RUNNING = "running"  # not decided, and rounds are left
    BETTER = "better"  # the recommendation's gain interval lies above 0
    KEEP = "keep"  # vLLM's defaults are as good as any candidate (within +-3 points) or better
    UNDECIDED = "undecided"  # the rounds ran out with an interval across 0, wider than +-3 points


def looks(max_rounds: int) -> int:
    """The looks a plan of `max_rounds` allows: one after each round from the second on (at least one)."""
    return max(max_rounds - FIRST_LOOK_ROUND + 1, 1)


def look_confidence(max_rounds: int) -> float:
    """The confidence of every look's interval in a plan stored before the split (`look_alpha`): equal shares."""
    return 1 - ALPHA / looks(max_rounds)


def look_alpha(max_rounds: int, round_: int, power: float = SPENDING_POWER) -> float:
    """Pure: the error allowed to the look after round `round_` of a plan of up to `max_rounds` rounds: the increment
    of ALPHA * (r / R) ** `power` from the look before (the first look: all of it up to round 2). Rounds are clamped
    to the looks the plan has, so the shares of rounds 2..R add up to ALPHA."""
    last = max(max_rounds, FIRST_LOOK_ROUND)
    r = min(max(round_, FIRST_LOOK_ROUND), last)

    def spent(k: int) -> float:
        return ALPHA * (k / last) ** power

    return spent(r) - (spent(r - 1) if r > FIRST_LOOK_ROUND else 0.0)


def decides(gain: Interval, tie_half_width: float = TIE_HALF_WIDTH) -> bool:
    """True when the gain interval lies above 0, below 0, or within +-`tie_half_width` of 0."""
    if not gain.known:
        return False
    return gain.low > 0 or gain.high < 0 or (gain.low >= -tie_half_width and gain.high <= tie_half_width)


def behind(difference: Interval) -> bool:
    """True when a config's gain over the leader lies wholly below 0: it drops out of the later rounds."""
    return difference.known and difference.high < 0


def outcome(gains: Sequence[Interval], leader_is_defaults: bool, rounds_done: int, max_rounds: int) -> Outcome:
    """What the rounds say so far. `gains` are gains over vLLM's defaults: the leader's alone when the leader is not
    the defaults; each other candidate still measured when it is (none: nothing left to beat them)."""
    if rounds_done >= FIRST_LOOK_ROUND:
        if not leader_is_defaults and gains:
            if decides(gains[0]):
                return Outcome.BETTER if gains[0].low > 0 else Outcome.KEEP
        elif leader_is_defaults and all(decides(g) for g in gains):
            return Outcome.KEEP
    return Outcome.UNDECIDED if rounds_done >= max_rounds else Outcome.RUNNING
