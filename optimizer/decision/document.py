"""What `optimize report` prints, in each `--format`: the decision as one document.

`report_document` is the decision as plain data: the recommendation with the numbers every view shows (confirmed:
the median over the rounds with its interval and round count), vLLM's defaults and what they ran with here, the gain
with its interval, the ties, the confirmation table, the Pareto front, every trial with its reason, and the notes.
`--format json` prints it; `--format csv` prints its tables as one sheet, a `section` column saying which table a row
belongs to; the table format renders the same decision as text. The HTML page can read the same document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from optimizer.decision.decide import Decision, view
from optimizer.decision.tables import check_format, format_output, json_text
from optimizer.decision.views import (
    confirmation_lines, confirmation_records, confirmation_rows, defaults_as_run_text, front_rows, params_rows,
    summary_lines, title, trial_reason, trial_row,
)
from optimizer.decision.verdict import answer_line, verdict_line
from optimizer.measurement.sequential import Outcome
from optimizer.params.space import distance_to_default
from optimizer.search.attrs import PRUNED_DETAIL

SECTIONS = ("front", "confirmation")  # the CSV's `section` values, in the order its rows come


def verdict(d: Decision) -> str:
    """The decision in a few words. Confirmed, the rounds' outcome (measurement/sequential.py): 'confirmed gain',
    'keep vLLM's defaults', 'undecided', 'confirmation not finished'; else 'keep vLLM's defaults', 'tied with vLLM's
    defaults', 'gain from one measurement each', 'no baseline to compare', 'no trial meets the limit'."""
    if d.best is None:
        return "no trial meets the limit"
    if d.confirmed and d.confirmation is not None:
        return {Outcome.BETTER: "confirmed gain", Outcome.KEEP: "keep vLLM's defaults",
                Outcome.UNDECIDED: "undecided", Outcome.RUNNING: "confirmation not finished"}[d.confirmation.outcome]
    if d.best is d.baseline:
        return "keep vLLM's defaults"
    gain = d.gain(d.best)
    if gain is None:
        return "no baseline to compare"
    if not gain.rounds:
        return "gain from one measurement each"
    if not gain.known:
        return "gain from one round: no interval"
    return "confirmed gain" if gain.low_pct is not None and gain.low_pct > 0 else "tied with vLLM's defaults"


def _config(d: Decision, number: int) -> dict[str, Any]:
    v = view(d, number)
    return {"trial": v.number, "params": dict(v.trial.params), "engine_config": v.engine_config,
            "output_throughput": d.throughput(v).to_dict()}


def trial_records(d: Decision) -> list[dict[str, Any]]:
    """Every finished search trial, by number: its row (the search's numbers), state, reason and engine config."""
    out = []
    for v in d.views:
        row = trial_row(d, v, [])
        detail = PRUNED_DETAIL.of(v.trial)
        out.append({**row, "state": v.trial.state.name.lower(), "reason": trial_reason(v),
                    **({"detail": detail} if detail else {}), "params": dict(v.trial.params),
                    "engine_config": v.engine_config})
    return out


def limits_record(d: Decision) -> dict[str, Any]:
    """The limits the trials are ranked at and those the study searched with, as typed values: `limits` and
    `searched` each a list of {metric, stat, value_ms}, with their goodput share (None: percentile limits), the
    limits in words, and whether the report re-ranks for other limits than the study's."""
    ranked, searched = d.limits.model_dump(mode="json"), d.searched_limits.model_dump(mode="json")
    return {"limits": ranked["items"], "goodput_pct": ranked["goodput_pct"], "text": d.limits.text,
            "searched": searched["items"], "searched_goodput_pct": searched["goodput_pct"], "reranked": d.reranked}


def report_document(d: Decision) -> dict[str, Any]:
    """The decision as one JSON-ready document (NaN where a number is missing; `json_text` writes it as null)."""
    c = d.confirmation if d.confirmed else None
    recommendation = None
    if d.best is not None:
        recommendation = _config(d, d.best.number)
        if d.baseline is not None:
            recommendation["changed_from_defaults"] = {
                k: {"defaults": a, "recommended": b}
                for k, (a, b) in distance_to_default(d.best.engine_config, d.baseline.engine_config).items()}
    baseline = None
    if d.baseline is not None:
        baseline = {**_config(d, d.baseline.number), "defaults_of": d.defaults_of,
                    "not_vllm_defaults": {k: {"value": v, "why": why} for k, (v, why) in d.defaults_as_run.items()}}
    gain = d.gain(d.best) if d.best is not None else None
    return {
        "study": d.study_name,
        "title": title(d),
        "limits": limits_record(d),
        "verdict": verdict(d),
        "answer": answer_line(d),
        "recommendation": recommendation,
        "baseline": baseline,
        "gain_over_defaults": gain.to_dict() if gain is not None else None,
        "ties": [{"trial": v.number, "output_throughput": d.throughput(v).to_dict()} for v in d.ties],
        "confirmation": None if c is None else {
            "rounds": len(c.full_rounds), "rounds_planned": c.rounds, "complete": c.complete,
            "runs_done": c.runs_done, "title": confirmation_lines(d)[0], "configs": confirmation_records(d),
            "outcome": c.outcome.value, "verdict_line": verdict_line(d), "confidence_per_look": c.confidence,
            "dropped_out": {str(n): r for n, r in c.dropped.items()}},
        "front": front_rows(d),
        "trials": trial_records(d),
        "importances": d.importances,
        "importance_note": d.importance_note,
        "notes": d.notes,
        "summary": summary_lines(d),
    }


def _cell(value: Any) -> Any:
    return " ".join(str(x) for x in value) if isinstance(value, list) else value


def report_csv_rows(d: Decision) -> list[dict[str, Any]]:
    """The front and the confirmation table as one sheet: `section` first, then the columns (a column both tables
    have, such as `output_throughput_tok_s` or `rate_rps`, means the same in both); the baseline's rows say in
    `not_vllm_defaults` what it ran with that is not vLLM's default."""
    rows = [{"section": "front", **r} for r in front_rows(d)]
    if d.confirmed:
        rows += [{"section": "confirmation", **{k: _cell(v) for k, v in r.items()}} for r in confirmation_records(d)]
    base, note = (d.baseline.number if d.baseline is not None else None), defaults_as_run_text(d)
    return [{**r, "not_vllm_defaults": note if r["trial"] == base else None} if note else r for r in rows]


def render(d: Decision, fmt: str, lead: Sequence[str] = ()) -> tuple[str, list[str]]:
    """What `optimize report` prints: (stdout, lines for stderr), `lead` first (the decision's line and its deploy
    command: decision/report.py `lead_lines`). Machine formats keep stdout to the data."""
    check_format(fmt)
    if fmt == "json":
        return json_text(report_document(d)), [*lead, title(d), *summary_lines(d)]
    if fmt == "csv":
        return format_output(report_csv_rows(d), "csv"), [*lead, title(d), *summary_lines(d)]
    parts = [*lead, *([""] if lead else []), title(d),
             format_output(front_rows(d, with_params=False), "table") if d.front else "(no trial)"]
    if d.front:
        parts += ["", format_output(params_rows(d), "table")]
    if d.confirmed:
        parts += ["", confirmation_lines(d)[0], format_output(confirmation_rows(d), "table")]
    return "\n".join([*parts, "", *summary_lines(d)]), []
