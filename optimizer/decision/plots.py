"""The report's picture (PNG, matplotlib's Agg canvas: no display needed) and a self-contained HTML page.

Four panels: the Pareto front with the SLO limit, the optimization history, TTFT P99 against offered rate for
the best configurations and vLLM's defaults, and the parameter importances.
"""

from __future__ import annotations

import base64
import html
import io
import math
import textwrap
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatter, MaxNLocator

from optimizer.core.units import format_ms
from optimizer.decision.decide import Decision
from optimizer.decision.tables import format_output
from optimizer.decision.trial import TrialView
from optimizer.decision.views import front_rows, summary_lines, title, trial_row
from optimizer.measurement.rerank import Answer, rate_key_rps
from optimizer.params.space import SEARCHABLE
from optimizer.search.attrs import PRUNED_REASON

CURVES_SHOWN = 3
_PLAIN = LogFormatter(labelOnlyBase=False)  # 20, 50, 100 instead of 2x10^1
SLO_STYLE: dict[str, Any] = {"color": "tab:red", "linestyle": "--", "linewidth": 1.2}


def _legend_below(ax: Axes, handles: list | None = None) -> None:
    # Below the axes, never over the data; constrained layout makes room for it.
    kw = {"handles": handles} if handles is not None else {}
    ax.legend(**kw, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)


def _empty_note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="tab:red",
            bbox={"facecolor": "white", "edgecolor": "tab:red", "alpha": 0.9})


def _slo_label(d: Decision) -> str:
    return f"TTFT P99 limit {format_ms(d.limit_ms)}"


def _pareto(ax: Axes, d: Decision) -> None:
    feasible = [v for v in d.views if v.ranked.answerable]
    missed = [c for v in d.views if v.ranked.answer == Answer.NO_POINT and (c := v.ranked.closest) is not None]
    if missed:
        ax.scatter([c["ttft_p99_ms"] for c in missed], [c["output_throughput_tok_s"] for c in missed],
                   marker="x", color="0.6", label="misses the limit (its lowest-TTFT replay)")
    exact = [v for v in feasible if v.ranked.answer != Answer.LOWER_BOUND]
    bounds = [v for v in feasible if v.ranked.answer == Answer.LOWER_BOUND]
    if exact:
        ax.scatter([v.ranked.ttft_p99_ms for v in exact], [v.ranked.output_throughput_tok_s for v in exact],
                   color="tab:blue", alpha=0.6, label="meets the limit")
    if bounds:
        ax.scatter([v.ranked.ttft_p99_ms for v in bounds], [v.ranked.output_throughput_tok_s for v in bounds],
                   marker="^", color="tab:blue", alpha=0.6, label="meets the limit (lower bound)")
    if d.front:
        pts = sorted((v.ranked.ttft_p99_ms, v.ranked.output_throughput_tok_s) for v in d.front)
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="tab:orange", linewidth=1.5,
                marker="o", label="Pareto front")
    ax.axvline(d.limit_ms, **SLO_STYLE, label=_slo_label(d))
    base = d.baseline
    if base is not None and base.ranked.point is not None:
        ax.scatter([base.ranked.ttft_p99_ms], [base.ranked.output_throughput_tok_s], s=130, marker="s",
                   facecolors="none", edgecolors="black", linewidths=1.5, label=f"vLLM defaults (#{base.number})",
                   zorder=4)
    if d.best is not None:
        ax.scatter([d.best.ranked.ttft_p99_ms], [d.best.ranked.output_throughput_tok_s], s=260, marker="*",
                   color="gold", edgecolors="black", label=f"recommended (#{d.best.number})", zorder=5)
    xs = [v.ranked.ttft_p99_ms for v in feasible] + [c["ttft_p99_ms"] for c in missed]
    if xs and max(xs + [d.limit_ms]) / max(min(xs + [d.limit_ms]), 1e-9) > 20:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_PLAIN)
        ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.set_xlabel("TTFT P99 at the best sustained rate (ms)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title("Pareto front: throughput vs TTFT P99" + ("" if feasible else
                 f"\n(no stored replay meets TTFT P99 <= {format_ms(d.limit_ms)})"))
    ax.grid(alpha=0.3)
    _legend_below(ax)


def _history(ax: Axes, d: Decision) -> None:
    hist = d.history()
    done = [(n, tp) for n, tp, _ in hist if tp is not None]
    steps = [(n, best) for n, _, best in hist if best is not None]
    missed = [n for n, tp, _ in hist if tp is None]
    if done:
        ax.scatter([n for n, _ in done], [tp for _, tp in done], color="tab:blue", alpha=0.6,
                   label="trial meets the limit")
    if steps:
        ax.step([n for n, _ in steps], [b for _, b in steps], where="post", color="tab:orange", linewidth=1.5,
                label="best so far")
    if missed:
        ax.scatter(missed, [0] * len(missed), marker="x", color="0.5", label="misses the limit or cannot run")
    if d.best is not None:
        ax.scatter([d.best.number], [d.best.ranked.output_throughput_tok_s], s=260, marker="*", color="gold",
                   edgecolors="black", label=f"recommended (#{d.best.number})", zorder=5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial number")
    ax.set_ylabel("output throughput within the limit (tokens/s)")
    ax.set_title("Optimization history")
    if not done:
        _empty_note(ax, f"no trial meets TTFT P99 <= {format_ms(d.limit_ms)}")
        ax.set_ylim(-0.04, 1)
        ax.set_yticks([0])
    else:
        top = ax.get_ylim()[1]
        ax.set_ylim(-0.04 * top, top)  # room for the markers of trials at 0
    ax.grid(alpha=0.3)
    _legend_below(ax)


def curve_trials(d: Decision) -> list[TrialView]:
    """The best searched configurations by throughput within the limit, then vLLM's defaults."""
    shown = [v for v in d.by_throughput() if not v.baseline][:CURVES_SHOWN]
    if d.baseline is not None and d.baseline.curve:
        shown.append(d.baseline)
    return shown


def _curves(ax: Axes, d: Decision) -> None:
    colors = ["tab:orange", "tab:green", "tab:purple", "tab:brown"]
    chosen_any = burst_any = False
    for v, color in zip(curve_trials(d), colors):
        pts = sorted((p for p in v.curve if p.get("offered_rate_rps") is not None and p.get("sustained")
                      and math.isfinite(p.get("ttft_p99_ms", math.nan))), key=rate_key_rps)
        label = f"#{v.number}" + (" vLLM defaults" if v.baseline else "") + (" (recommended)" if v is d.best else "")
        style: dict[str, Any] = {"color": "black" if v.baseline else color, "linestyle": ":" if v.baseline else "-"}
        ax.plot([p["offered_rate_rps"] for p in pts], [p["ttft_p99_ms"] for p in pts], marker="o", label=label,
                **style)
        chosen = v.ranked.point
        if chosen is not None and chosen.get("offered_rate_rps") is not None:
            chosen_any = True
            ax.scatter([chosen["offered_rate_rps"]], [chosen["ttft_p99_ms"]], s=120, facecolors="none",
                       edgecolors=style["color"], linewidths=2, zorder=4)
        for p in v.curve:
            if p.get("offered_rate_rps") is None and p.get("request_throughput_rps"):
                burst_any = True
                ax.scatter([p["request_throughput_rps"]], [p["ttft_p99_ms"]], marker="D", facecolors="none",
                           edgecolors=style["color"], linewidths=2 if v.ranked.point is p else 1)
    ax.axhline(d.limit_ms, **SLO_STYLE, label=_slo_label(d))
    extra = [Line2D([], [], marker="D", linestyle="none", markerfacecolor="none", markeredgecolor="0.3",
                    label="burst, at its completion rate")] if burst_any else []
    if chosen_any:
        extra.append(Line2D([], [], marker="o", linestyle="none", markersize=10, markerfacecolor="none",
                            markeredgecolor="0.3", markeredgewidth=2, label="chosen rate"))
    handles, _ = ax.get_legend_handles_labels()
    ax.set_yscale("log")
    ax.margins(y=0.08)
    ax.set_xlabel("offered request rate (requests/s, Poisson)")
    ax.set_ylabel("TTFT P99 (ms, log scale)")
    ax.set_title(f"Latency vs load: best {CURVES_SHOWN} and vLLM defaults")
    ax.yaxis.set_major_formatter(_PLAIN)
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.grid(alpha=0.3, which="both")
    _legend_below(ax, handles + extra)


def _importances(ax: Axes, d: Decision) -> None:
    ax.set_title("Parameter importance for output throughput")
    if not d.importances:
        ax.text(0.5, 0.5, textwrap.fill(d.importance_note, 60), ha="center", va="center", fontsize=10,
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    items = sorted(d.importances.items(), key=lambda kv: kv[1])
    ax.barh([k for k, _ in items], [v for _, v in items], color="tab:blue")
    ax.set_xlabel(f"importance (normalized to sum to 1; {d.importance_note.split(' over ')[0]})")
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3, axis="x")


def render_png(d: Decision, dpi: int = 110) -> bytes:
    """The four-panel report figure as PNG bytes."""
    fig = Figure(figsize=(15, 10.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    _pareto(axes[0][0], d)
    _history(axes[0][1], d)
    _curves(axes[1][0], d)
    _importances(axes[1][1], d)
    fig.suptitle(title(d), fontsize=13)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def all_rows(d: Decision) -> list[dict]:
    """Every finished trial as a row (its pruning reason where it could not run)."""
    params = [k for k in SEARCHABLE if any(k in v.engine_config for v in d.views)]
    rows = []
    for v in d.views:
        row = trial_row(d, v, params)
        reason = PRUNED_REASON.of(v.trial)
        if reason:
            row["answer"] = f"cannot run: {reason}"
        rows.append(row)
    return rows


_CSS = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f0f0f0}"
        "img{max-width:100%}li{margin:.2em 0}")


def render_html(d: Decision, png: bytes) -> str:
    """A page that needs no other file: the figure embedded as base64, the tables, the caveats."""
    e = html.escape
    items = "".join(f"<li>{e(line)}</li>" for line in summary_lines(d))
    imp = format_output([{"parameter": k, "importance": v} for k, v in d.importances.items()], "html") \
        if d.importances else f"<p>{e(d.importance_note)}</p>"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(d.study_name)}: optimize report</title>"
            f"<style>{_CSS}</style></head><body><h1>{e(title(d))}</h1><ul>{items}</ul>"
            f"<img alt='report figure' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            f"<h2>Feasible Pareto front</h2>{format_output(front_rows(d), 'html')}"
            f"<h2>Parameter importance</h2>{imp}"
            f"<h2>All finished trials</h2>{format_output(all_rows(d), 'html')}</body></html>")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_report(d: Decision, out_dir: Path) -> tuple[Path, Path]:
    """Write `<study>.report.png` and `<study>.report.html` into `out_dir`; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = render_png(d)
    png_path, html_path = out_dir / f"{d.study_name}.report.png", out_dir / f"{d.study_name}.report.html"
    _write_atomic(png_path, png)
    _write_atomic(html_path, render_html(d, png).encode())
    return png_path, html_path
