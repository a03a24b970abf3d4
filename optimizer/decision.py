"""From a finished study to a decision: each trial ranked for a TTFT P99 limit, the feasible Pareto front
(throughput vs TTFT P99), the recommendation against vLLM's defaults, and what drove throughput.

The limit defaults to the one the study searched with; any other limit is answered from the stored curves
(optimizer.rerank), with the caveats the stored points impose.
"""

from __future__ import annotations

import csv
import html
import importlib.util
import io
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.config import StudyConfig
from optimizer.deploy import label as deploy_label
from optimizer.errors import UsageError
from optimizer.noise import beats, median, required_gain
from optimizer.parallel import gpus_needed, per_gpu_curve
from optimizer.rerank import Answer, Ranked, merge_repeats, pareto_front, qualifies, rank_curve, recommend
from optimizer.space import SEARCHABLE, distance_to_default
from optimizer.study import FINISHED, is_baseline
from optimizer.units import format_ms

FORMATS = ("table", "json", "csv")
MIN_TRIALS_FOR_IMPORTANCE = 3


@dataclass(frozen=True)
class TrialView:
    """One finished trial as seen under the report's limit."""

    trial: FrozenTrial
    ranked: Ranked

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def baseline(self) -> bool:
        return is_baseline(self.trial)

    @property
    def engine_config(self) -> dict[str, Any]:
        return dict(self.trial.user_attrs.get("engine_config") or self.trial.user_attrs.get("engine_params") or {})

    @property
    def curve(self) -> list[dict[str, Any]]:
        return list(self.trial.user_attrs.get("curve") or [])


@dataclass(frozen=True)
class Decision:
    """Everything the report shows, for one limit."""

    study_name: str
    limit_ms: float
    searched_limit_ms: float
    views: list[TrialView]  # every finished trial, by number
    front: list[TrialView]  # the feasible Pareto front, highest throughput first
    best: TrialView | None
    baseline: TrialView | None
    importances: dict[str, float] = field(default_factory=dict)
    importance_note: str = ""
    notes: list[str] = field(default_factory=list)
    other_limits_ms: dict[str, float] = field(default_factory=dict)  # e.g. {"tpot_p99_ms": 50.0}
    noise_cv: float = math.nan  # the study's noise level: CV of throughput over repeated replays at one rate
    arrivals: str = "poisson"  # the workload's arrivals (the burst aside): poisson, constant, closed_loop
    defaults_of: str = "vllm serve"  # whose defaults the baseline is (optimizer/deploy.py)

    def required_gain(self, a: TrialView, b: TrialView) -> float:
        """The relative gain `a` needs over `b` to count as better: the larger of the replays' noise (Z standard
        errors at the study's CV, optimizer/noise.py) and `b`'s rate-search resolution (its best rate passed, the
        next rate tried above it failed: its true best lies anywhere in between)."""
        return required_gain(self.noise_cv, _replays(a), _replays(b), _resolution(b))

    def beyond_noise(self, a: TrialView, b: TrialView) -> bool:
        """True when `a`'s throughput beats `b`'s by more than measurement noise and search resolution allow."""
        return beats(a.ranked.output_throughput_tok_s, b.ranked.output_throughput_tok_s, self.noise_cv,
                     _replays(a), _replays(b), _resolution(b))

    @property
    def ties(self) -> list[TrialView]:
        """Front trials the recommendation does not beat beyond noise: as good as it, as far as we can measure."""
        if self.best is None:
            return []
        return [v for v in self.front if v is not self.best and not self.beyond_noise(self.best, v)]

    @property
    def reranked(self) -> bool:
        return not math.isclose(self.limit_ms, self.searched_limit_ms) or bool(self.other_limits_ms)

    @property
    def gain_pct(self) -> float | None:
        """Throughput gain of the recommendation over vLLM's defaults, when both meet the limit."""
        if self.best is None or self.baseline is None or not self.baseline.ranked.answerable:
            return None
        base = self.baseline.ranked.output_throughput_tok_s
        return (self.best.ranked.output_throughput_tok_s / base - 1) * 100 if base > 0 else None

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
                      key=lambda v: (-v.ranked.output_throughput_tok_s, v.ranked.ttft_p99_ms, v.number))


def decide(study: optuna.Study, config: StudyConfig, limit_ms: float | None = None,
           other_limits_ms: dict[str, float] | None = None) -> Decision:
    """Rank every finished trial of `study` for `limit_ms` (default: the limit the study searched with) and any
    other latency limits (TPOT, ITL, E2E P99), from the stored curves."""
    limit = config.ttft_p99_ms if limit_ms is None else limit_ms
    other = dict(other_limits_ms or {})
    trials = sorted(study.get_trials(deepcopy=False, states=FINISHED), key=lambda t: t.number)
    layouts = {t.number: gpus_needed({**config.engine_args, **(t.user_attrs.get("engine_params") or {})})
               for t in trials}
    per_gpu = len(set(layouts.values())) > 1  # trials use different GPU counts: compare throughput per GPU
    views = [TrialView(t, rank_curve(per_gpu_curve(t.user_attrs.get("curve") or [], layouts[t.number]) if per_gpu
                                     else t.user_attrs.get("curve"), limit, other)) for t in trials]
    by_number = {v.number: v for v in views}
    ranked = {v.number: v.ranked for v in views}
    front = [by_number[n] for n in pareto_front(ranked)]
    best_n = recommend(ranked)
    best = by_number[best_n] if best_n is not None else None
    base = next((v for v in views if v.baseline), None)
    importances, note = param_importances(views)
    decision = Decision(config.study_name, limit, config.ttft_p99_ms, views, front, best, base, importances, note,
                        other_limits_ms=other, noise_cv=study_noise_cv(views),
                        arrivals=_arrivals_label(config.workload), defaults_of=deploy_label(config.deploy_as))
    if per_gpu:
        decision.notes.append("trials use different numbers of GPUs (tensor x pipeline x data parallel): output "
                              "throughput is compared per GPU")
    missing = sorted({k for k in other for v in views for p in v.curve if k not in p})
    if missing:
        decision.notes.append(f"some stored replays did not record {', '.join(missing)} (studies made before it was "
                              f"stored): those replays cannot answer that limit")
    if other:
        decision.notes.append("also required: " + ", ".join(f"{k[:-3].replace('_', ' ').upper()} <= {format_ms(v)}"
                                                             for k, v in other.items()))
    decision.notes.extend(caveats(decision))
    return decision


def _arrivals_label(w: Any) -> str:
    if w.arrivals == "poisson" and w.burstiness != 1.0:
        return "gamma"
    return "trace" if w.trace and w.trace_timing == "original" else w.arrivals


def study_noise_cv(views: list[TrialView]) -> float:
    """Median CV of throughput over every rate replayed more than once (the baseline's repeats at least)."""
    cvs = [p["output_throughput_cv"] for v in views for p in merge_repeats(v.curve)
           if p.get("replays", 1) > 1 and not math.isnan(p.get("output_throughput_cv", math.nan))]
    return median(cvs) if cvs else math.nan


def _replays(v: TrialView) -> int:
    return int((v.ranked.point or {}).get("replays", 1))


def param_importances(views: list[TrialView]) -> tuple[dict[str, float], str]:
    """fANOVA importances for output throughput over the trials that meet the limit, or an empty dict and why."""
    usable = [v for v in views if v.ranked.answerable and v.trial.state == TrialState.COMPLETE and v.trial.params]
    if len(usable) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}, (f"not enough trials: parameter importance needs at least {MIN_TRIALS_FOR_IMPORTANCE} searched "
                    f"trials that meet the limit, {len(usable)} do")
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        scratch = optuna.create_study(direction="maximize")
        scratch.add_trials([optuna.trial.create_trial(params=v.trial.params, distributions=v.trial.distributions,
                                                      value=v.ranked.output_throughput_tok_s) for v in usable])
        evaluator, how = _evaluator(len(usable))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            result = optuna.importance.get_param_importances(scratch, evaluator=evaluator)
    except Exception as exc:  # noqa: BLE001 - e.g. every trial measured the same throughput
        return {}, f"parameter importance could not be computed ({type(exc).__name__}: {exc})"
    finally:
        optuna.logging.set_verbosity(verbosity)
    clean = {k: float(v) for k, v in result.items() if math.isfinite(v)}
    if not clean:
        return {}, "parameter importance could not be computed (the trials do not differ enough)"
    return clean, f"{how} over {len(usable)} searched trials that meet the limit, target output tokens/s"


def _evaluator(n_trials: int) -> tuple[optuna.importance.BaseImportanceEvaluator, str]:
    """Optuna's default fANOVA when scikit-learn is installed; else PED-ANOVA, which needs no extra package.

    PED-ANOVA compares the top quantile of trials with all of them; its default quantile (0.1) holds no trial
    in a small study, so the quantile is widened to hold about three trials.
    """
    if importlib.util.find_spec("sklearn") is not None:
        return optuna.importance.FanovaImportanceEvaluator(seed=0), "fANOVA"
    quantile = min(0.5, max(0.1, 3 / n_trials))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile)
    return evaluator, f"PED-ANOVA, top {quantile:.0%}"


def caveats(d: Decision) -> list[str]:
    """What the stored data cannot vouch for, in sentences a person acts on."""
    out = []
    if d.reranked:
        out.append(f"re-ranked from the stored replays for TTFT P99 <= {format_ms(d.limit_ms)} (the study searched "
                   f"for <= {format_ms(d.searched_limit_ms)}); nothing was rerun")
    measured = [v for v in d.views if v.ranked.answer != Answer.NOT_RUN]
    if d.best is None:
        closest = [(v.number, c) for v in measured if (c := v.ranked.closest) is not None]
        low = min(closest, key=lambda nc: nc[1]["ttft_p99_ms"], default=None)
        where = "" if low is None else (f"; the lowest TTFT P99 stored is {format_ms(low[1]['ttft_p99_ms'])} "
                                        f"(trial #{low[0]} at {_rate_text(low[1].get('offered_rate_rps'))})")
        out.append(f"the stored data cannot answer this limit: no stored replay meets TTFT P99 <= "
                   f"{format_ms(d.limit_ms)}{where}. Rates below the stored ones were not tried: {_measure_hint(d)}")
        return out
    if d.best.ranked.answer == Answer.LOWER_BOUND and (p := d.best.ranked.point) is not None:
        out.append(f"trial #{d.best.number}'s throughput is a lower bound: the highest Poisson rate it tried "
                   f"({_rate_text(p.get('offered_rate_rps'))}) already meets the limit (TTFT P99 "
                   f"{format_ms(p['ttft_p99_ms'])}), so it may sustain more: {_measure_hint(d)}")
    others = [v.number for v in d.views if v.ranked.answer == Answer.LOWER_BOUND and v is not d.best]
    if others:
        out.append(f"lower bounds that might rank higher if measured: {', '.join(f'#{n}' for n in others)}")
    unanswered = [v.number for v in measured if v.ranked.answer == Answer.NO_POINT]
    if unanswered and d.limit_ms < d.searched_limit_ms:
        out.append(f"{len(unanswered)} trial(s) have no stored replay within the limit; they were not tried at "
                   f"lower rates and might meet it there: {', '.join(f'#{n}' for n in unanswered)}")
    return out


def _measure_hint(d: Decision) -> str:
    return (f"measure it with a new study, optimize --study NEW_NAME --ttft-p99 {format_ms(d.limit_ms)} and the "
            f"model and workload flags of {d.study_name!r}")


def _rate_text(rate_rps: float | None) -> str:
    return "a burst" if rate_rps is None else f"{rate_rps:.2f} req/s"


def _role(d: Decision, v: TrialView) -> str:
    roles = (["recommended"] if d.best is v else []) + (["baseline"] if v.baseline else [])
    return ", ".join(roles)


def trial_row(d: Decision, v: TrialView, params: list[str]) -> dict[str, Any]:
    """One trial's row: the chosen point's numbers (units in the keys) and its engine values."""
    p = v.ranked.point or {}
    cfg = v.engine_config
    return {
        "trial": v.number,
        "role": _role(d, v),
        "output_throughput_tok_s": p.get("output_throughput_tok_s"),
        "arrivals": None if not p else "burst" if p.get("offered_rate_rps") is None else d.arrivals,
        "rate_rps": p.get("offered_rate_rps"),
        "ttft_p50_ms": p.get("ttft_p50_ms"),
        "ttft_p99_ms": p.get("ttft_p99_ms"),
        "tpot_p99_ms": p.get("tpot_p99_ms"),
        "answer": v.ranked.answer.value,
        **{k: cfg.get(k) for k in params},
    }


def _shown_params(d: Decision) -> list[str]:
    """Searched parameters whose values differ across the front and the baseline."""
    shown = [*d.front, *([d.baseline] if d.baseline is not None and d.baseline not in d.front else [])]
    return [k for k in SEARCHABLE if any(k in v.engine_config for v in shown)
            and (len(shown) == 1 or len({json.dumps(v.engine_config.get(k)) for v in shown}) > 1)]


def front_rows(d: Decision, with_params: bool = True) -> list[dict[str, Any]]:
    """The feasible Pareto front as rows, highest throughput first, with the engine parameters that differ."""
    params = _shown_params(d) if with_params else []
    return [trial_row(d, v, params) for v in d.front]


def params_rows(d: Decision) -> list[dict[str, Any]]:
    """The same parameters transposed, one row per parameter, one column per front trial (and the baseline)."""
    shown = [*d.front, *([d.baseline] if d.baseline is not None and d.baseline not in d.front else [])]
    names = {v.number: f"#{v.number}" + (f" ({_role(d, v)})" if _role(d, v) else "") for v in shown}
    return [{"parameter": k, **{names[v.number]: v.engine_config.get(k) for v in shown}} for k in _shown_params(d)]


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def _json_safe(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def format_output(rows: list[dict[str, Any]], fmt: str) -> str:
    """Rows of scalars as `table` (aligned text), `json`, `csv`, or `html` (a <table>): the one formatter."""
    if fmt not in (*FORMATS, "html"):
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    if fmt == "json":
        return json.dumps([{k: _json_safe(row.get(k)) for k in columns} for row in rows], indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([["" if _json_safe(row.get(k)) is None else row.get(k) for k in columns] for row in rows])
        return buf.getvalue().rstrip("\n")
    cells = [[_cell(row.get(k)) for k in columns] for row in rows]
    if fmt == "html":
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in cells)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    if not columns:
        return "(no rows)"
    widths = [max(len(x) for x in col) for col in zip(columns, *cells)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(columns, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _describe(v: TrialView) -> str:
    r = v.ranked
    if not r.answerable:
        return f"trial #{v.number}: {r.answer.value}"
    return (f"trial #{v.number}: {r.output_throughput_tok_s:.1f} output tok/s at {_rate_text(r.rate_rps)}, "
            f"TTFT P99 {format_ms(r.ttft_p99_ms)} ({r.answer.value})")


def summary_lines(d: Decision) -> list[str]:
    """Recommendation, baseline, gain, changed parameters, importances and caveats, one sentence a line."""
    out = []
    out.append(f"recommended: {_describe(d.best)}" if d.best is not None else
               "recommended: none: no trial meets the limit")
    if d.baseline is not None:
        out.append(f"vLLM defaults ({d.defaults_of}, baseline): {_describe(d.baseline)}")
    if d.gain_pct is not None and d.best is not None and d.baseline is not None:
        bounds = d.best.ranked.answer == Answer.LOWER_BOUND, d.baseline.ranked.answer == Answer.LOWER_BOUND
        qualifier = ("; the baseline's number is a lower bound too, so the gain is uncertain" if bounds[1] else
                     "; at least that much, as the recommendation's number is a lower bound" if bounds[0] else "")
        if not d.beyond_noise(d.best, d.baseline) and d.best is not d.baseline:
            qualifier += (f"; within measurement noise ({_noise_text(d, d.best, d.baseline)}): not proven better "
                          f"than vLLM's defaults; benchmarks/ab_gain.py --study {d.study_name} measures both again")
        out.append(f"gain over vLLM's defaults ({d.defaults_of}): {d.gain_pct:+.1f}% output throughput{qualifier}")
    ties = [v for v in d.ties if v is not d.baseline]  # the gain line speaks of the baseline
    if ties:
        out.append(f"as good as the recommendation within measurement noise: "
                   + ", ".join(f"#{v.number} ({v.ranked.output_throughput_tok_s:.1f} tok/s)" for v in ties)
                   + f" ({_noise_text(d, d.best, ties[0])}); optimize verify picks the most robust of them")
    if d.best is not None and d.baseline is not None and d.best is not d.baseline:
        changed = distance_to_default(d.best.engine_config, d.baseline.engine_config)
        if changed:
            out.append("changed from vLLM's defaults: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
    if d.importances:
        out.append(f"parameter importance ({d.importance_note}): "
                   + ", ".join(f"{k} {v:.2f}" for k, v in d.importances.items() if v >= 0.005))
    else:
        out.append(f"parameter importance: {d.importance_note}")
    out += [f"note: {n}" for n in d.notes]
    return out


def _noise_text(d: Decision, a: TrialView, b: TrialView) -> str:
    why = []
    if not math.isnan(d.noise_cv):
        why.append(f"replays at one rate vary by CV {d.noise_cv:.1%}")
    if _resolution(b) > 0:
        why.append(f"#{b.number}'s best rate is known within {_resolution(b):.1%} (the next rate tried missed)")
    return f"a gain must exceed {d.required_gain(a, b):.1%}: " + "; ".join(why)


def _resolution(v: TrialView) -> float:
    r = v.ranked
    if r.answer != Answer.MEASURED or not r.rate_rps or r.next_rate_rps is None:
        return 0.0
    return r.next_rate_rps / r.rate_rps - 1


def title(d: Decision) -> str:
    how = "re-ranked from stored replays" if d.reranked else "as searched"
    return (f"study {d.study_name!r}: feasible Pareto front of output throughput vs TTFT P99, "
            f"TTFT P99 <= {format_ms(d.limit_ms)} ({how})")


def curve_rows(d: Decision, v: TrialView) -> list[dict[str, Any]]:
    """A trial's stored replays in the order they ran: its latency-vs-load curve, judged under the limit."""
    keys = ("offered_rate_rps", "sent_rate_rps", "achieved_rate_rps", "output_throughput_tok_s",
            "request_throughput_rps", "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms",
            "completed", "failed", "sustained")
    engine_keys = ("running_peak", "queued_p99_ms", "prefill_p99_ms", "kv_usage_peak", "preemptions")
    with_engine = any(p.get("engine") for p in v.curve)  # the engine's own view, where the engine reports it
    return [{"replay": i, "arrivals": "burst" if p.get("offered_rate_rps") is None else d.arrivals,
             **{k: p.get(k) for k in keys}, "meets_limit": qualifies(p, d.limit_ms, d.other_limits_ms),
             "chosen": v.ranked.point is not None  # every replay at the chosen rate (repeats are merged)
             and p.get("offered_rate_rps") == v.ranked.point.get("offered_rate_rps"),
             **({f"engine_{k}": (p.get("engine") or {}).get(k) for k in engine_keys} if with_engine else {})}
            for i, p in enumerate(v.curve)]


def trial_notes(v: TrialView) -> list[str]:
    """Under a trial's curve: what limited it at its chosen point (engine stats) and its GPU telemetry."""
    from optimizer.limits import diagnose

    out = []
    point = v.ranked.point
    found = diagnose(point.get("engine"), point.get("ttft_p99_ms")) if point else None
    line = found.line if found else v.trial.user_attrs.get("limited_by")
    if line:
        out.append(line)
    tele = v.trial.user_attrs.get("telemetry")
    if tele and tele.get("available"):
        out.append(f"GPU {tele.get('device')}: utilization mean {tele.get('utilization_mean_pct')}% max "
                   f"{tele.get('utilization_max_pct')}%, memory used max {tele.get('memory_used_max_gib')} GiB "
                   f"({tele.get('samples')} samples)")
    elif tele:
        out.append(f"GPU telemetry: none ({tele.get('reason')})")
    return out


def render(d: Decision, fmt: str) -> tuple[str, list[str]]:
    """What `optimize report` prints: (stdout, lines for stderr). Machine formats keep stdout to the rows."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt != "table":
        return format_output(front_rows(d), fmt), [title(d), *summary_lines(d)]
    parts = [title(d), format_output(front_rows(d, with_params=False), "table") if d.front else "(no trial)"]
    if d.front:
        parts += ["", format_output(params_rows(d), "table")]
    return "\n".join([*parts, "", *summary_lines(d)]), []


def view(d: Decision, number: int) -> TrialView:
    """The finished trial `number`, or a UsageError that lists the ones there are."""
    for v in d.views:
        if v.number == number:
            return v
    numbers = [v.number for v in d.views]
    have = f"#{numbers[0]}..#{numbers[-1]}" if numbers else "none yet"
    raise UsageError(f"study {d.study_name!r} has no finished trial #{number} (finished: {have}): pass one of them "
                     f"to --trial")
