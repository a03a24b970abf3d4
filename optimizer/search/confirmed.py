"""The confirmation's numbers, read from the study (search/confirm.py runs the rounds), and the recommendation.

Each config the confirmation measures again is a `Confirmed`: its search trial and one run per round. The
`Confirmation` of the study's latest plan reads every config's runs of the full rounds, their intervals at the
current look's confidence (measurement/sequential.py), the gain intervals over vLLM's defaults, who leads and who
drops out. `recommended` is the config to deploy: the confirmation's, when the study has one, else the best-scored
trial (search/score.py). Every stage after the confirmation (report, export, verify, the end of a run) reads these.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.config.limits import Limits
from optimizer.measurement.disturbance import disturbed
from optimizer.measurement.intervals import Interval, block_gain_interval, interval
from optimizer.measurement.rate_fit import RateAtLimit
from optimizer.measurement.sequential import (ALPHA, FIRST_LOOK_ROUND, GROUP_SEQUENTIAL, Outcome, behind,
                                              look_confidence_at, outcome, rounds_to_decide)
from optimizer.search.attrs import CONFIRM, MACHINE_LOAD, STUDY_CONFIRMATION
from optimizer.search.measured import measurement_of
from optimizer.search.score import best_first, goodput
from optimizer.search.study import confirmation_runs, is_baseline, search_trials

FIT_VALUE = "rate-at-limit"  # a plan's "value": its runs are compared by their pooled fits (`run_tok_s`)


# A plan's "spread" when a config that dropped out keeps its earlier rounds in the residual spread of every gain
# (intervals.py::block_gain_interval, least squares over the runs there are). A plan stored without it leaves that
# config out, and reports as it ran.
SPREAD_ALL_RUNS = "every run, least squares"


def planned_runs(plan: dict[str, Any]) -> int:
    """Pure: the runs a stored plan's rounds hold: each candidate's rounds, up to the round it dropped out at (the
    runs as served not counted)."""
    rounds, dropped = int(plan.get("rounds") or 0), plan.get("dropped") or {}
    return sum(min(int(dropped.get(str(n), rounds)), rounds) for n in plan.get("candidates") or ())


@dataclass(frozen=True)
class Confirmed:
    """One config measured again in the confirmation's rounds: its search trial, and each round's run."""

    trial: FrozenTrial  # the search trial it measures again (vLLM's defaults: the baseline)
    runs: dict[int, FrozenTrial]  # round -> its finished run
    served: FrozenTrial | None = None  # its run through `vllm serve` after the rounds (None: none, or not yet)
    by_fit: bool = False  # a run's value is its pooled fit's (`run_tok_s`: a plan valued by FIT_VALUE), else goodput

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def baseline(self) -> bool:
        return is_baseline(self.trial)

    def value_tok_s(self, round_: int) -> float | None:
        """The round's throughput at the limit, by the run's pooled fit (`by_fit`) or at its best passing probe (0
        when the run met the limit at no rate, or could not run)."""
        run = self.runs.get(round_)
        return None if run is None else run_tok_s(run) if self.by_fit else goodput(run)

    def bracket_rps(self, round_: int) -> tuple[float | None, float | None]:
        """The rate the round's run passed (None: a burst, or none) and the rate it failed (None: none tried)."""
        run = self.runs.get(round_)
        if run is None:
            return None, None
        m = measurement_of(run)
        if m is None:
            return None, None
        return (m.rate_rps if m.feasible else None), m.failed_rate_rps

    def rate_rps(self, round_: int) -> float | None:
        """The round's rate at the limit in process (`run_rate_rps`); None when the round has no run of it."""
        return None if (run := self.runs.get(round_)) is None else run_rate_rps(run)

    @property
    def served_rate(self) -> RateAtLimit | None:
        """Its rate at the limit as served (`vllm serve` over HTTP), with the fit's 95% interval; None when it has
        no served run, or the run met the limit nowhere."""
        if self.served is None or self.served.state != TrialState.COMPLETE:
            return None
        m = measurement_of(self.served)
        return None if m is None else m.fit


def run_rate_rps(run: FrozenTrial) -> float:
    """A finished run's rate at the limit: its pooled fit's (a run stored without one: the rate it passed; a burst
    that met the limit: inf); 0 when it met the limit nowhere, or could not run."""
    m = measurement_of(run)
    if run.state != TrialState.COMPLETE or m is None or not m.feasible:
        return 0.0
    fit = m.rate_at_limit
    return fit.rate_rps if fit is not None else math.inf if m.rate_rps is None else float(m.rate_rps)


def run_tok_s(run: FrozenTrial) -> float:
    """A finished run's throughput at the limit by its pooled fit: the fit's rate (`run_rate_rps`) times the output
    tokens per request at its best passing probe (the round's draw, alike for every config of the round). The fit
    reads every probe, where goodput is the rung of the ladder the last pass landed on and its drain: over the Xeon
    demo's 15 runs a run's residual spread was 3.4% by the fit, 4.4% by goodput. Goodput where there is no fit."""
    m = measurement_of(run)
    rate, rps = run_rate_rps(run), (m.request_throughput_rps if m is not None else 0.0) or 0.0
    return rate * goodput(run) / rps if 0 < rate < math.inf and rps > 0 else goodput(run)


@dataclass(frozen=True)
class Confirmation:
    """The confirmation of the study's latest plan: each candidate's runs, its interval, and the gain intervals.

    Only full rounds count (every config still measured in that round ran in it), so that each round compares like
    with like. Its rounds run until they decide (optimizer/measurement/sequential.py): the intervals are at the
    current look's `confidence`, and a config clearly behind the leader drops out of the later rounds (`dropped`)."""

    plan: dict[str, Any]
    configs: list[Confirmed]  # in the plan's order: vLLM's defaults first

    @property
    def rounds(self) -> int:
        """Rounds planned at most."""
        return int(self.plan.get("rounds", 0))

    @property
    def confidence(self) -> float:
        """Of every interval shown: the current look's (measurement/sequential.py; a plan without "spending": as
        stored).

        A plan of one config (vLLM's defaults, when no other met the limit) has no gain to look at: its rounds stop
        after the first look whatever they measure, so its intervals are at 1 - ALPHA, not at that look's share of a
        plan of many looks (which put a 2-round interval at [0.0, 332486.2] tok/s)."""
        if len(self.plan.get("candidates") or ()) < 2:
            return 1 - ALPHA
        if self.plan.get("spending"):  # group-sequential or Bonferroni shares
            return look_confidence_at(self.rounds, len(self.full_rounds), float(self.plan["spending"]),
                                      self.plan.get("looks") == GROUP_SEQUENTIAL, len(self.plan["candidates"]),
                                      [tuple(g) for g in self.plan.get("grown") or ()])
        return float(self.plan.get("confidence", 0.95))

    @property
    def dropped(self) -> dict[int, int]:
        """Config number -> the first round that did not measure it (it was clearly behind the leader)."""
        return {int(k): int(v) for k, v in (self.plan.get("dropped") or {}).items()}

    def measured_in(self, c: Confirmed, round_: int) -> bool:
        """True when `c` was still measured in `round_` (had not dropped out before it)."""
        return round_ < self.dropped.get(c.number, round_ + 1)

    @property
    def rounds_started(self) -> list[int]:
        """The rounds any config has a run of, in order."""
        return sorted(set().union(*(set(c.runs) for c in self.configs))) if self.configs else []

    @property
    def full_rounds(self) -> list[int]:
        return [r for r in self.rounds_started if all(r in c.runs for c in self.configs if self.measured_in(c, r))]

    @property
    def runs_planned(self) -> int:
        return planned_runs(self.plan)

    @property
    def shape(self) -> str:
        """Its rounds as planned: '8 rounds of 3 configs'; after a drop-out, '4 rounds of 3 configs, then 6 of 2'."""
        counts = [sum(self.measured_in(c, r) for c in self.configs) for r in range(self.rounds)]
        runs = [(n, sum(1 for _ in group)) for n, group in itertools.groupby(counts)]
        return ", then ".join(f"{k} rounds of {n} configs" if i == 0 else f"{k} of {n}"
                              for i, (n, k) in enumerate(runs)) or f"0 rounds of {len(self.configs)} configs"

    @property
    def runs_done(self) -> int:
        return sum(len(c.runs) for c in self.configs)

    @property
    def usable(self) -> bool:
        """At least one full round: the recommendation is chosen from these numbers."""
        return bool(self.full_rounds)

    @property
    def complete(self) -> bool:
        """True when the rounds have decided, or ran out."""
        return self.outcome != Outcome.RUNNING and self.rounds > 0

    def values_tok_s(self, c: Confirmed) -> list[float]:
        return [v for r in self.full_rounds if (v := c.value_tok_s(r)) is not None]

    def interval(self, c: Confirmed) -> Interval:
        return interval(self.values_tok_s(c), floor=0.0, confidence=self.confidence)

    @property
    def base(self) -> Confirmed | None:
        return next((c for c in self.configs if c.baseline), None)

    @property
    def active(self) -> list[Confirmed]:
        """The configs still measured: none of them dropped out."""
        return [c for c in self.configs if c.number not in self.dropped]

    @property
    def best(self) -> Confirmed | None:
        """The config still measured with the highest median throughput over the full rounds (ties: plan order)."""
        if not self.usable:
            return None
        return max(self.active or self.configs, key=lambda c: self.interval(c).median)

    @property
    def recommended(self) -> Confirmed | None:
        """The config to deploy: vLLM's defaults when the rounds decided that no candidate beats them by more than
        +-3 points (`Outcome.KEEP`), else the best (`best`)."""
        if self.outcome == Outcome.KEEP and self.base is not None:
            return self.base
        return self.best

    def gain(self, c: Confirmed) -> Interval | None:
        """`c`'s gain over vLLM's defaults, round by round (each round measures both next to each other)."""
        base = self.base
        return None if base is None or c is base else self.difference(c, base)

    def difference(self, c: Confirmed, other: Confirmed) -> Interval:
        """`c`'s gain over `other`, round by round (a round measures both next to each other, so their ratio leaves
        out what moved both), its interval pooling the spread of every config measured in those rounds."""
        return block_gain_interval(self.difference_rows(c, other), 0, 1, confidence=self.confidence)

    def difference_rows(self, c: Confirmed, other: Confirmed) -> list[list[float | None]]:
        """The table `difference` fits: `other`'s values (row 0), `c`'s (row 1) and every other config's, over the
        rounds that measured both (None: a config not measured in a round)."""
        rounds = [r for r in self.full_rounds if other.value_tok_s(r) is not None and c.value_tok_s(r) is not None]
        beside = [x for x in self.configs if x is not c and x is not other]
        table = [[x.value_tok_s(r) for r in rounds] for x in (other, c, *beside)]
        if self.plan.get("spread") != SPREAD_ALL_RUNS:  # a config that dropped out is left out
            table = [row for row in table if None not in row]
        return table

    def _deciding_gains(self) -> list[Interval]:
        """The gains over vLLM's defaults the outcome rests on: the leader's, or when the defaults lead, every other
        candidate's still measured (none without a leader or the defaults)."""
        best, base = self.best, self.base
        if best is None or base is None:
            return []
        if best is base:
            return [self.difference(c, base) for c in self.active if c is not base]
        return [self.difference(best, base)]

    @property
    def outcome(self) -> Outcome:
        """What the full rounds say of the leader against vLLM's defaults (measurement/sequential.py)."""
        best = self.best
        if best is None:
            return Outcome.RUNNING if self.rounds > 0 else Outcome.UNDECIDED
        if self.base is None:  # no gain over vLLM's defaults to decide: the first look ends the rounds
            return Outcome.RUNNING if len(self.full_rounds) < FIRST_LOOK_ROUND else Outcome.UNDECIDED
        width = float(self.plan.get("precise_half_width", math.inf))  # a plan stored without it: any width
        return outcome(self._deciding_gains(), best is self.base, len(self.full_rounds), self.rounds, width)

    def rounds_to_decide(self) -> int | None:
        """How many more rounds would be expected to decide the outcome if the gains over vLLM's defaults and the
        runs' spread stay as measured (measurement/sequential.py::rounds_to_decide): for each gain the outcome rests
        on, the most any needs; None when more than PROJECTED_ROUNDS, or nothing to project."""
        needed = [rounds_to_decide(g, self.confidence, len(self.full_rounds), len(self.plan["candidates"]))
                  for g in self._deciding_gains()]
        return None if not needed or None in needed else max(needed)

    def behind(self) -> list[Confirmed]:
        """The configs still measured that are clearly behind the leader (not vLLM's defaults: their gain decides
        the outcome): they drop out of the next rounds."""
        if (best := self.best) is None or len(self.full_rounds) < FIRST_LOOK_ROUND:
            return []
        return [c for c in self.active if c is not best and not c.baseline and behind(self.difference(c, best))]

    def rate_interval(self, c: Confirmed) -> Interval:
        """`c`'s rate at the limit in process over the full rounds: median, interval of the mean at the look's
        confidence."""
        return interval([v for r in self.full_rounds if (v := c.rate_rps(r)) is not None], 0.0, self.confidence)

    @property
    def served_configs(self) -> list[Confirmed]:
        """The configs measured through `vllm serve` once the rounds are over: vLLM's defaults and the leader (when
        the defaults lead, the best other config still measured), so that the user sees both as deployed."""
        best, base = self.best, self.base
        if best is None:
            return []
        if best is base:
            others = sorted((c for c in self.active if c is not base), key=lambda c: -self.interval(c).median)
            best = others[0] if others else None
        return [c for c in (base, best) if c is not None]

    @property
    def served_missing(self) -> list[Confirmed]:
        """The configs whose served run is still to run (none while the rounds are running)."""
        if not self.plan.get("served") or not self.complete:
            return []
        return [c for c in self.served_configs if c.served is None]

    def tied(self, c: Confirmed) -> bool:
        """True when the measurements do not rank `c` apart from the recommendation (the best, or vLLM's defaults
        when the rounds kept them while another config led): the interval of its per-round gain over it includes 0
        (with one round, no interval: tied only on an equal number)."""
        chosen = self.recommended
        if chosen is None or c is chosen:
            return False
        d = self.difference(c, chosen)
        return d.low <= 0 <= d.high if d.known else d.median == 0


DISTURBED_TRIES = 2  # runs of one config in one round while others disturb the machine, before the last is kept


def kept_run(tries: Sequence[FrozenTrial]) -> FrozenTrial | None:
    """Of one config's runs in one round (or as served), in the order run: the first that nothing else on the machine
    disturbed (measurement/disturbance.py; a run that could not measure, pruned, is never called disturbed; a
    duplicate of two workers keeps the first); while all are disturbed, none (the round misses the run, and it is run
    again once), and from DISTURBED_TRIES on the last of those tries, as it is (later ones never replace it): a
    machine that stays busy costs at most twice the runs."""
    for t in tries[:DISTURBED_TRIES]:
        if t.state != TrialState.COMPLETE or not disturbed(MACHINE_LOAD.of(t)):
            return t
    return tries[DISTURBED_TRIES - 1] if len(tries) >= DISTURBED_TRIES else None


def confirmation(study: optuna.Study, plan: dict[str, Any] | None = None) -> Confirmation | None:
    """The confirmation of the study's latest plan, or of `plan` (None when none was planned)."""
    plan = STUDY_CONFIRMATION.of(study) if plan is None else plan
    if not plan or not plan.get("candidates"):
        return None
    trials = {t.number: t for t in search_trials(study)}
    runs: dict[int, dict[int, FrozenTrial]] = {n: {} for n in plan["candidates"]}
    served: dict[int, FrozenTrial] = {}
    tries: dict[tuple[int, int | None], list[FrozenTrial]] = {}  # (config, round; None: as served) -> its runs
    for t in confirmation_runs(study, (TrialState.COMPLETE, TrialState.PRUNED)):
        c = CONFIRM.of(t) or {}
        if c.get("plan") == plan.get("plan") and c.get("of") in runs:
            tries.setdefault((c["of"], None if c.get("served") else int(c["round"])), []).append(t)
    for (number, round_), those in tries.items():
        chosen = kept_run(those)
        if chosen is None:
            continue
        if round_ is None:
            served[number] = chosen
        else:
            runs[number][round_] = chosen
    by_fit = plan.get("value") == FIT_VALUE
    configs = [Confirmed(trials[n], runs[n], served.get(n), by_fit) for n in plan["candidates"] if n in trials]
    return Confirmation(plan, configs)


def recommended(study: optuna.Study, limits: Limits | None = None) -> FrozenTrial | None:
    """The recommendation: at the study's own limits, the config the confirmation recommends
    (`Confirmation.recommended`: the best over its full rounds, or vLLM's defaults when no candidate beats them by
    more than +-3 points); otherwise, or at other `limits`, the best-scored trial (the one `pareto_front` puts
    first). None when no trial meets the limits."""
    if limits is None:
        confirmed = confirmation(study)
        if confirmed is not None and confirmed.recommended is not None:
            return confirmed.recommended.trial
    trials = best_first(study, limits)
    return trials[0] if trials else None
