"""The last screen of a run: the decision and the command that deploys it, the table of vLLM's defaults against
the recommendation, then what `optimize report` says of them; lines kept to a terminal's width where they allow.

It is a view of `decision/decide.py`, the same decision `optimize report` prints, rendered by the one table renderer
(`decision/tables.py`).
"""

from __future__ import annotations

import math
from typing import Any

import optuna
from optuna.trial import TrialState

from optimizer.config.settings import StudyConfig
from optimizer.core.units import format_ms
from optimizer.decision.decide import Decision
from optimizer.decision.tables import format_output
from optimizer.measurement.rerank import point_value_ms
from optimizer.search.attrs import PRUNED_REASON


def _latency_header(d: Decision) -> list[str]:
    """The end table's latency columns: TTFT P50 where a limit is on TTFT, then each limit's statistic."""
    return (["TTFT P50"] if any(lim.metric == "ttft" for lim in d.limits) else []) + [lim.name for lim in d.limits]


def _ms(value_ms: float) -> str:
    return format_ms(value_ms) if math.isfinite(value_ms) else "-"


def _row(d: Decision, label: str, v: Any) -> list[str]:
    """One line of the end table from a decision.TrialView (None: no such trial)."""
    blank = ["-"] * len(_latency_header(d))
    if v is None:
        return [label, "-", "-", "-", "-", *blank]
    trial = v.trial
    if trial.state == TrialState.PRUNED:
        return [label, f"#{trial.number}", "cannot run", PRUNED_REASON.of(trial) or "?", "-", *blank]
    p = v.ranked.point
    if p is None:
        return [label, f"#{trial.number}", "misses the limits at every rate", "-", "-", *blank]
    rate = p.get("offered_rate_rps")
    replays = p.get("replays", 1)
    failed = v.ranked.next_rate_rps
    p50 = [_ms(float(p.get("ttft_p50_ms", math.nan)))] if any(lim.metric == "ttft" for lim in d.limits) else []
    return [label, f"#{trial.number}", f"{v.ranked.output_throughput_tok_s:.1f}" + (f" (median of {replays})"
                                                                                     if replays > 1 else ""),
            "burst" if rate is None else f"{rate:.2f}", "-" if failed is None else f"{failed:.2f}",
            *p50, *(_ms(point_value_ms(p, lim, d.limits)) for lim in d.limits)]


WIDTH = 100  # a terminal's width: the last screen's lines keep to it where their content allows


def summary_text(study: optuna.Study, config: StudyConfig, width: int = WIDTH) -> str:
    """The last screen of a run: the decision in one line (decision/verdict.py `answer_line`), the command that
    deploys it (as `optimize export` prints it), then the table of vLLM's defaults against the recommendation
    (confirmed: each config's median over the rounds with its 95% interval, and the gain with its interval), then
    what `optimize report` says of them: changed parameters, importances, caveats. One decision
    (decision/decide.py); the statistics are defined in `optimize report` and docs/report.md."""
    from optimizer.decision.decide import decide

    d = decide(study, config)
    return "\n".join([*lead_lines(d, config, width), "", *table_lines(d, config), *tail_lines(d, width)])


def lead_lines(d: Decision, config: StudyConfig, width: int = WIDTH) -> list[str]:
    """The answer first: the decision's line, then the command that deploys it (none without a recommendation)."""
    from optimizer.decision.verdict import answer_line

    return [answer_line(d), *([deploy_command(d, config, width)] if d.best is not None else [])]


def deploy_command(d: Decision, config: StudyConfig, width: int = WIDTH) -> str:
    """'deploy: vllm serve MODEL --max-num-seqs 64 ...': the recommendation's serve command as `optimize export`
    builds it (decision/export.py), over lines of `width` continued with ` \\`, so that it pastes as printed."""
    from optimizer.decision.export import serve_args, serve_env, to_serve_command
    from optimizer.search.runner import model_path

    assert d.best is not None
    trial = d.best.trial
    return to_serve_command(serve_args(trial, config, model_path(config)), serve_env(trial, config), width=width,
                            first="deploy: ")


def table_lines(d: Decision, config: StudyConfig) -> list[str]:
    """The table's title and the table: the confirmed configs (`confirmed_rows`), or vLLM's defaults and the
    recommendation as the search measured them."""
    if d.confirmed:
        assert d.confirmation is not None
        rounds = len(d.confirmation.full_rounds)
        return [f"confirmed in {rounds} round{'s' if rounds != 1 else ''} at {d.limits.text}: "
                f"medians and 95% intervals; req/s: the rate at the limits",
                format_output(confirmed_rows(d), "table")]
    header = ["config", "trial", "output tok/s", "rate req/s", "failed at req/s", *_latency_header(d)]
    return [f"{d.limits.text}, one measurement each (not confirmed)",
            format_output([dict(zip(header, _row(d, f"vLLM defaults ({d.defaults_of})", d.baseline))),
                           dict(zip(header, _row(d, "recommended", d.best)))], "table")]


def confirmed_rows(d: Decision) -> list[dict[str, Any]]:
    """The confirmed configs (decision/views.py `confirmation_records`) in the columns a terminal holds: the longer
    table, with each statistic named in its header, is `optimize report`'s."""
    from optimizer.decision.served import served_cell
    from optimizer.decision.views import confirmation_records, confirmation_row

    records = confirmation_records(d)
    served = any(r["served_run"] for r in records)  # a column only where a config ran through `vllm serve`
    base = f"vLLM defaults ({d.defaults_of})"
    rows = []
    for r in records:
        full = confirmation_row(r)
        roles = [("vLLM defaults" if role == base else role) for role in r["role"].split(", ")
                 if role != "measured again"]
        rows.append({"config": " ".join([f"#{r['trial']}", ", ".join(roles)]).strip(), "rounds": r["rounds"],
                     "tok/s": full["tok/s (median)"], "tok/s 95%": full["95% interval of the mean"],
                     "gain": full["gain (ratio of medians)"], "gain 95%": full["per-round gain, 95% interval"],
                     "req/s": full["req/s at the limit, in process (median)"],
                     **({"served req/s": served_cell(r)} if served else {})})
    return rows


def tail_lines(d: Decision, width: int = WIDTH) -> list[str]:
    """What follows the table: the advice where nothing met the limits; else what `optimize report` says of the
    decision (decision/views.py `summary_lines`) less what the lines above give, each wrapped to `width`."""
    import textwrap

    from optimizer.decision.verdict import verdict_line
    from optimizer.decision.views import summary_lines

    if d.best is None:
        out = [f"No trial met the limit{'s' if len(d.limits) > 1 else ''}: {d.limits.text}. Relax "
               f"{'them' if len(d.limits) > 1 else 'it'} ({d.limits.flags}), lower the workload's lengths, or widen "
               f"the ranges."]
    else:
        shown = ("recommended:", f"vLLM defaults ({d.defaults_of}, baseline):")  # the table has them
        verdict = verdict_line(d) if d.confirmed else None  # the decision's line has it
        out = [line for line in summary_lines(d) if not line.startswith(shown) and line != verdict]
        if d.gain_pct is None and d.baseline is not None and d.best is not d.baseline:
            out.append("vLLM's defaults miss the limit at every rate tried: the recommendation is the only feasible "
                       "one")
    return [wrapped for line in out for wrapped in textwrap.wrap(line, width, subsequent_indent="  ",
                                                                 break_on_hyphens=False, break_long_words=False)
                                                   or [""]]
