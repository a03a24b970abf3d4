"""How a trial budget splits between the search and the confirmation (search/confirm.py), and the line that says so.

By default the confirmation takes at most AUTO_SHARE of a trial budget, its runs as served included, and
MAX_AUTO_ROUNDS rounds of CONFIGS configs: `--budget 40` is 14 search trials, up to 24 runs and 2 served. A plan
with fewer candidates than CONFIGS spends the same runs on more rounds (`rounds_for`), and so does one whose rival
drops out (`rounds_after_drop`); `--confirm N` asks for N rounds whatever the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimizer.core.errors import UsageError
from optimizer.measurement.sequential import FIRST_LOOK_ROUND

DEFAULT_ROUNDS = 5  # with a deadline alone (the time decides how many fit)
SPLIT_RULE = "65% with the served runs, up to 8 rounds"  # stored in a default plan: a rerun under another keeps it
CONFIGS = 3  # vLLM's defaults, the recommendation and its closest rival: what each round plans for
# By default at most AUTO_SHARE of a trial budget, served runs included, and MAX_AUTO_ROUNDS rounds (8 at 40): over
# nine real studies on a Xeon a run moved 4.2% once its round and config were out (rms, 61 df) where its own counts
# place it within ~1%, so rounds narrow the gain: at that spread 6 rounds of 3 give +-6.0 points, 8 +-5.0.
AUTO_SHARE = 0.65
MAX_AUTO_ROUNDS = 8
MIN_AUTO_ROUNDS = 2  # fewer rounds give no interval: by default, then, none
MIN_SEARCH_TRIALS = 2  # vLLM's defaults and one more: what a search keeps at the least
SERVED_CONFIGS = 2  # measured through `vllm serve` after the rounds: vLLM's defaults and the leader


@dataclass(frozen=True)
class Plan:
    """How a budget splits between the search and the confirmation, and the line that says so."""

    rounds: int
    search_budget: int | None  # trials the search runs (None: the deadline decides)
    line: str
    served: int = 0  # runs through `vllm serve` after the rounds (SERVED_CONFIGS, or 0: none)

    @property
    def runs(self) -> int:
        return self.rounds * CONFIGS + self.served


def plan(budget: int | None, asked: int | None, served: bool = False) -> Plan:
    """Pure: the rounds a study confirms at most and the trials its search keeps. `asked` None is the default: as many
    rounds as AUTO_SHARE of the budget holds with the runs as served, up to MAX_AUTO_ROUNDS (none below 2; with a
    deadline alone, DEFAULT_ROUNDS); a number is the user's `--confirm N`. The rounds stop before that once they
    decide (measurement/sequential.py). With `served`, the rounds end with SERVED_CONFIGS runs through `vllm serve`
    (`enqueue`), which come out of the budget too."""
    if asked == 0:
        return Plan(0, budget, "confirmation: off (--confirm 0)")
    rounds = DEFAULT_ROUNDS if asked is None else asked
    extra = SERVED_CONFIGS if served else 0
    then = f", then {extra} runs through `vllm serve`" if extra else ""
    if budget is None:
        return Plan(rounds, None, f"confirmation: up to {rounds} rounds of up to {CONFIGS} configs after the search "
                                  f"until they decide{then}, planned into the deadline", extra)
    if asked is None:
        rounds = min((int(AUTO_SHARE * budget + 1e-9) - extra) // CONFIGS, MAX_AUTO_ROUNDS)
        if rounds < MIN_AUTO_ROUNDS:
            need = math.ceil((MIN_AUTO_ROUNDS * CONFIGS + extra) / AUTO_SHARE)
            return Plan(0, budget, f"confirmation: none: a budget of {budget} trials leaves no room for "
                                   f"{MIN_AUTO_ROUNDS} rounds (give --budget {need} or more, or --confirm N)")
    search = budget - rounds * CONFIGS - extra
    if search < MIN_SEARCH_TRIALS:
        raise UsageError(f"--confirm {rounds} takes {rounds * CONFIGS + extra} of the {budget} trials of --budget "
                         f"and leaves the search fewer than {MIN_SEARCH_TRIALS}: give --budget "
                         f"{rounds * CONFIGS + extra + MIN_SEARCH_TRIALS} or more, or fewer --confirm rounds")
    runs = f"up to {rounds * CONFIGS} confirmation runs" + (
        f" and {extra} runs through `vllm serve` (vLLM's defaults and the leader, as deployed)" if extra else "")
    shape = f"of up to {CONFIGS} configs" if asked is not None else \
        f"of {CONFIGS} configs (or {rounds_for(rounds, 2)} of 2)"
    return Plan(rounds, search, f"confirmation: up to {rounds} rounds {shape}, until they decide, "
                                f"come out of the budget of {budget}: {search} search trials, then {runs}", extra)


def more_rounds_command(study_name: str, budget: int | None, rounds: int, added: int = 1,
                        search_budget: int | None = None, served: int = 0, run_s: float | None = None) -> str:
    """Pure: the command that gives a confirmed study `added` more rounds on a rerun: the plan's rounds raised and
    the budget to what `plan` charges for them (CONFIGS runs a round, and `served`) beside the search's
    `search_budget` trials, so that the search keeps them (a plan of 2 configs has more rounds than its budget's
    rounds of 3: `rounds_for`). Without `search_budget`, the budget raised by the added rounds' runs. With a deadline
    alone there is no trial budget to raise. A study with a deadline (`run_s`: a run's estimated seconds) keeps it on
    a resume, and it has passed: the command gives a new one, the added rounds' and served runs' time and a minute."""
    more = f"--confirm {rounds + added}"
    time_budget = "" if run_s is None else f" --budget {math.ceil((added * CONFIGS + served) * run_s / 60) + 1}min"
    if budget is None:
        return f"optimize --study {study_name}{time_budget} {more}"
    raised = budget + added * CONFIGS if search_budget is None else search_budget + (rounds + added) * CONFIGS + served
    return f"optimize --study {study_name} --budget {raised}{time_budget} {more}"


def rounds_for(rounds: int, candidates: int) -> int:
    """Pure: a default plan's rounds for `candidates` configs: the runs of `rounds` rounds of CONFIGS, in rounds of
    those (8 rounds of 3 are 12 of 2: where no rival's interval overlaps the recommendation's, its runs go to more
    rounds of the pair; at a 4.2% spread the gain's half-width is +-4.3 points after 12 rounds of 2, +-5.0 after 8
    of 3). vLLM's defaults alone have no gain to decide, and their rounds stop at the first look whatever they
    measure (measurement/sequential.py::outcome): FIRST_LOOK_ROUND rounds, not a plan that reads as cut short."""
    if candidates < 2:
        return min(rounds, FIRST_LOOK_ROUND)
    return rounds * CONFIGS // candidates


def rounds_after_drop(rounds: int, done: int, before: int, after: int) -> int:
    """Pure: a default plan's rounds once configs drop out after `done` full rounds: the runs it had left for the
    `before` configs measured so far, (rounds - done) x before, in rounds of the `after` still measured (8 rounds of 3
    with one dropping out after round 4: 10). The budget's runs are spent as planned, on the configs that still
    decide the outcome."""
    if after <= 0 or done >= rounds or after >= before:
        return rounds
    return done + (rounds - done) * before // after
