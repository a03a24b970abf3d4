"""The numbers every view gives a config: the confirmation's where it was measured again, else the search's.

Confirmed, a config's throughput is the median of its full rounds with the 95% interval of their mean (Student t)
and the round count; its gain over vLLM's defaults is the ratio of the two medians (derivable from the numbers shown
beside it, and ranking the configs as their medians do), with the 95% interval of the mean per-round ratio (each
round measures both next to each other, so what moved both is left out; the spread is pooled over every config of
the rounds: measurement/intervals.py::block_gain_interval). Not confirmed, they are the search's one
measurement each, and say what that is (measured, a lower bound, a ceiling). The console's end table, `optimize
report` (table, JSON, CSV), export and `--bench-json` all read them from here (through `decide.Decision`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from optimizer.decision.trial import TrialView
from optimizer.measurement.intervals import relative_gain
from optimizer.measurement.noise import median
from optimizer.measurement.sequential import GROUP_SEQUENTIAL
from optimizer.search.confirmed import FIT_VALUE, Confirmation, Confirmed

CONFIRMED = "confirmation"
SEARCHED = "search"


def _looks_text(c: Confirmation) -> str:
    """How the plan's intervals pay for looking after every round, in words."""
    if c.plan.get("looks") == GROUP_SEQUENTIAL:
        return "group-sequential boundaries over the looks after each round: repeated confidence intervals"
    return "Bonferroni over the looks after each round"


def throughput_statistic(c: Confirmation) -> str:
    """What a confirmed throughput and its interval are, in words, for the rules of `c`'s plan."""
    run = ("its pooled fit's rate at the limit, in tok/s" if c.plan.get("value") == FIT_VALUE
           else "its throughput at its best passing probe")
    return f"median of the full rounds (a run's number: {run}); interval: 95% interval of their mean " \
           f"(Student t; {_looks_text(c)})"


def gain_statistic(c: Confirmation) -> str:
    """What a confirmed gain and its interval are, in words, for the rules of `c`'s plan."""
    return ("ratio of the two medians over the rounds both ran; interval: 95% interval of the mean per-round "
            "ratio (each round measures "
            "both next to each other; Student t on log throughput, the spread pooled over every config of the "
            f"rounds; {_looks_text(c)})")


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def interval_text(low: float, high: float, pct: bool = False) -> str:
    """'[702.0, 760.1]', or with `pct` '[+1.2%, +8.0%]'."""
    if pct:
        return f"[{low:+.1f}%, {high:+.1f}%]"
    return f"[{low:.1f}, {high:.1f}]"


@dataclass(frozen=True)
class Throughput:
    """One config's output throughput at the limit, as every view shows it."""

    trial: int
    source: str  # CONFIRMED or SEARCHED
    output_throughput_tok_s: float  # NaN: no number (the trial meets the limit nowhere)
    low_tok_s: float | None = None  # the 95% interval (confirmed, two rounds or more)
    high_tok_s: float | None = None
    rounds: int = 0  # full confirmation rounds behind it; 0: the search's one measurement
    answer: str = ""  # the search's answer (measured, lower bound, ceiling, ...); "confirmed" when confirmed
    statistic: str = ""  # confirmed: what the number and its interval are (`throughput_statistic`)

    @property
    def confirmed(self) -> bool:
        return self.source == CONFIRMED

    def text(self) -> str:
        """'409.0 output tok/s (median of 3 confirmation rounds, 95% interval of the mean [0.0, 821.8])'."""
        if not self.confirmed:
            return f"{self.output_throughput_tok_s:.1f} output tok/s ({self.answer}, one measurement)"
        rounds = f"median of {self.rounds} confirmation round{'s' if self.rounds != 1 else ''}"
        if self.low_tok_s is None or self.high_tok_s is None:
            return f"{self.output_throughput_tok_s:.1f} output tok/s ({rounds}: no interval)"
        return (f"{self.output_throughput_tok_s:.1f} output tok/s ({rounds}, 95% interval of the mean "
                f"{interval_text(self.low_tok_s, self.high_tok_s)})")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "output_throughput_tok_s": _finite(self.output_throughput_tok_s),
                "low_tok_s": self.low_tok_s, "high_tok_s": self.high_tok_s, "rounds": self.rounds,
                "answer": self.answer,
                "statistic": self.statistic if self.confirmed else "the search's one measurement"}


@dataclass(frozen=True)
class Gain:
    """A config's output throughput gain over vLLM's defaults, in percent, as every view shows it."""

    pct: float  # the ratio of the two numbers shown, minus 1
    low_pct: float | None = None  # confirmed: the 95% interval of the mean per-round ratio
    high_pct: float | None = None
    rounds: int = 0  # 0: from the search's one measurement each
    statistic: str = ""  # confirmed: what the gain and its interval are (`gain_statistic`)

    @property
    def known(self) -> bool:
        """True when there is an interval (two full rounds or more)."""
        return self.low_pct is not None and self.high_pct is not None

    def interval_text(self) -> str:
        assert self.low_pct is not None and self.high_pct is not None
        return interval_text(self.low_pct, self.high_pct, pct=True)

    def to_dict(self) -> dict[str, Any]:
        return {"gain_pct": _finite(self.pct), "low_pct": self.low_pct, "high_pct": self.high_pct,
                "rounds": self.rounds,
                "statistic": self.statistic if self.rounds else "ratio of the search's one measurement each"}


def confirmed_throughput(c: Confirmation, x: Confirmed) -> Throughput:
    """`x`'s numbers over the confirmation's full rounds."""
    iv = c.interval(x)
    return Throughput(x.number, CONFIRMED, iv.median, iv.low if iv.known else None, iv.high if iv.known else None,
                      len(c.values_tok_s(x)), "confirmed", throughput_statistic(c))


def searched_throughput(v: TrialView) -> Throughput:
    """`v`'s number from the search: its point at the highest rate it sustained within the limit."""
    r = v.ranked
    return Throughput(v.number, SEARCHED, r.output_throughput_tok_s if r.answerable else math.nan,
                      answer=r.answer.value)


def confirmed_gain(c: Confirmation, x: Confirmed) -> Gain | None:
    """`x`'s gain over vLLM's defaults in the confirmation: the ratio of the medians over the rounds both ran (a
    config that dropped out is compared with the defaults' rounds beside its own, as its per-round interval is),
    with the per-round interval; where the defaults' median is 0 (they met the limit in too few of those rounds for a
    ratio), the median per-round gain instead. None for the defaults themselves, where they were not measured again,
    or where no round gives a ratio."""
    base = c.base
    per_round = c.gain(x)
    if base is None or per_round is None or not per_round.n:
        return None
    both = [(a, b) for r in c.full_rounds if (a := base.value_tok_s(r)) is not None and (b := x.value_tok_s(r))
            is not None]
    pct = relative_gain(median([a for a, _ in both]), median([b for _, b in both])) * 100 if both else math.nan
    if not math.isfinite(pct):
        pct = per_round.median * 100
    if not math.isfinite(pct):
        return None
    if not per_round.known:
        return Gain(pct, rounds=per_round.n, statistic=gain_statistic(c))
    return Gain(pct, per_round.low * 100, per_round.high * 100, per_round.n, gain_statistic(c))


def searched_gain(v: TrialView, base: TrialView) -> Gain | None:
    """`v`'s gain over the baseline from the search's one measurement each (None when either has no number)."""
    if not (v.ranked.answerable and base.ranked.answerable):
        return None
    pct = relative_gain(base.ranked.output_throughput_tok_s, v.ranked.output_throughput_tok_s) * 100
    return None if math.isnan(pct) else Gain(pct)
