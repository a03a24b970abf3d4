"""From a finished study to a decision: each trial ranked for a TTFT P99 limit, the feasible Pareto front
(throughput vs TTFT P99), the recommendation against vLLM's defaults, and what drove throughput.

The limit defaults to the one the study searched with; any other limit is answered from the stored curves
(optimizer.measurement.rerank), with the caveats the stored points impose.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from optimizer.config.limits import Limits
from optimizer.config.settings import StudyConfig
from optimizer.core.errors import UsageError
from optimizer.core.units import format_ms
from optimizer.decision.export import defaults_as_run
from optimizer.decision.importance import param_importances
from optimizer.decision.numbers import (
    Gain, Throughput, confirmed_gain, confirmed_throughput, searched_gain, searched_throughput,
)
from optimizer.decision.trial import TrialView
from optimizer.measurement.noise import beats, required_gain
from optimizer.measurement.rerank import Answer, pareto_front, point_value_ms, recommend, worst_ratio
from optimizer.measurement.sequential import FIRST_LOOK_ROUND, PROJECTED_ROUNDS, Outcome
from optimizer.params.accuracy import accuracy_line
from optimizer.params.deploy import label as deploy_label
from optimizer.search.confirm import run_estimate_s
from optimizer.search.split import Plan, more_rounds_command, plan
from optimizer.search.confirmed import Confirmation, confirmation
from optimizer.search.records import RecordStore
from optimizer.search.rejudge import Rejudged, lowest_rate_rps, rejudge_trials
from optimizer.search.score import compared_per_gpu, noise_cv, rank_trials, tied_with
from optimizer.search.study import FINISHED, confirmation_runs, run_name, search_trials


@dataclass(frozen=True)
class Decision:
    """Everything the report shows, for one set of limits."""

    study_name: str
    limits: Limits  # what the trials are ranked at: the study's own, or those `optimize report` re-ranks for
    searched_limits: Limits  # what the study searched with
    views: list[TrialView]  # every finished trial, by number
    front: list[TrialView]  # the feasible Pareto front, highest throughput first
    best: TrialView | None
    baseline: TrialView | None
    importances: dict[str, float] = field(default_factory=dict)
    importance_note: str = ""
    notes: list[str] = field(default_factory=list)
    noise_cv: float = math.nan  # the study's noise level: CV of throughput over repeated replays at one rate
    arrivals: str = "poisson"  # the workload's arrivals (the burst aside): poisson, constant, closed_loop
    defaults_of: str = "vllm serve"  # whose defaults the baseline is (optimizer/params/deploy.py)
    confirmation: Confirmation | None = None  # the configs measured again after the search (at the study's limit)
    # where the baseline is not quite vLLM's defaults: argument -> (value, why), e.g. this machine's fallback
    defaults_as_run: dict[str, tuple[Any, str]] = field(default_factory=dict)
    more_rounds: str = ""  # the command that adds a confirmation round (search/split.py `more_rounds_command`)
    rounds_needed: int | None = None  # rounds that would be expected to decide an undecided confirmation (None: more)
    rounds_projected: bool = False  # whether `rounds_needed` was projected at all (it needs two full rounds)

    @property
    def more_rounds_advice(self) -> str:
        """For an undecided confirmation: the command that adds a round, and how many more rounds would be expected
        to decide it at the gain and the spread measured (`Confirmation.rounds_to_decide`)."""
        k = self.rounds_needed
        if not self.rounds_projected:
            return f"`{self.more_rounds}` adds a round"
        expected = (f"about {k} more round{'s' if k != 1 else ''} would be expected to decide it, if the gain and the "
                    f"spread stay as measured" if k is not None else
                    f"at the gain and the spread measured, more than {PROJECTED_ROUNDS} more rounds would be needed to "
                    f"decide it")
        return f"`{self.more_rounds}` adds a round; {expected}"

    @property
    def confirmed(self) -> bool:
        """True when the recommendation and the gain come from the confirmation's rounds."""
        return self.confirmation is not None and self.confirmation.usable

    def required_gain(self, a: TrialView, b: TrialView) -> float:
        """The relative gain `a` needs over `b` to count as better: the larger of the replays' noise (Z standard
        errors at the study's CV, optimizer/measurement/noise.py) and `b`'s rate-search resolution (its best rate
        passed, the next rate tried above it failed: its true best lies anywhere in between)."""
        return required_gain(self.noise_cv, _replays(a), _replays(b), resolution(b))

    def beyond_noise(self, a: TrialView, b: TrialView) -> bool:
        """True when `a`'s throughput beats `b`'s by more than measurement noise and search resolution allow."""
        return beats(a.ranked.output_throughput_tok_s, b.ranked.output_throughput_tok_s, self.noise_cv,
                     _replays(a), _replays(b), resolution(b))

    @property
    def ties(self) -> list[TrialView]:
        """Trials the measurements do not rank apart from the recommendation: confirmed configs whose per-round gain
        over it may be 0 (`Confirmation.tied`); without a confirmation, front trials whose bracket (the rate passed
        to the rate failed, widened by the study's noise) overlaps its bracket."""
        if self.best is None:
            return []
        by_number = {v.number: v for v in self.views}
        if self.confirmed:
            assert self.confirmation is not None
            return [by_number[c.number] for c in self.confirmation.configs if self.confirmation.tied(c)]
        tied = set(tied_with(self.best.ranked, {v.number: v.ranked for v in self.front if v is not self.best},
                             self.noise_cv))
        return [v for v in self.front if v.number in tied]

    @property
    def reranked(self) -> bool:
        return self.limits.key != self.searched_limits.key

    @property
    def gain_pct(self) -> float | None:
        """Throughput gain of the recommendation over vLLM's defaults, when both meet the limit (`gain`)."""
        if self.best is None or self.baseline is None:
            return None
        if self.best is self.baseline:
            return 0.0
        g = self.gain(self.best)
        return g.pct if g is not None else None

    def throughput(self, v: TrialView) -> Throughput:
        """`v`'s throughput as every view shows it: the confirmation's median with its interval and round count
        where it was measured again, else the search's one measurement (decision/numbers.py)."""
        mine = self.confirmed_of(v)
        if mine is not None:
            assert self.confirmation is not None
            return confirmed_throughput(self.confirmation, mine)
        return searched_throughput(v)

    def gain(self, v: TrialView) -> Gain | None:
        """`v`'s gain over vLLM's defaults as every view shows it: the ratio of the two numbers `throughput` gives,
        with the per-round interval when both were confirmed; None for the baseline itself or without both."""
        if self.baseline is None or v is self.baseline:
            return None
        mine, base = self.confirmed_of(v), self.confirmed_of(self.baseline)
        if mine is not None and base is not None:
            assert self.confirmation is not None
            return confirmed_gain(self.confirmation, mine)
        if self.confirmed:  # one side was not measured again: a ratio of unlike numbers would mislead
            return None
        return searched_gain(v, self.baseline)

    def confirmed_of(self, v: TrialView) -> Any:
        """`v`'s confirmation (a search.confirmed.Confirmed), None where it was not measured again."""
        if not self.confirmed:
            return None
        assert self.confirmation is not None
        return next((c for c in self.confirmation.configs if c.number == v.number), None)

    def history(self) -> list[tuple[int, float | None, float | None]]:
        """(trial number, its throughput within the limit or None, best so far or None), by trial number."""
        out, best = [], None
        for v in self.views:
            tp = v.ranked.output_throughput_tok_s if v.ranked.answerable else None
            if tp is not None and (best is None or tp > best):
                best = tp
            out.append((v.number, tp, best))
        return out

    def by_throughput(self) -> list[TrialView]:
        """Answerable trials, highest throughput first."""
        return sorted((v for v in self.views if v.ranked.answerable),
                      key=lambda v: (-v.ranked.output_throughput_tok_s, v.ranked.latency_ms, v.number))


def budget_split(config: StudyConfig) -> Plan | None:
    """The study's split of its budget (search/split.py `plan`); None where its stored settings give none."""
    try:
        return plan(config.budget, config.confirm, config.serves_after)
    except UsageError:
        return None


def decide(study: optuna.Study, config: StudyConfig, limits: Limits | None = None,
           records: RecordStore | None = None) -> Decision:
    """Rank every finished trial of `study` for `limits` (default: those the study searched with), from the stored
    measurements; for other limits, each trial's stored probes judged again from their stored requests in `records`
    (search/rejudge.py: the study's database, as opened), else from the probes' stored statistics."""
    limits = config.limits if limits is None else limits
    own_limits = limits.key == config.limits.key
    trials = sorted(search_trials(study), key=lambda t: t.number)  # confirmation runs are not search trials
    rejudged: dict[int, Rejudged] = {}
    if not own_limits and records is not None:
        rejudged = rejudge_trials(trials, records, config, limits)
    # the one score (search/score.py)
    ranked = rank_trials(trials, config.engine_args, limits, {n: r.curve for n, r in rejudged.items()})
    views = [TrialView(t, ranked[t.number], rejudged.get(t.number)) for t in trials]
    by_number = {v.number: v for v in views}
    front = [by_number[n] for n in pareto_front(ranked)]
    best_n = recommend(ranked)
    confirmed = confirmation(study) if own_limits else None  # measured at the study's limits only
    split = budget_split(config)
    if confirmed is not None and confirmed.recommended is not None and confirmed.recommended.number in by_number:
        best_n = confirmed.recommended.number  # chosen from the confirmed numbers (search/confirmed.py::recommended)
    best = by_number[best_n] if best_n is not None else None
    base = next((v for v in views if v.baseline), None)
    importances, note = param_importances(views)
    undecided = confirmed is not None and confirmed.outcome == Outcome.UNDECIDED
    decision = Decision(config.study_name, limits, config.limits, views, front, best, base, importances, note,
                        noise_cv=noise_cv(trials),
                        arrivals=_arrivals_label(config.workload), defaults_of=deploy_label(config.deploy_as),
                        confirmation=confirmed,
                        defaults_as_run=defaults_as_run(base.trial, config) if base is not None else {},
                        more_rounds=more_rounds_command(config.study_name, config.budget, confirmed.rounds,
                                                        search_budget=split.search_budget if split else None,
                                                        served=split.served if split else 0,
                                                        run_s=run_estimate_s(study) if config.deadline_unix_s
                                                        else None)
                        if confirmed is not None else "",
                        rounds_needed=confirmed.rounds_to_decide() if undecided else None,
                        rounds_projected=undecided and len(confirmed.full_rounds) >= FIRST_LOOK_ROUND)
    if compared_per_gpu(trials, config.engine_args):
        decision.notes.append("trials use different numbers of GPUs (tensor x pipeline x data parallel): output "
                              "throughput is compared per GPU")
    decision.notes.extend(caveats(decision))
    return decision


def _arrivals_label(w: Any) -> str:
    if w.arrivals == "poisson" and w.burstiness != 1.0:
        return "gamma"
    return "trace" if w.trace and w.trace_timing == "original" else w.arrivals


def _replays(v: TrialView) -> int:
    return int((v.ranked.point or {}).get("replays", 1))


def caveats(d: Decision) -> list[str]:
    """What the stored data cannot vouch for, in sentences a person acts on."""
    out = []
    if d.reranked:
        judged = sum(v.rejudged is not None for v in d.views)
        others = [f"#{v.number}" for v in d.views if v.rejudged is None and v.ranked.answer != Answer.NOT_RUN]
        how = (f"each stored probe of {judged} trial(s) judged again at them from its stored requests, with the "
               f"rate at the limits and its 95% interval pooled from them" if judged else
               "from each stored replay's statistics (its requests were not stored)")
        if judged and others:
            how += f"; {', '.join(others)} from their replays' statistics (their requests were not all stored)"
        out.append(f"re-ranked for {d.limits.text} (the study searched for {d.searched_limits.text}): {how}; "
                   f"nothing was rerun")
    measured = [v for v in d.views if v.ranked.answer != Answer.NOT_RUN]
    if d.best is None:
        closest = [(v.number, c) for v in measured if (c := v.ranked.closest) is not None]
        low = min(closest, key=lambda nc: worst_ratio(nc[1], d.limits), default=None)
        where = "" if low is None else (f"; the closest stored is trial #{low[0]} at "
                                        f"{rate_text(low[1].get('offered_rate_rps'))}: {values_text(low[1], d.limits)}")
        lowest = ", ".join(_unprobed_text(v) for v in measured if v.ranked.answer == Answer.NO_POINT)
        out.append(f"the stored data cannot answer these limits: no stored replay meets {d.limits.text}{where}. "
                   f"Rates below the stored ones were not tried" + (f" ({lowest})" if lowest else "")
                   + f": {_measure_hint(d)}")
        return out
    if d.best.ranked.answer == Answer.LOWER_BOUND and (p := d.best.ranked.point) is not None and not d.confirmed:
        out.append(f"trial #{d.best.number}'s throughput is a lower bound: the highest Poisson rate it tried "
                   f"({rate_text(p.get('offered_rate_rps'))}) already meets the limits ({values_text(p, d.limits)}), "
                   f"so it may sustain more: {_measure_hint(d)}")
    if d.best is not d.baseline and (line := accuracy_line(d.best.trial.params)):
        out.append(line)  # the export says it too (decision/export.py): a deployer may read only the run's end
    confirmed = {c.number for c in d.confirmation.configs} if d.confirmed and d.confirmation else set()
    others = [v.number for v in d.views if v.ranked.answer == Answer.LOWER_BOUND and v is not d.best
              and v.number not in confirmed]
    if others:
        out.append(f"lower bounds that might rank higher if measured: {', '.join(f'#{n}' for n in others)}")
    unanswered = [v for v in measured if v.ranked.answer == Answer.NO_POINT]
    if unanswered and d.reranked:
        out.append(f"{len(unanswered)} trial(s) cannot be ranked for these limits: no stored replay meets them, and "
                   f"their searches never probed the lower rates where they might: "
                   f"{', '.join(_unprobed_text(v) for v in unanswered)}")
    return out


def values_text(point: Any, limits: Limits) -> str:
    """'TTFT P99 80ms, TPOT P99 61ms': each limit's statistic at a stored point."""
    return ", ".join(f"{lim.name} {format_ms(v) if math.isfinite(v := point_value_ms(point, lim, limits)) else 'n/a'}"
                     for lim in limits)


def _measure_hint(d: Decision) -> str:
    return (f"measure it with a new study, `optimize --study NEW_NAME {d.limits.flags}` with the "
            f"model and workload flags of study {d.study_name!r}")


def rate_text(rate_rps: float | None) -> str:
    return "a burst" if rate_rps is None else f"{rate_rps:.2f} req/s"


def resolution(v: TrialView) -> float:
    r = v.ranked
    if r.answer != Answer.MEASURED or not r.rate_rps or r.next_rate_rps is None:
        return 0.0
    return r.next_rate_rps / r.rate_rps - 1


def view(d: Decision, number: int | str, runs: Sequence[str] = ()) -> TrialView:
    """The finished trial `number`, or a UsageError that lists the ones there are (and the confirmation `runs`, by
    name)."""
    for v in d.views:
        if str(v.number) == str(number):
            return v
    numbers = [v.number for v in d.views]
    have = f"#{numbers[0]}..#{numbers[-1]}" if numbers else "none yet"
    also = f"; confirmation runs: {', '.join(runs)}" if runs else ""
    what = f"confirmation run {number}" if str(number).startswith("c") else f"finished trial #{number}"
    raise UsageError(f"study {d.study_name!r} has no {what} (finished: {have}{also}): pass one of them to --trial")


def run_views(study: optuna.Study, d: Decision) -> dict[str, TrialView]:
    """The study's finished confirmation runs by name (c3: search/study.py `run_name`), each ranked under the
    report's limit like a trial (none in a study without a confirmation)."""
    return {run_name(t): TrialView.under(t, d.limits)
            for t in confirmation_runs(study, FINISHED)}


def _unprobed_text(v: TrialView) -> str:
    """'#4 (nothing below 6.20 req/s)': the lowest Poisson rate a trial that cannot be ranked probed."""
    lowest = lowest_rate_rps(v.curve)  # its probes as judged at the report's limits
    return f"#{v.number}" + (f" (nothing below {lowest:.2f} req/s)" if lowest is not None else "")
