"""The report's page: one self-contained HTML file that reads at a glance in a 1400 px browser window.

It opens with what was measured (model, workload, limits, machine, vLLM, date, trial counts), then the decision
with its interval and the confirmation's table, the figure, the front and the parameter importance, every
config's probes (decision/probes.py), and every trial and confirmation run with what stopped it. Tables wrap instead of
scrolling: the engine parameters are one "changed from vLLM's defaults" cell.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from typing import Any

import optuna

from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import LengthDist, WorkloadSpec
from optimizer.core.units import format_ms
from optimizer.decision.decide import Decision
from optimizer.decision.importance import importance_caveat, importance_trials
from optimizer.decision.probes import Panel, chart_html, legend_html, outcome, rate_text
from optimizer.decision.tables import format_output
from optimizer.decision.trial import TrialView
from optimizer.decision.views import (
    confirmation_lines, confirmation_rows, front_rows, limited_by_line, role_text, summary_lines, title,
)
from optimizer.hardware.machine import describe
from optimizer.measurement.rerank import Answer, point_value_ms
from optimizer.params.space import distance_to_default
from optimizer.search.attrs import (
    CONFIRM, PRUNED_DETAIL, PRUNED_REASON, STUDY_CREATED, STUDY_MACHINE,
)
from optimizer.search.missed import why_infeasible
from optimizer.search.study import is_confirmation, run_name

NOT_RECORDED = "not recorded"


@dataclass(frozen=True)
class RunInfo:
    """What the page says of the run besides the decision: the study's settings, its machine and when it ran."""

    config: StudyConfig
    machine: dict[str, Any] | None  # hardware/machine.py::fingerprint, stored when the study was made
    created: str | None  # ISO 8601, UTC, stored when the study was made (None: not stored with it)
    first_trial_start: str | None  # the first trial's start (Optuna's own record, local time)


def run_info(study: optuna.Study, config: StudyConfig) -> RunInfo:
    """The study's stored settings, machine and dates."""
    starts = [t.datetime_start for t in study.get_trials(deepcopy=False) if t.datetime_start is not None]
    first = min(starts).strftime("%Y-%m-%d %H:%M") if starts else None
    return RunInfo(config, STUDY_MACHINE.of(study), STUDY_CREATED.of(study), first)


def trial_counts(d: Decision) -> str:
    """'10 search trials: 4 meet the limit, 6 miss it (6 stopped early), 0 could not run; 6 confirmation runs ...'
    ('the limits', 'them' where the study has several)."""
    meet = sum(v.ranked.answerable for v in d.views)
    missed = [v for v in d.views if v.ranked.answer == Answer.NO_POINT]
    early = sum(v.measured is not None and v.measured.stopped_early for v in missed)
    pruned = sum(v.ranked.answer == Answer.NOT_RUN for v in d.views)
    what, it = ("the limits", "them") if len(d.limits) > 1 else ("the limit", "it")
    out = (f"{len(d.views)} search trials: {meet} meet {what}, {len(missed)} miss {it} ({early} stopped early: they "
           f"could not beat the best so far), {pruned} could not run")
    c = d.confirmation
    if c is None:
        return out + ("; confirmation runs not shown: they measured the study's own limits" if d.reranked else
                      "; no confirmation runs")
    return (out + f"; {c.runs_done} confirmation runs of {c.runs_planned} planned ({c.shape}, "
                  f"{len(c.full_rounds)} full)")


def length_mix_text(spec: WorkloadSpec) -> str:
    """The workload's length mix, each component with its share: 'prompts 70% 64-256 uniform, 30% 1024-2048
    lognormal (mean 1500); completions 100% 100-300 uniform'; '' where there is no mix (one component a side, or
    lengths from a trace: WorkloadSpec.describe says those)."""
    sides = [[wc for wc in side() if wc[0] > 0] for side in (spec.input_components, spec.output_components)]
    if spec.trace or all(len(side) == 1 for side in sides):
        return ""

    def parts(components: list[tuple[float, LengthDist]]) -> str:
        return ", ".join(f"{w:.0%} {c.min}-{c.max} {c.dist}" + (f" (mean {c.mean:g})" if c.mean is not None else "")
                         for w, c in components if w > 0)

    return f"prompts {parts(spec.input_components())}; completions {parts(spec.output_components())}"


def metadata_rows(d: Decision, info: RunInfo) -> list[tuple[str, str]]:
    """What the page opens with: (label, value) pairs; 'not recorded' where the study did not store it."""
    c, fp = info.config, info.machine
    model = c.model + (" (the embedded demo model)" if c.model_is_default else "") \
        + (", random weights" if c.dummy_weights else "") \
        + (f", dtype {c.engine_args['dtype']}" if c.engine_args.get("dtype") else "")
    limit = c.limits.text + ("" if not d.reranked else f" as searched; this page is re-ranked for {d.limits.text}")
    date = (info.created.replace("T", " ").replace("+00:00", " UTC") if info.created else
            NOT_RECORDED + (f" (first trial started {info.first_trial_start}, local time)"
                            if info.first_trial_start else ""))
    return [("model", model),
            ("workload", "; ".join(x for x in (c.workload.describe(), length_mix_text(c.workload)) if x)),
            ("tuned for", limit),
            ("machine", f"{describe(fp)}; engine on {c.device}" if fp else NOT_RECORDED),
            ("vLLM", str(fp.get("vllm")) if fp and fp.get("vllm") else NOT_RECORDED),
            ("date", date),
            ("trials", trial_counts(d))]


def changed_text(d: Decision, v: TrialView) -> str:
    """The engine parameters `v` changed from vLLM's defaults, compactly: 'max_num_seqs 256→128, block_size 16→32'
    (vLLM's defaults: the baseline trial's engine config)."""
    if v.baseline:
        return "(vLLM's defaults)"
    if d.baseline is None:
        return ", ".join(f"{k} {val}" for k, val in sorted(v.engine_config.items()))
    changed = distance_to_default(v.engine_config, d.baseline.engine_config)
    return ", ".join(f"{k} {a}\u2192{b}" for k, (a, b) in changed.items()) or "(same as vLLM's defaults)"


def trial_reason(d: Decision, v: TrialView) -> str:
    """Why a trial stands where it does under the page's limits: what failed at the rate above its best (which limit,
    by how much), or why it met the limits nowhere (stopped early, every probe missed, could not run)."""
    r = v.ranked
    if r.answer == Answer.NOT_RUN:
        detail = str(PRUNED_DETAIL.of(v.trial))
        return f"could not run: {PRUNED_REASON.of(v.trial) or 'no probe stored'}" + (f": {detail[:200]}"
                                                                                     if detail else "")
    if r.answer == Answer.CEILING:
        out = "even a burst met the limits: no arrival pattern offers more"
    elif r.answer == Answer.LOWER_BOUND:
        out = "no higher rate was tried: it may sustain more (a lower bound)"
    elif r.answer == Answer.MEASURED:
        above = [p for p in v.curve if p.get("offered_rate_rps") == r.next_rate_rps]
        out = f"at {r.next_rate_rps:.2f} req/s " + (outcome(above[0], d.limits).words if above else "it failed")
    else:
        head = "no probe meets the limits" if d.reranked or v.measured is None else why_infeasible(v.measured)
        lowest = min(v.curve, key=lambda p: p.get("offered_rate_rps") or math.inf)
        out = f"{head}; at {rate_text(lowest)} {outcome(lowest, d.limits).words}"
    limited = limited_by_line(v)
    return f"{out}; {limited}" if limited else out


def _runs(d: Decision) -> list[tuple[TrialView, str]]:
    """The confirmation's runs, each as a view ranked under the page's limits, with its role."""
    if d.confirmation is None:
        return []
    out = []
    for conf in d.confirmation.configs:
        for round_, run in sorted(conf.runs.items()):
            view = TrialView.under(run, d.limits)
            out.append((view, f"confirmation round {round_ + 1} of #{conf.number}"))
        if conf.served is not None:
            view = TrialView.under(conf.served, d.limits)
            out.append((view, f"as served (vllm serve over HTTP) of #{conf.number}"))
    return out


def _rate_cell(d: Decision, v: TrialView) -> str:
    fit = v.fit_under(d.reranked)
    if fit is not None:
        high = "open" if not math.isfinite(fit.high_rps) else f"{fit.high_rps:.2f}"
        return f"{fit.rate_rps:.2f} [{fit.low_rps:.2f}, {high}]"
    return "-" if v.ranked.point is None else rate_text(v.ranked.point).replace(" req/s", "") + " (passed)"


def _values_cell(d: Decision, v: TrialView) -> str:
    """'80ms, 41ms': each limit's statistic at the chosen point, in the order the column's header names them."""
    if not v.ranked.answerable:
        return "-"
    values = [point_value_ms(v.ranked.point, lim, d.limits) for lim in d.limits]
    return ", ".join(format_ms(x) if math.isfinite(x) else "n/a" for x in values)


def trial_rows(d: Decision) -> list[dict[str, Any]]:
    """Every trial and confirmation run, by number: its role, numbers, probes, what stopped it and its parameters."""
    entries = [(v, role_text(d, v)) for v in d.views] + _runs(d)
    by_config = {v.number: v for v in d.views}
    latency = ", ".join(lim.name for lim in d.limits)  # 'TTFT P99, TPOT P99': each limit's statistic, in order
    rows = []
    for v, role in sorted(entries, key=_in_order):
        config = by_config.get((CONFIRM.of(v.trial) or {}).get("of", v.number), v)
        requests = v.measured.requests if v.measured is not None else None
        rows.append({
            "trial": _label(v), "role": role,
            "output tok/s": f"{v.ranked.output_throughput_tok_s:.1f}" if v.ranked.answerable else "-",
            "rate at the limit, req/s [95%]": _rate_cell(d, v),
            latency: _values_cell(d, v),
            "probes": f"{len(v.curve)}" + (f" ({requests} req)" if requests else ""),
            "what stopped it": trial_reason(d, v),
            "changed from vLLM's defaults": changed_text(d, config),
        })
    return rows


def probe_panels(d: Decision) -> list[Panel]:
    """One panel per trial and confirmation run that stored probes, by number; the recommendation highlighted."""
    entries = [(v, role_text(d, v)) for v in d.views] + _runs(d)
    return [Panel(_label(v) + (f" {role}" if role else ""), v.curve, v.ranked.point, v is d.best)
            for v, role in sorted(entries, key=_in_order) if v.curve]


def _label(v: TrialView) -> str:
    """#7 for a search trial; a confirmation run by its name (c3), as `optimize report --trial` takes it."""
    return run_name(v.trial) if is_confirmation(v.trial) else f"#{v.number}"


def _in_order(entry: tuple[TrialView, str]) -> tuple[bool, int]:
    """Search trials by number, then the confirmation study's runs by theirs."""
    return is_confirmation(entry[0].trial), entry[0].number


def decision_headline(d: Decision) -> str:
    """The answer in one sentence: the confirmed median and its interval where the study was confirmed."""
    if d.best is None:
        return f"No trial meets {d.limits.text}: there is no recommendation."
    if not d.confirmed:
        return summary_lines(d)[0]
    tp, g = d.throughput(d.best), d.gain(d.best)
    gain = "" if g is None else (f"; gain over vLLM's defaults {g.pct:+.1f}% (ratio of the medians)"
                                 + (f", per-round 95% interval {g.interval_text()}" if g.known else ""))
    which = f"keep vLLM's defaults ({d.defaults_of}, trial #{d.best.number})" if d.best.baseline else \
        f"trial #{d.best.number}"
    return f"recommended: {which}: {tp.text()}{gain}"


def _decision_lines(d: Decision) -> list[str]:
    # the headline says the recommendation; where confirmed, the search's single numbers live in the trials table
    skip = ("parameter importance", "recommended:") + (("vLLM defaults (",) if d.confirmed else ())
    return [line for line in summary_lines(d) if not line.startswith(skip)]


def _also(d: Decision) -> str:
    """'; each probe judged under TTFT P99 <= 150ms, TPOT P99 <= 50ms' where the study has more than one limit."""
    return f"; each probe judged under {d.limits.text}" if len(d.limits) > 1 else ""


def _importance_html(d: Decision) -> str:
    e = html.escape
    n = len(importance_trials(d.views))
    if not d.importances:
        return f"<h2>Parameter importance</h2><p>{e(d.importance_note)}</p>"
    caveat = importance_caveat(n)
    rows = [{"parameter": k, "importance": f"{v:.2f}"} for k, v in d.importances.items()]
    meet = "meet the limits" if len(d.limits) > 1 else "meet the limit"
    return (f"<h2>Parameter importance, from {n} trials that {meet}</h2><p>{e(d.importance_note)}</p>"
            + (f"<p class='caveat'>{e(caveat)}</p>" if caveat else "") + format_output(rows, "html"))


_CSS = ("body{font-family:system-ui,sans-serif;margin:16px 24px;font-size:14px;color:#222}"
        "h1{font-size:21px;margin:0 0 10px}h2{font-size:17px;margin:26px 0 6px;border-bottom:1px solid #ddd}"
        "table{border-collapse:collapse;margin:6px 0;font-size:12.5px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;vertical-align:top}"
        "th{background:#f0f0f0}table.meta th{text-align:left;white-space:nowrap}table.meta td{text-align:left}"
        ".trials table{width:100%}.trials th{text-align:left}.trials td{white-space:nowrap}"
        ".trials td:nth-child(2){text-align:left}"
        ".trials td:nth-child(n+7){text-align:left;white-space:normal;overflow-wrap:anywhere;width:36%}"
        "img{max-width:100%;height:auto}li{margin:.2em 0}"
        ".decision{font-size:16px;background:#fff8e1;border-left:4px solid #e6a700;padding:8px 12px;margin:8px 0}"
        ".caveat{color:#8a4b00}.key{margin-right:1.2em;white-space:nowrap}"
        ".probes{display:grid;grid-template-columns:repeat(auto-fill,minmax(210px,1fr));gap:8px}"
        ".probes figure{margin:0;border:1px solid #ddd}.probes figure.best{border:2px solid #e6a700}"
        ".probes svg{width:100%;height:auto;display:block}")


def render_html(d: Decision, png: bytes, info: RunInfo | None = None) -> str:
    """A page that needs no other file: the metadata, the decision, the figure embedded as base64, every config's
    probes as inline SVG, the tables and the caveats."""
    e = html.escape
    meta = "" if info is None else "<table class='meta'>" + "".join(
        f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in metadata_rows(d, info)) + "</table>"
    items = "".join(f"<li>{e(line)}</li>" for line in _decision_lines(d))  # the defaults-as-run line among them
    # the served lines are among the decision's (confirmation_lines): the table's served column, not said again
    confirmed = "" if not d.confirmed else (f"<h2>Confirmation</h2><p>{e(confirmation_lines(d)[0])}</p>"
                                            f"{format_output(confirmation_rows(d), 'html')}")
    spaced = [{k.replace("_", " "): value for k, value in row.items()} for row in front_rows(d, with_params=False)]
    front = format_output(spaced, "html") if d.front else "<p>(no trial)</p>"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(d.study_name)}: optimize report</title>"
            f"<style>{_CSS}</style></head><body><h1>{e(title(d))}</h1>{meta}"
            f"<h2>Decision</h2><p class='decision'>{e(decision_headline(d))}</p><ul>{items}</ul>{confirmed}"
            f"<h2>Overview</h2>"
            f"<img alt='report figure' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            f"<h2>Feasible Pareto front</h2>{front}{_importance_html(d)}"
            f"<h2>Probes of every config: offered rate (req/s) vs {e(d.limits.first.name)} (log), its limit dashed"
            f"{e(_also(d))}</h2>"
            f"<p>{legend_html()} <span class='key'>ring: the rate chosen</span> (hover a marker for its numbers)</p>"
            f"{chart_html(probe_panels(d), d.limits)}"
            f"<h2>Every trial and confirmation run</h2><div class='trials'>{format_output(trial_rows(d), 'html')}</div>"
            f"</body></html>")
