"""One definition of a trial's score and of the recommendation.

A trial's score, for a study's latency limits, is the output throughput of the highest-rate point of its stored
curve that meets every limit (repeats merged into their medians, per GPU where the study's trials use different GPU
counts): `measurement/rerank.py` ranks one curve, this module ranks a study's trials with it. Before a
confirmation (search/confirmed.py, whose `recommended` prefers its own), the recommendation is the best-scored trial
at the study's own limits (ties: lower latency at the first limit, then the earlier trial). Export, verify,
the progress bar, the pre-screen, the end-of-run table and `optimize report` all read these, so they never
disagree on which trial is best; `optimize report --tpot-p99 ...` asks the same question for other limits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.config.limits import Limits
from optimizer.measurement.intervals import brackets_overlap, rate_bracket_tok_s
from optimizer.measurement.noise import Z, median
from optimizer.measurement.rate_fit import RateAtLimit
from optimizer.measurement.rerank import Answer, Ranked, merge_repeats, rank_curve
from optimizer.params.parallel import gpus_needed, per_gpu_curve
from optimizer.search.attrs import ENGINE_PARAMS, STUDY_CONFIG
from optimizer.search.measured import TrialMeasurement, measurement_of
from optimizer.search.study import is_baseline, search_trials


def _layouts(trials: Sequence[FrozenTrial], engine_args: Mapping[str, Any]) -> dict[int, int]:
    return {t.number: gpus_needed({**engine_args, **ENGINE_PARAMS.of(t)}) for t in trials}


def compared_per_gpu(trials: Sequence[FrozenTrial], engine_args: Mapping[str, Any]) -> bool:
    """True when the trials need different GPU counts (tensor x pipeline x data parallel): scores are per GPU."""
    return len(set(_layouts(trials, engine_args).values())) > 1


def rank_trials(trials: Sequence[FrozenTrial], engine_args: Mapping[str, Any], limits: Limits | float,
                curves: Mapping[int, Sequence[dict[str, Any]]] | None = None) -> dict[int, Ranked]:
    """Each trial's curve ranked for `limits`, by trial number (`curves`: a trial's probes judged again at these
    limits, search/rejudge.py, in place of its stored ones). When the trials need different GPU counts
    (tensor/pipeline/data parallelism), throughput is compared per GPU."""
    layouts = _layouts(trials, engine_args)
    per_gpu = len(set(layouts.values())) > 1
    curves = curves or {}

    def curve(t: FrozenTrial) -> list[dict[str, Any]]:
        return list(curves[t.number]) if t.number in curves else curve_of(t)

    return {t.number: rank_curve(per_gpu_curve(curve(t), layouts[t.number]) if per_gpu else curve(t), limits)
            for t in trials}


def curve_of(trial: FrozenTrial) -> list[dict[str, Any]]:
    """The trial's stored probes (none where it stored no measurement)."""
    m = measurement_of(trial)
    return [] if m is None else list(m.curve)


def score_tok_s(trial: FrozenTrial, limits: Limits | float) -> float:
    """The trial's score alone (one GPU layout): output tokens/s within `limits`, 0 when no point meets them."""
    ranked = rank_curve(curve_of(trial), limits)
    return ranked.output_throughput_tok_s if ranked.answerable else 0.0


def fit_text(fit: RateAtLimit) -> str:
    """A rate at the limits from probes judged again at other limits (search/rejudge.py): '5.40 req/s at the limits
    [5.10, 5.80] (400 stored requests in 2 probes, judged again)'."""
    high = "open" if not math.isfinite(fit.high_rps) else f"{fit.high_rps:.2f}"
    return (f"{fit.rate_rps:.2f} req/s at the limits [{fit.low_rps:.2f}, {high}] ({fit.requests} stored requests in "
            f"{fit.probes} probes, judged again)")


def rate_at_limit_text(m: TrialMeasurement) -> str:
    """A trial's rate in words, from its measurement: '52.10 req/s at the limit [50.30, 53.80] (passed 51.00,
    failed 53.60; 2980 requests in 6 probes)'; for a trial measured by fixed-length replays, its bracket alone."""
    rate, failed, fit = m.rate_rps, m.failed_rate_rps, m.rate_at_limit
    if rate is None:
        return "a burst"
    bracket = f"passed {rate:.2f}" + (f", failed {failed:.2f}" if failed else ", none failed above")
    if fit is None:
        return f"{rate:.2f} req/s ({bracket})"
    high = "open" if not math.isfinite(fit.high_rps) else f"{fit.high_rps:.2f}"
    return (f"{fit.rate_rps:.2f} req/s at the limit [{fit.low_rps:.2f}, {high}] ({bracket}; "
            f"{m.requests or fit.requests} requests in {fit.probes} probes)")


def goodput(trial: FrozenTrial) -> float:
    """The score its objective stored for the study's own limit: output tokens/s at its best sustained rate, 0
    when infeasible. The same number `score_tok_s(trial, limit)` ranks from its curve (tests/search/test_score.py
    holds them equal); the sampler learns from this one, and the pre-screen and benchmarks read it."""
    m = measurement_of(trial) if trial.state == TrialState.COMPLETE else None
    if m is None or not m.feasible or not trial.values:
        return 0.0
    return float(trial.values[0])


def _stored_config(study: optuna.Study) -> dict[str, Any]:
    """The study's stored config as a dict (one read of the study's attributes: a storage query)."""
    raw = STUDY_CONFIG.of(study)
    if raw is None:
        raise ValueError(f"study {study.study_name!r} has no stored config: it was not made by optimize")
    return json.loads(raw)


def stored_limits(stored: Mapping[str, Any]) -> Limits:
    """The limits a stored config names."""
    return Limits.model_validate(stored["limits"])


def study_limits(study: optuna.Study) -> Limits:
    """The limits the study searched with, from its stored config."""
    return stored_limits(_stored_config(study))


def scored_best_first(study: optuna.Study, limits: Limits | None = None) -> list[tuple[FrozenTrial, Ranked]]:
    """The finished trials that meet the limits (default: the study's own) with their ranked points, best first."""
    stored = _stored_config(study)
    limits = stored_limits(stored) if limits is None else limits
    trials = sorted(search_trials(study), key=lambda t: t.number)
    ranked = rank_trials(trials, stored.get("engine_args") or {}, limits)
    by_number = {t.number: t for t in trials}
    order = sorted((n for n, r in ranked.items() if r.answerable),
                   key=lambda n: (-ranked[n].output_throughput_tok_s, ranked[n].latency_ms, n))
    return [(by_number[n], ranked[n]) for n in order]


def best_first(study: optuna.Study, limits: Limits | None = None) -> list[FrozenTrial]:
    """The finished trials that meet the limits (default: the study's own), best score first."""
    return [t for t, _ in scored_best_first(study, limits)]


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
    cvs = [p["output_throughput_cv"] for t in trials for p in merge_repeats(curve_of(t))
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
