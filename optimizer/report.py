"""From a study to a decision: the recommendation, the baseline, and the table that compares them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.space import distance_to_default
from optimizer.study import is_baseline
from optimizer.units import format_ms


def feasible(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def throughput(trial: FrozenTrial) -> float:
    return float(trial.values[0]) if trial.values else float("nan")


def recommended(study: optuna.Study) -> FrozenTrial | None:
    """The feasible trial with the highest output throughput (ties: lower TTFT P99)."""
    candidates = [t for t in study.get_trials(deepcopy=False) if feasible(t)]
    if not candidates:
        return None
    return max(candidates, key=lambda t: (t.values[0], -t.values[1]))


def baseline(study: optuna.Study) -> FrozenTrial | None:
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if is_baseline(t):
            return t
    return None


@dataclass(frozen=True)
class Comparison:
    """Baseline against recommendation, in numbers a person reads."""

    baseline: FrozenTrial | None
    best: FrozenTrial | None
    gain_pct: float | None
    changed: dict[str, tuple[Any, Any]]


def compare(study: optuna.Study) -> Comparison:
    base, best = baseline(study), recommended(study)
    gain = None
    if base is not None and best is not None and feasible(base) and throughput(base) > 0:
        gain = (throughput(best) / throughput(base) - 1) * 100
    changed = {}
    if best is not None:
        base_cfg = base.user_attrs.get("engine_config", {}) if base is not None else {}
        changed = distance_to_default(best.user_attrs.get("engine_config", {}), base_cfg)
    return Comparison(base, best, gain, changed)


def _row(label: str, trial: FrozenTrial | None) -> list[str]:
    if trial is None:
        return [label, "-", "-", "-", "-", "-"]
    if trial.state == TrialState.PRUNED:
        return [label, f"#{trial.number}", "cannot run", trial.user_attrs.get("pruned_reason", "?"), "-", "-"]
    r = trial.user_attrs.get("result", {})
    rate = r.get("rate_rps")
    rate_s = "burst" if rate is None else f"{rate:.2f}"
    note = "" if feasible(trial) else " (misses limit at every rate)"
    return [label, f"#{trial.number}", f"{throughput(trial):.1f}{note}", rate_s,
            format_ms(r.get("ttft_p50_ms", math.nan)), format_ms(r.get("ttft_p99_ms", math.nan))]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def summary_text(study: optuna.Study, ttft_p99_ms: float) -> str:
    """The end-of-study table: baseline vs recommended, the parameters that changed, the gain."""
    c = compare(study)
    header = ["config", "trial", "output tok/s", "rate req/s", "TTFT P50", "TTFT P99"]
    out = [f"TTFT P99 limit {format_ms(ttft_p99_ms)}; throughput at the highest Poisson rate sustained within it",
           table([_row("vLLM defaults", c.baseline), _row("recommended", c.best)], header)]
    if c.baseline is not None and c.baseline.user_attrs.get("baseline_note"):
        out.append(f"note: {c.baseline.user_attrs['baseline_note']}")
    if c.best is None:
        out.append("No trial met the limit. Relax --ttft-p99, lower the workload's lengths, or widen the ranges.")
        return "\n".join(out)
    if c.changed:
        out.append("changed from vLLM's defaults: " + ", ".join(f"{k} {a} -> {b}" for k, a, b in
                                                              ((k, *v) for k, v in c.changed.items())))
    if c.gain_pct is not None:
        out.append(f"gain over vLLM's defaults: {c.gain_pct:+.1f}% output throughput")
    elif c.baseline is not None:
        out.append("vLLM's defaults miss the limit at every rate tried: the recommendation is the only feasible one")
    return "\n".join(out)
