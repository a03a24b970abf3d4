"""The end-of-run table: vLLM's defaults against the recommendation, then what `optimize report` says of them.

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
from optimizer.decision.tables import format_output
from optimizer.search.attrs import PRUNED_REASON


def _row(label: str, v: Any) -> list[str]:
    """One line of the end table from a decision.TrialView (None: no such trial)."""
    if v is None:
        return [label, "-", "-", "-", "-", "-", "-"]
    trial = v.trial
    if trial.state == TrialState.PRUNED:
        return [label, f"#{trial.number}", "cannot run", PRUNED_REASON.of(trial) or "?", "-", "-", "-"]
    p = v.ranked.point
    if p is None:
        return [label, f"#{trial.number}", "misses limit at every rate", "-", "-", "-", "-"]
    rate = p.get("offered_rate_rps")
    replays = p.get("replays", 1)
    failed = v.ranked.next_rate_rps
    return [label, f"#{trial.number}", f"{v.ranked.output_throughput_tok_s:.1f}" + (f" (median of {replays})"
                                                                                     if replays > 1 else ""),
            "burst" if rate is None else f"{rate:.2f}", "-" if failed is None else f"{failed:.2f}",
            format_ms(p.get("ttft_p50_ms", math.nan)), format_ms(p.get("ttft_p99_ms", math.nan))]


def summary_text(study: optuna.Study, config: StudyConfig) -> str:
    """The end-of-study table, baseline against recommendation (confirmed: each config's median over the rounds with
    its 95% interval, and the gain with its interval), then what `optimize report` says of them: changed parameters,
    importances, caveats. One decision (decision/decide.py)."""
    from optimizer.decision.decide import decide
    from optimizer.decision.views import confirmation_lines, confirmation_rows, summary_lines

    d = decide(study, config)
    if d.confirmed:
        out = [*confirmation_lines(d)[:1], format_output(confirmation_rows(d), "table")]
    else:
        header = ["config", "trial", "output tok/s", "rate req/s", "failed at req/s", "TTFT P50", "TTFT P99"]
        out = [f"TTFT P99 limit {format_ms(config.ttft_p99_ms)}; throughput at the highest rate sustained within "
               f"it, and the next rate tried above it, which missed (not confirmed: one measurement each)",
               format_output([dict(zip(header, _row(f"vLLM defaults ({d.defaults_of})", d.baseline))),
                              dict(zip(header, _row("recommended", d.best)))], "table")]
    if d.best is None:
        out.append("No trial met the limit. Relax --ttft-p99, lower the workload's lengths, or widen the ranges.")
        return "\n".join(out)
    shown = ("recommended:", f"vLLM defaults ({d.defaults_of}, baseline):")  # the table has them
    out += [line for line in summary_lines(d) if not line.startswith(shown)]
    if d.gain_pct is None and d.baseline is not None and d.best is not d.baseline:
        out.append("vLLM's defaults miss the limit at every rate tried: the recommendation is the only feasible one")
    return "\n".join(out)
