"""The report's picture (PNG, matplotlib's Agg canvas: no display needed), and both report files written.

Four panels: the Pareto front with the SLO limit, the optimization history, latency against offered rate for every
probe of the best configurations and vLLM's defaults (each marked passed, or which limit failed it), and the
parameter importances with the number of trials behind them. The latency axes are the first limit's statistic (TTFT
P99 for most studies), its limit the dashed line; a point meets the limits only where it meets every one of them. The
page around it is decision/html.py.
"""

from __future__ import annotations

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
from optimizer.decision.html import RunInfo, render_html
from optimizer.decision.importance import importance_caveat, importance_trials
from optimizer.decision.probes import BEHIND, KINDS, OVER, PASSED, WITHDRAWN, chart_rate_rps, outcome
from optimizer.decision.trial import TrialView
from optimizer.decision.views import title
from optimizer.measurement.rerank import Answer, point_value_ms

CURVES_SHOWN = 3
_PLAIN = LogFormatter(labelOnlyBase=False)  # 20, 50, 100 instead of 2x10^1
SLO_STYLE: dict[str, Any] = {"color": "tab:red", "linestyle": "--", "linewidth": 1.2}


LEGEND_COLUMNS = 2
LEGEND_LABEL_CHARS = 42  # a longer label wraps: two columns of it fit under a panel without overlapping


def _legend_below(ax: Axes, handles: list | None = None) -> None:
    # Below the axes, never over the data; constrained layout makes room for it. Labels wrap so that no column runs
    # into the next or past the panel (a confirmed star's label with its interval is ~75 characters).
    if handles is None:
        handles, _ = ax.get_legend_handles_labels()
    labels = [textwrap.fill(h.get_label(), LEGEND_LABEL_CHARS) for h in handles]
    ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=LEGEND_COLUMNS,
              frameon=False)


def _empty_note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="tab:red",
            bbox={"facecolor": "white", "edgecolor": "tab:red", "alpha": 0.9})


def _slo_label(d: Decision) -> str:
    """'TPOT P99 limit 50ms': the first limit's, the one the latency axes show."""
    first = d.limits.first
    return f"{first.name} limit {format_ms(first.value_ms)}"


def _latency_ms(d: Decision, point: Any) -> float:
    """A stored point's place on the latency axes: the first limit's statistic there."""
    return point_value_ms(point, d.limits.first, d.limits) if point is not None else math.nan


def _pareto(ax: Axes, d: Decision) -> None:
    first = d.limits.first
    feasible = [v for v in d.views if v.ranked.answerable]
    missed = [c for v in d.views if v.ranked.answer == Answer.NO_POINT and (c := v.ranked.closest) is not None
              and math.isfinite(_latency_ms(d, c))]
    if missed:
        ax.scatter([_latency_ms(d, c) for c in missed], [c["output_throughput_tok_s"] for c in missed],
                   marker="x", color="0.6", label="misses the limits (its closest replay)")
    exact = [v for v in feasible if v.ranked.answer != Answer.LOWER_BOUND]
    bounds = [v for v in feasible if v.ranked.answer == Answer.LOWER_BOUND]
    if exact:
        ax.scatter([_latency_ms(d, v.ranked.point) for v in exact], [v.ranked.output_throughput_tok_s for v in exact],
                   color="tab:blue", alpha=0.6, label="meets the limits" if len(d.limits) > 1 else "meets the limit")
    if bounds:
        ax.scatter([_latency_ms(d, v.ranked.point) for v in bounds],
                   [v.ranked.output_throughput_tok_s for v in bounds], marker="^", color="tab:blue", alpha=0.6,
                   label="meets the limits (lower bound)" if len(d.limits) > 1 else "meets the limit (lower bound)")
    if d.front:
        pts = sorted((_latency_ms(d, v.ranked.point), v.ranked.output_throughput_tok_s) for v in d.front)
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="tab:orange", linewidth=1.5,
                marker="o", label="Pareto front")
    ax.axvline(first.value_ms, **SLO_STYLE, label=_slo_label(d))
    base = d.baseline
    if base is not None and base.ranked.point is not None:
        ax.scatter([_latency_ms(d, base.ranked.point)], [base.ranked.output_throughput_tok_s], s=130, marker="s",
                   facecolors="none", edgecolors="black", linewidths=1.5, label=f"vLLM defaults (#{base.number})",
                   zorder=4)
    if d.best is not None:
        _recommended(ax, d, _latency_ms(d, d.best.ranked.point))
    xs = [x for x in [_latency_ms(d, v.ranked.point) for v in feasible] + [_latency_ms(d, c) for c in missed]
          if math.isfinite(x) and x > 0]
    if xs and max(xs + [first.value_ms]) / max(min(xs + [first.value_ms]), 1e-9) > 20:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_PLAIN)
        ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.set_xlabel(f"{first.name} at the best sustained rate (ms)")
    ax.set_ylabel("output throughput (tokens/s)")
    within = f"\n(each point within {d.limits.text})" if len(d.limits) > 1 and feasible else ""
    ax.set_title(f"Pareto front: throughput vs {first.name}" + (within if feasible else
                 f"\n(no stored replay meets {d.limits.text})"))
    ax.grid(alpha=0.3)
    _legend_below(ax)


def _recommended(ax: Axes, d: Decision, x: float) -> None:
    """The recommendation's star at `x`: at its confirmed median with its interval as an error bar where the
    confirmation measured it again (the number every other view gives, decision/numbers.py), else at the search's."""
    assert d.best is not None
    tp = d.throughput(d.best)
    label = f"recommended (#{d.best.number})"
    y = d.best.ranked.output_throughput_tok_s
    if tp.confirmed and math.isfinite(tp.output_throughput_tok_s):
        y = tp.output_throughput_tok_s
        label += f": median of {tp.rounds} confirmation rounds"
        if tp.low_tok_s is not None and tp.high_tok_s is not None:
            label += f", 95% interval [{tp.low_tok_s:.0f}, {tp.high_tok_s:.0f}]"
            ax.errorbar([x], [y], yerr=[[y - tp.low_tok_s], [tp.high_tok_s - y]], fmt="none", ecolor="black",
                        capsize=5, zorder=4)
    ax.scatter([x], [y], s=260, marker="*", color="gold", edgecolors="black", label=label, zorder=5)


def _history(ax: Axes, d: Decision) -> None:
    hist = d.history()
    done = [(n, tp) for n, tp, _ in hist if tp is not None]
    steps = [(n, best) for n, _, best in hist if best is not None]
    missed = [n for n, tp, _ in hist if tp is None]
    if done:
        ax.scatter([n for n, _ in done], [tp for _, tp in done], color="tab:blue", alpha=0.6,
                   label="trial meets the limits" if len(d.limits) > 1 else "trial meets the limit")
    if steps:
        ax.step([n for n, _ in steps], [b for _, b in steps], where="post", color="tab:orange", linewidth=1.5,
                label="best so far")
    if missed:
        ax.scatter(missed, [0] * len(missed), marker="x", color="0.5",
                   label="misses the limits or cannot run" if len(d.limits) > 1 else "misses the limit or cannot run")
    if d.best is not None:
        _recommended(ax, d, d.best.number)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial number")
    ax.set_ylabel("output throughput within the limits (tokens/s)" if len(d.limits) > 1 else
                  "output throughput within the limit (tokens/s)")
    ax.set_title("Optimization history")
    if not done:
        _empty_note(ax, f"no trial meets {d.limits.text}")
        ax.set_ylim(-0.04, 1)
        ax.set_yticks([0])
    else:
        top = ax.get_ylim()[1]
        ax.set_ylim(-0.04 * top, top)  # room for the markers of trials at 0
    ax.grid(alpha=0.3)
    _legend_below(ax)


def curve_trials(d: Decision) -> list[TrialView]:
    """The best searched configurations by throughput within the limits, then vLLM's defaults."""
    shown = [v for v in d.by_throughput() if not v.baseline][:CURVES_SHOWN]
    if d.baseline is not None and d.baseline.curve:
        shown.append(d.baseline)
    return shown


def _curves(ax: Axes, d: Decision) -> None:
    colors = ["tab:orange", "tab:green", "tab:purple", "tab:brown"]
    shapes = {PASSED: "o", OVER: "x", BEHIND: "^", WITHDRAWN: "s"}
    kinds, chosen_any = set(), False
    for v, color in zip(curve_trials(d), colors):
        placed = sorted(((r, p, y) for p in v.curve if (r := chart_rate_rps(p)) is not None
                         and math.isfinite(y := _latency_ms(d, p))),  # every probe, failed ones too
                        key=lambda rpy: rpy[0])  # by rate alone: two probes at one rate do not compare their dicts
        label = f"#{v.number}" + (" vLLM defaults" if v.baseline else "") + (" (recommended)" if v is d.best else "")
        color = "black" if v.baseline else color
        ax.plot([r for r, _, _ in placed], [y for _, _, y in placed], color=color, alpha=0.6,
                linestyle=":" if v.baseline else "-", label=label)
        for r, p, y in placed:
            kind = outcome(p, d.limits).kind
            kinds.add(kind)
            ax.scatter([r], [y], marker=shapes[kind], color=color, s=36, zorder=3,
                       **({"facecolors": "none", "edgecolors": color} if kind == PASSED else {}))
        chosen = v.ranked.point
        if chosen is not None and (rate := chart_rate_rps(chosen)) is not None \
                and math.isfinite(y := _latency_ms(d, chosen)):
            chosen_any = True
            ax.scatter([rate], [y], s=150, facecolors="none", edgecolors=color, linewidths=2, zorder=4)
    ax.axhline(d.limits.first.value_ms, **SLO_STYLE, label=_slo_label(d))
    handles, _ = ax.get_legend_handles_labels()
    over = "failed: over a limit" if len(d.limits) > 1 else "failed: over the limit"
    words = {PASSED: "probe passed", OVER: over, BEHIND: "failed: fell behind", WITHDRAWN: "failed: withdrawn"}
    handles += [Line2D([], [], marker=shapes[k], linestyle="none", color="0.3", markerfacecolor="none",
                       label=words[k]) for k in KINDS if k in kinds]
    if chosen_any:
        handles.append(Line2D([], [], marker="o", linestyle="none", markersize=10, markerfacecolor="none",
                              markeredgecolor="0.3", markeredgewidth=2, label="chosen rate"))
    ax.set_yscale("log")
    ax.margins(y=0.08)
    ax.set_xlabel("offered request rate (requests/s, Poisson; a burst at its completion rate)")
    ax.set_ylabel(f"{d.limits.first.name} (ms, log scale)")
    ax.set_title(f"Latency vs load: every probe of the best {CURVES_SHOWN} and vLLM defaults")
    ax.yaxis.set_major_formatter(_PLAIN)
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.grid(alpha=0.3, which="both")
    _legend_below(ax, handles)


def _importances(ax: Axes, d: Decision) -> None:
    ax.set_title("Parameter importance for output throughput")
    if not d.importances:
        ax.text(0.5, 0.5, textwrap.fill(d.importance_note, 60), ha="center", va="center", fontsize=10,
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    items = sorted(d.importances.items(), key=lambda kv: kv[1])
    ax.barh([k for k, _ in items], [v for _, v in items], color="tab:blue")
    n = len(importance_trials(d.views))
    caveat = importance_caveat(n)
    ax.set_title(f"Parameter importance for output throughput, from {n} trials"
                 + (f"\n{textwrap.fill(caveat, 80)}" if caveat else ""), fontsize=10 if caveat else None)
    ax.set_xlabel(f"importance (normalized to sum to 1; {d.importance_note.split(' over ')[0]})")
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3, axis="x")


def figure(d: Decision) -> Figure:
    """The four-panel report figure, untitled (the page prints the title above it)."""
    fig = Figure(figsize=(15, 10.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    _pareto(axes[0][0], d)
    _history(axes[0][1], d)
    _curves(axes[1][0], d)
    _importances(axes[1][1], d)
    return fig


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    """`fig` as PNG bytes at `dpi`."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def render_png(d: Decision, dpi: int = 110) -> bytes:
    """The four-panel report figure as PNG bytes, titled."""
    fig = figure(d)
    fig.suptitle(title(d), fontsize=13)
    return png_bytes(fig, dpi)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_report(d: Decision, out_dir: Path, info: RunInfo | None = None) -> tuple[Path, Path]:
    """Write `<study>.report.png` (titled) and `<study>.report.html` (the page prints the title once, above the same
    figure; `info`: the run's metadata it opens with) into `out_dir`; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png, page_png = titled_and_untitled(figure(d), title(d))
    png_path, html_path = out_dir / f"{d.study_name}.report.png", out_dir / f"{d.study_name}.report.html"
    _write_atomic(png_path, png)
    _write_atomic(html_path, render_html(d, page_png, info).encode())
    return png_path, html_path


def titled_and_untitled(fig: Figure, text: str, dpi: int = 110) -> tuple[bytes, bytes]:
    """`fig` drawn once with `text` as its title: the PNG, and the same pixels below the title (for the page, which
    prints the title above it). Drawing is what costs; the two encodings (Pillow, matplotlib's own dependency) are
    cheap."""
    from PIL import Image

    fig.set_dpi(dpi)
    heading = fig.suptitle(text, fontsize=13)
    fig.canvas.draw()
    width, height = fig.canvas.get_width_height()
    image = Image.frombuffer("RGBA", (width, height), fig.canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    below = height - math.floor(heading.get_window_extent().y0)  # display y counts from the bottom
    return _png(image), _png(image.crop((0, below, width, height)))


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
