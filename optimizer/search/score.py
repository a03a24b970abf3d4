"""One definition of a trial's score and of the recommendation.

A trial's score, for a TTFT P99 limit, is the output throughput of the highest-rate point of its stored curve
that meets the limit (repeats merged into their medians, per GPU where the study's trials use different GPU
counts): `measurement/rerank.py` ranks one curve, this module ranks a study's trials with it. The recommendation
is the best-scored trial at the study's own limit (ties: lower TTFT P99, then the earlier trial). Export, verify,
the progress bar, the pre-screen, the end-of-run table and `optimize report` all read these, so they never
disagree on which trial is best; `optimize report --ttft-p99` asks the same question for another limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.measurement.intervals import (Interval, block_gain_interval, brackets_overlap, interval,
                                             rate_bracket_tok_s)
from optimizer.measurement.noise import Z, median
from optimizer.measurement.rate_fit import RateAtLimit
from optimizer.measurement.rerank import Answer, Ranked, merge_repeats, rank_curve
from optimizer.measurement.sequential import FIRST_LOOK_ROUND, Outcome, behind, look_alpha, outcome
from optimizer.params.parallel import gpus_needed, per_gpu_curve
from optimizer.search.attrs import CONFIRM, CURVE, ENGINE_PARAMS, RESULT, STUDY_CONFIG, STUDY_CONFIRMATION
from optimizer.search.study import confirmation_runs, is_baseline, search_trials


def _layouts(trials: Sequence[FrozenTrial], engine_args: Mapping[str, Any]) -> dict[int, int]:
    return {t.number: gpus_needed({**engine_args, **ENGINE_PARAMS.of(t)}) for t in trials}


def compared_per_gpu(trials: Sequence[FrozenTrial], engine_args: Mapping[str, Any]) -> bool:
    """True when the trials need different GPU counts (tensor x pipeline x data parallel): scores are per GPU."""
    return len(set(_layouts(trials, engine_args).values())) > 1


def rank_trials(trials: Sequence[FrozenTrial], engine_args: Mapping[str, Any], limit_ms: float,
                other_limits_ms: Mapping[str, float] | None = None) -> dict[int, Ranked]:
    """Each trial's curve ranked for `limit_ms` (and any other latency limits), by trial number. When the trials
    need different GPU counts (tensor/pipeline/data parallelism), throughput is compared per GPU."""
    layouts = _layouts(trials, engine_args)
    per_gpu = len(set(layouts.values())) > 1
    return {t.number: rank_curve(per_gpu_curve(CURVE.of(t), layouts[t.number]) if per_gpu else CURVE.of(t),
                                 limit_ms, other_limits_ms) for t in trials}


def score_tok_s(trial: FrozenTrial, limit_ms: float) -> float:
    """The trial's score alone (one GPU layout): output tokens/s within `limit_ms`, 0 when no point meets it."""
    ranked = rank_curve(CURVE.of(trial), limit_ms)
    return ranked.output_throughput_tok_s if ranked.answerable else 0.0


def rate_at_limit_text(result: Mapping[str, Any]) -> str:
    """A trial's rate in words, from its stored result: '52.10 req/s at the limit [50.30, 53.80] (passed 51.00,
    failed 53.60; 2980 requests in 6 probes)'; for a trial stored before probes were sized by evidence, its
    bracket alone."""
    rate, failed = result.get("rate_rps"), result.get("failed_rate_rps")
    fit = result.get("rate_at_limit")
    if rate is None:
        return "a burst"
    bracket = f"passed {rate:.2f}" + (f", failed {failed:.2f}" if failed else ", none failed above")
    if not fit:
        return f"{rate:.2f} req/s ({bracket})"
    high = "open" if fit.get("high_rps") is None else f"{fit['high_rps']:.2f}"
    return (f"{fit['rate_rps']:.2f} req/s at the limit [{fit['low_rps']:.2f}, {high}] ({bracket}; "
            f"{result.get('requests', fit.get('requests', 0))} requests in {fit.get('probes', 0)} probes)")


def rate_interval_rps(trial: FrozenTrial) -> tuple[float, float] | None:
    """The trial's rate at the limit as its 95% interval (low, high; high inf for a lower bound), from its pooled fit;
    None for a trial measured before probes were sized by evidence, or one that met the limit nowhere."""
    fit = RESULT.of(trial).get("rate_at_limit")
    if not fit:
        return None
    stored = RateAtLimit.from_dict(fit)
    return stored.low_rps, stored.high_rps


def goodput(trial: FrozenTrial) -> float:
    """The score its objective stored for the study's own limit: output tokens/s at its best sustained rate, 0
    when infeasible. The same number `score_tok_s(trial, limit)` ranks from its curve (tests/search/test_score.py
    holds them equal); the sampler learns from this one, and the pre-screen and benchmarks read it."""
    if trial.state != TrialState.COMPLETE or not RESULT.of(trial).get("feasible") or not trial.values:
        return 0.0
    return float(trial.values[0])


def _stored_config(study: optuna.Study) -> dict[str, Any]:
    """The study's stored config as a dict (one read of the study's attributes: a storage query)."""
    raw = STUDY_CONFIG.of(study)
    if raw is None:
        raise ValueError(f"study {study.study_name!r} has no stored config: it was not made by optimize")
    return json.loads(raw)


def study_limit_ms(study: optuna.Study) -> float:
    """The TTFT P99 limit the study searched with, from its stored config."""
    return float(_stored_config(study)["ttft_p99_ms"])


def scored_best_first(study: optuna.Study, limit_ms: float | None = None) -> list[tuple[FrozenTrial, Ranked]]:
    """The finished trials that meet the limit (default: the study's own) with their ranked points, best first."""
    stored = _stored_config(study)
    limit = float(stored["ttft_p99_ms"]) if limit_ms is None else limit_ms
    trials = sorted(search_trials(study), key=lambda t: t.number)
    ranked = rank_trials(trials, stored.get("engine_args") or {}, limit)
    by_number = {t.number: t for t in trials}
    order = sorted((n for n, r in ranked.items() if r.answerable),
                   key=lambda n: (-ranked[n].output_throughput_tok_s, ranked[n].ttft_p99_ms, n))
    return [(by_number[n], ranked[n]) for n in order]


def best_first(study: optuna.Study, limit_ms: float | None = None) -> list[FrozenTrial]:
    """The finished trials that meet the limit (default: the study's own), best score first."""
    return [t for t, _ in scored_best_first(study, limit_ms)]


def recommended(study: optuna.Study, limit_ms: float | None = None) -> FrozenTrial | None:
    """The recommendation: at the study's own limit, the config the confirmation recommends
    (`Confirmation.recommended`: the best over its full rounds, or vLLM's defaults when no candidate beats them by
    more than +-3 points); otherwise, or at another `limit_ms`, the best-scored trial (the one `pareto_front` puts
    first). None when no trial meets the limit."""
    if limit_ms is None:
        confirmed = confirmation(study)
        if confirmed is not None and confirmed.recommended is not None:
            return confirmed.recommended.trial
    trials = best_first(study, limit_ms)
    return trials[0] if trials else None


def feasible(trial: FrozenTrial) -> bool:
    """The trial as Optuna stored its verdict: complete, every constraint met (what the sampler learned from)."""
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def baseline(study: optuna.Study) -> FrozenTrial | None:
    for t in search_trials(study):
        if is_baseline(t):
            return t
    return None


def noise_cv(trials: Sequence[FrozenTrial]) -> float:
    """The study's noise level: the median CV of throughput over every rate replayed more than once (the baseline's
    repeats at least); NaN before any."""
    cvs = [p["output_throughput_cv"] for t in trials for p in merge_repeats(CURVE.of(t))
           if p.get("replays", 1) > 1 and not math.isnan(p.get("output_throughput_cv", math.nan))]
    return median(cvs) if cvs else math.nan


def bracket_tok_s(ranked: Ranked, cv: float = math.nan) -> tuple[float, float] | None:
    """Where one trial's throughput at the limit lies: from the rate it passed to the rate it failed, widened by
    Z x the study's noise CV (None without an answer). A lower bound or a burst has no failed rate: its bracket
    is its point."""
    if not ranked.answerable:
        return None
    noise = 0.0 if math.isnan(cv) else Z * cv
    failed = ranked.next_rate_rps if ranked.answer == Answer.MEASURED else None
    return rate_bracket_tok_s(ranked.output_throughput_tok_s, ranked.rate_rps, failed, noise)


def tied_with(best: Ranked, others: Mapping[int, Ranked], cv: float = math.nan) -> list[int]:
    """The keys of `others` whose bracket overlaps `best`'s: no single measurement ranks them apart."""
    mine = bracket_tok_s(best, cv)
    if mine is None:
        return []
    return [k for k, r in others.items() if (b := bracket_tok_s(r, cv)) is not None and brackets_overlap(mine, b)]


# --- the confirmation's numbers (search/confirm.py runs it) -----------------------------------------------------

@dataclass(frozen=True)
class Confirmed:
    """One config measured again in the confirmation's rounds: its search trial, and each round's run."""

    trial: FrozenTrial  # the search trial it measures again (vLLM's defaults: the baseline)
    runs: dict[int, FrozenTrial]  # round -> its finished run
    served: FrozenTrial | None = None  # its run through `vllm serve` after the rounds (None: none, or not yet)

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def baseline(self) -> bool:
        return is_baseline(self.trial)

    def value_tok_s(self, round_: int) -> float | None:
        """The round's throughput at the limit (0 when the run met the limit at no rate, or could not run)."""
        run = self.runs.get(round_)
        return None if run is None else goodput(run)

    def bracket_rps(self, round_: int) -> tuple[float | None, float | None]:
        """The rate the round's run passed (None: a burst, or none) and the rate it failed (None: none tried)."""
        run = self.runs.get(round_)
        if run is None:
            return None, None
        r = RESULT.of(run)
        return (r.get("rate_rps") if r.get("feasible") else None), r.get("failed_rate_rps")

    def rate_rps(self, round_: int) -> float | None:
        """The round's rate at the limit in process (`run_rate_rps`); None when the round has no run of it."""
        return None if (run := self.runs.get(round_)) is None else run_rate_rps(run)

    @property
    def served_rate(self) -> RateAtLimit | None:
        """Its rate at the limit as served (`vllm serve` over HTTP), with the fit's 95% interval; None when it has
        no served run, or the run met the limit nowhere."""
        if self.served is None or self.served.state != TrialState.COMPLETE:
            return None
        fit = RESULT.of(self.served).get("rate_at_limit")
        return RateAtLimit.from_dict(fit) if fit and RESULT.of(self.served).get("feasible") else None


def run_rate_rps(run: FrozenTrial) -> float:
    """A finished run's rate at the limit: its pooled fit's (runs stored before: the rate it passed; a burst that met
    the limit: inf); 0 when it met the limit nowhere, or could not run."""
    r, fit = RESULT.of(run), RESULT.of(run).get("rate_at_limit")
    if run.state != TrialState.COMPLETE or not r.get("feasible"):
        return 0.0
    return float(fit["rate_rps"]) if fit else math.inf if r.get("rate_rps") is None else float(r["rate_rps"])


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
        """Of every interval shown: the current look's share of the error (`look_alpha`; plans before: as stored)."""
        if self.plan.get("spending"):
            return 1 - look_alpha(self.rounds, len(self.full_rounds), float(self.plan["spending"]))
        return float(self.plan.get("confidence", 0.95))

    @property
    def dropped(self) -> dict[int, int]:
        """Config number -> the first round it was no longer measured in (it was clearly behind the leader)."""
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
        rounds = [r for r in self.full_rounds if other.value_tok_s(r) is not None and c.value_tok_s(r) is not None]
        beside = [x for x in self.configs if x is not c and x is not other]
        table = [[x.value_tok_s(r) for r in rounds] for x in (other, c, *beside)]
        return block_gain_interval([row for row in table if None not in row], 0, 1, confidence=self.confidence)

    @property
    def outcome(self) -> Outcome:
        """What the full rounds say of the leader against vLLM's defaults (measurement/sequential.py)."""
        best, base = self.best, self.base
        if best is None:
            return Outcome.RUNNING if self.rounds > 0 else Outcome.UNDECIDED
        if base is None:
            gains = []
        elif best is base:
            gains = [self.difference(c, base) for c in self.active if c is not base]
        else:
            gains = [self.difference(best, base)]
        return outcome(gains, best is base, len(self.full_rounds), self.rounds)

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
        """True when the measurements do not rank `c` apart from the best: the interval of its per-round gain over
        the best includes 0 (with one round, no interval: tied only on an equal number)."""
        best = self.best
        if best is None or c is best:
            return False
        d = self.difference(c, best)
        return d.low <= 0 <= d.high if d.known else d.median == 0


def confirmation(study: optuna.Study, plan: dict[str, Any] | None = None) -> Confirmation | None:
    """The confirmation of the study's latest plan, or of `plan` (None when none was planned)."""
    plan = STUDY_CONFIRMATION.of(study) if plan is None else plan
    if not plan or not plan.get("candidates"):
        return None
    trials = {t.number: t for t in search_trials(study)}
    runs: dict[int, dict[int, FrozenTrial]] = {n: {} for n in plan["candidates"]}
    served: dict[int, FrozenTrial] = {}
    for t in confirmation_runs(study, (TrialState.COMPLETE, TrialState.PRUNED)):
        c = CONFIRM.of(t) or {}
        if c.get("plan") != plan.get("plan") or c.get("of") not in runs:
            continue
        if c.get("served"):
            served.setdefault(c["of"], t)
        else:
            runs[c["of"]].setdefault(int(c["round"]), t)  # a duplicate (two workers) keeps the first
    configs = [Confirmed(trials[n], runs[n], served.get(n)) for n in plan["candidates"] if n in trials]
    return Confirmation(plan, configs)

