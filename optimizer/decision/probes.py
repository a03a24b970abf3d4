"""Each stored probe judged under the report's limit, in words (passed, or what failed it), and a chart of every
config's probes as inline SVG: offered rate against TTFT P99, the limit, one marker per outcome.

A probe fails for one of three reasons, its marker the first that applies: the engine fell behind (its queue grew
while requests arrived: measurement/evidence.py), its requests over the limit (the count a probe sized by evidence
settles its verdict on; the P99 at another limit or for a replay of a fixed length), or requests withdrawn or
failed (withdrawn: still waiting for their first token, past the limit, when the probe stopped; they count as
over). A burst is drawn at the rate it completed at.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optimizer.core.units import format_ms
from optimizer.measurement.rerank import qualifies

PASSED, OVER, BEHIND, WITHDRAWN = "passed", "over the limit", "fell behind", "withdrawn"
KINDS = (PASSED, OVER, BEHIND, WITHDRAWN)


@dataclass(frozen=True)
class Outcome:
    """A probe under one limit: its kind (the marker: PASSED, or the first reason it failed) and all of it in words."""

    kind: str
    words: str


def outcome(point: Mapping[str, Any], limit_ms: float, other_limits_ms: Mapping[str, float] | None = None) -> Outcome:
    """Pure: did the probe meet the limit (the report's rule, measurement/rerank.py::qualifies), and if not, why."""
    n, over = point.get("requests"), point.get("over_limit")
    judged_here = point.get("limit_ms") == limit_ms and n is not None and over is not None
    p99 = f"TTFT P99 {ms_beside(point.get('ttft_p99_ms', math.nan), limit_ms)}"
    if qualifies(point, limit_ms, other_limits_ms):
        return Outcome(PASSED, f"passed: {over} of {n} over the limit, {p99}" if judged_here else f"passed: {p99}")
    reasons: list[tuple[str, str]] = []
    completed, failed = point.get("completed") or 0, point.get("failed") or 0
    if completed == 0:
        reasons.append((BEHIND, "no request completed"))
    elif not point.get("sustained", True):
        reasons.append((BEHIND, "fell behind: its queue grew while requests arrived"))
    if judged_here and over:
        unsettled = " (more than 1%, unsettled)" if point.get("verdict") == "unsettled" else ""
        reasons.append((OVER, f"{over} of {n} over the limit{unsettled}, {p99}"))
    elif not judged_here and not math.isnan(point.get("ttft_p99_ms", math.nan)) and point["ttft_p99_ms"] > limit_ms:
        reasons.append((OVER, f"{p99} over {format_ms(limit_ms)}"))
    for key, lim in (other_limits_ms or {}).items():
        value = point.get(key)
        if value is None or math.isnan(value) or value > lim:
            name = key[:-3].replace("_", " ").upper()
            reasons.append((OVER, f"{name} {ms_beside(value or math.nan, lim)} over {format_ms(lim)}"))
    if failed:  # withdrawn past the limit (they count as over), or failed: the marker where nothing else failed it
        reasons.append((WITHDRAWN, f"{failed} withdrawn or failed before their first token"))
    if not reasons:
        reasons.append((OVER, f"missed the limit, {p99}"))
    return Outcome(reasons[0][0], "failed: " + "; ".join(words for _, words in reasons))


def ms_beside(value_ms: float, limit_ms: float) -> str:
    """`value_ms` as format_ms writes it, with a decimal more where it would read as the limit itself (30.4 ms
    beside a 30 ms limit is not '30ms')."""
    text = format_ms(value_ms)
    return text if text != format_ms(limit_ms) or value_ms == limit_ms else f"{value_ms:.1f}ms"


def chart_rate_rps(point: Mapping[str, Any]) -> float | None:
    """Where a probe sits on the rate axis: its offered rate; a burst (no rate) at the rate it completed at."""
    rate = point.get("offered_rate_rps")
    return point.get("request_throughput_rps") if rate is None else rate


def rate_text(point: Mapping[str, Any]) -> str:
    """'12.50 req/s', or 'a burst (31.20 req/s completed)'."""
    rate = point.get("offered_rate_rps")
    return f"a burst ({point.get('request_throughput_rps') or 0:.2f} req/s completed)" if rate is None \
        else f"{rate:.2f} req/s"


# --- the chart -------------------------------------------------------------------------------------------------

COLORS = {PASSED: "#2ca02c", OVER: "#d62728", BEHIND: "#ff7f0e", WITHDRAWN: "#9467bd"}
_W, _H = 240, 150  # one panel, in SVG units (scaled to its grid cell)
_LEFT, _RIGHT, _TOP, _BOTTOM = 34, 8, 22, 18


@dataclass(frozen=True)
class Panel:
    """One config's probes: its title, its points in the order they ran, the chosen one, and a highlight."""

    title: str
    points: Sequence[Mapping[str, Any]]
    chosen: Mapping[str, Any] | None = None
    highlight: bool = False


@dataclass(frozen=True)
class Axes:
    """The axes every panel shares, so that panels compare at a glance: rate linear from just below the lowest
    probe's, TTFT P99 log."""

    rate_low_rps: float
    rate_max_rps: float
    ttft_low_ms: float
    ttft_high_ms: float

    @classmethod
    def of(cls, panels: Sequence[Panel], limit_ms: float) -> Axes:
        """Axes that hold every probe of `panels` and the limit, with a margin."""
        rates = [r for p in panels for q in p.points if (r := chart_rate_rps(q)) is not None and math.isfinite(r)]
        ttfts = [t for p in panels for q in p.points if _finite_positive(t := q.get("ttft_p99_ms"))]
        low, high = min([*ttfts, limit_ms]), max([*ttfts, limit_ms])
        top = max(rates, default=1.0)
        return cls(min(rates, default=0.0) * 0.9, top + 0.05 * (top - min(rates, default=0.0) * 0.9), low / 1.3,
                   high * 1.3)

    def x(self, rate_rps: float) -> float:
        """The SVG x of a rate (clipped to the plot)."""
        span = max(self.rate_max_rps - self.rate_low_rps, 1e-9)
        return _LEFT + (_W - _LEFT - _RIGHT) * min(max(rate_rps - self.rate_low_rps, 0.0) / span, 1.0)

    def y(self, ttft_ms: float) -> float:
        """The SVG y of a TTFT P99 (log scale, clipped to the plot)."""
        span = math.log(self.ttft_high_ms / self.ttft_low_ms)
        frac = math.log(min(max(ttft_ms, self.ttft_low_ms), self.ttft_high_ms) / self.ttft_low_ms) / span
        return _H - _BOTTOM - (_H - _TOP - _BOTTOM) * frac


def _is_chosen(point: Mapping[str, Any], chosen: Mapping[str, Any] | None) -> bool:
    # every replay at the chosen rate (repeats are merged into one chosen point)
    return chosen is not None and point.get("offered_rate_rps") == chosen.get("offered_rate_rps")


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def marker(kind: str, x: float, y: float, size: float = 3.6) -> str:
    """The SVG shape of one outcome at (x, y): a dot passed, a cross over the limit, a triangle fell behind, a square
    withdrawn."""
    c = COLORS[kind]
    if kind == PASSED:
        return f"<circle cx='{x:.1f}' cy='{y:.1f}' r='{size:.1f}' fill='{c}'/>"
    if kind == OVER:
        s = size
        return (f"<path d='M{x - s:.1f},{y - s:.1f}L{x + s:.1f},{y + s:.1f}M{x - s:.1f},{y + s:.1f}L{x + s:.1f},"
                f"{y - s:.1f}' stroke='{c}' stroke-width='1.8'/>")
    if kind == BEHIND:
        s = size * 1.2
        return (f"<path d='M{x:.1f},{y - s:.1f}L{x + s:.1f},{y + s * 0.8:.1f}L{x - s:.1f},{y + s * 0.8:.1f}Z' "
                f"fill='{c}'/>")
    s = size * 0.9
    return f"<rect x='{x - s:.1f}' y='{y - s:.1f}' width='{2 * s:.1f}' height='{2 * s:.1f}' fill='{c}'/>"


def _ticks(axes: Axes, limit_ms: float) -> str:
    e, bottom = html.escape, _H - _BOTTOM
    out = [f"<line x1='{_LEFT}' y1='{bottom}' x2='{_W - _RIGHT}' y2='{bottom}' stroke='#999'/>",
           f"<line x1='{_LEFT}' y1='{_TOP}' x2='{_LEFT}' y2='{bottom}' stroke='#999'/>"]
    for frac, anchor in ((0.0, "middle"), (0.5, "middle"), (1.0, "end")):  # the last one inside the panel
        rate = axes.rate_low_rps + (axes.rate_max_rps - axes.rate_low_rps) * frac
        out.append(f"<text x='{axes.x(rate):.1f}' y='{_H - 5}' font-size='9' text-anchor='{anchor}'>{rate:.3g}</text>")
    y = axes.y(limit_ms)
    out.append(f"<line x1='{_LEFT}' y1='{y:.1f}' x2='{_W - _RIGHT}' y2='{y:.1f}' stroke='#d62728' "
               f"stroke-dasharray='4 3'/>")
    out.append(f"<text x='{_LEFT - 3}' y='{y + 3:.1f}' font-size='9' text-anchor='end' fill='#d62728'>"
               f"{e(format_ms(limit_ms))}</text>")
    for ttft in (axes.ttft_low_ms * 1.3, axes.ttft_high_ms / 1.3):
        if abs(axes.y(ttft) - y) > 10:
            out.append(f"<text x='{_LEFT - 3}' y='{axes.y(ttft) + 3:.1f}' font-size='9' text-anchor='end'>"
                       f"{e(format_ms(ttft))}</text>")
    return "".join(out)


def panel_svg(panel: Panel, axes: Axes, limit_ms: float, other_limits_ms: Mapping[str, float] | None = None) -> str:
    """One config's probes as an SVG: each probe a marker with its outcome on hover, joined in rate order."""
    e = html.escape
    placed = [(r, p) for p in panel.points if (r := chart_rate_rps(p)) is not None
              and _finite_positive(p.get("ttft_p99_ms"))]
    line = " ".join(f"{axes.x(r):.1f},{axes.y(p['ttft_p99_ms']):.1f}" for r, p in sorted(placed, key=lambda rp: rp[0]))
    body = [f"<polyline points='{line}' fill='none' stroke='#bbb'/>"] if len(placed) > 1 else []
    for r, p in placed:
        found = outcome(p, limit_ms, other_limits_ms)
        x, y = axes.x(r), axes.y(p["ttft_p99_ms"])
        ring = (f"<circle cx='{x:.1f}' cy='{y:.1f}' r='7' fill='none' stroke='#000' stroke-width='1.3'/>"
                if _is_chosen(p, panel.chosen) else "")
        body.append(f"<g class='probe {found.kind.replace(' ', '-')}'><title>{e(rate_text(p))}: {e(found.words)}"
                    f"</title>{ring}{marker(found.kind, x, y)}</g>")
    return (f"<svg viewBox='0 0 {_W} {_H}' role='img' aria-label='{e(panel.title)}'>"
            f"<text x='6' y='14' font-size='11' font-weight='bold'>{e(panel.title)}</text>"
            f"{_ticks(axes, limit_ms)}{''.join(body)}</svg>")


def legend_html() -> str:
    """The markers in words, for the line above the panels."""
    items = [(PASSED, "passed"), (OVER, "over the limit (the count, or the P99)"),
             (BEHIND, "fell behind (queue grew)"), (WITHDRAWN, "requests withdrawn or failed")]
    return " ".join(f"<span class='key'><svg viewBox='0 0 12 12' width='12' height='12'>{marker(k, 6, 6)}</svg> "
                    f"{html.escape(words)}</span>" for k, words in items)


def chart_html(panels: Sequence[Panel], limit_ms: float, other_limits_ms: Mapping[str, float] | None = None) -> str:
    """Every panel on shared axes, in a grid that wraps to the window's width."""
    axes = Axes.of(panels, limit_ms)
    cells = "".join(f"<figure{' class=best' if p.highlight else ''}>{panel_svg(p, axes, limit_ms, other_limits_ms)}"
                    f"</figure>" for p in panels)
    return f"<div class='probes'>{cells}</div>"

