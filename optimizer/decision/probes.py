"""Each stored probe judged under the report's limits, in words (passed, or what failed it), and a chart of every
config's probes as inline SVG: offered rate against the first limit's statistic (TTFT P99 for most studies), that
limit, one marker per outcome.

A probe fails for one of three reasons, its marker the first that applies: the engine fell behind (its queue grew
while requests arrived: measurement/evidence.py), its requests over a limit (the counts a probe sized by evidence
settles its verdict on, one per limit; the statistic at other limits or for a replay of a fixed length), or requests
withdrawn or failed (withdrawn: still waiting for their first token, past the limit, when the probe stopped; they
count as over). A burst is drawn at the rate it completed at.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optimizer.config.limits import Limit, Limits
from optimizer.core.units import format_ms
from optimizer.measurement.rerank import as_limits, judged_at, point_value_ms, qualifies

PASSED, OVER, BEHIND, WITHDRAWN = "passed", "over the limit", "fell behind", "withdrawn"
KINDS = (PASSED, OVER, BEHIND, WITHDRAWN)


@dataclass(frozen=True)
class Outcome:
    """A probe under a set of limits: its kind (the marker: PASSED, or the first reason it failed) and all of it in
    words."""

    kind: str
    words: str


@dataclass(frozen=True)
class _Count:
    """One limit's part of a probe's verdict: how many of its requests were over, and whether it missed."""

    limit: Limit | None  # None: goodput's one joint criterion
    requests: int
    over: int
    verdict: str | None
    missed: bool


def _counts(point: Mapping[str, Any], limits: Limits) -> list[_Count]:
    """The verdict's counts, one per limit, in the limits' order (a probe without per-limit parts: its one count,
    the first limit's)."""
    parts = point.get("limits")
    if not parts:
        over, verdict = point.get("over_limit") or 0, point.get("verdict")
        return [_Count(limits.first, int(point.get("requests") or 0), int(over), verdict, bool(over))]
    out = []
    for part in parts:
        verdict = part.get("verdict")
        missed = verdict == "fail" or (verdict == "unsettled" and not part.get("within", False))
        out.append(_Count(next((lim for lim in limits if lim.key == part.get("key")), None),
                          int(part.get("requests") or 0), int(part.get("over_limit") or 0), verdict, missed))
    return out


def _count_text(c: _Count, limits: Limits) -> str:
    """'12 of 800 over TPOT P99 50ms' ('over the limit' where the study has one); a mean limit: 'TPOT mean over
    50ms' (its value, not a count, decides it)."""
    if c.limit is None:
        return f"{c.over} of {c.requests} outside {limits.text}"
    if c.limit.percentile is None:  # a mean: its value, not a count, decides it
        return f"{c.limit.name} {'over' if c.missed else 'within'} {format_ms(c.limit.value_ms)}"
    where = "the limit" if len(limits) == 1 else f"{c.limit.name} {format_ms(c.limit.value_ms)}"
    unsettled = (f" (more than {c.limit.share * 100:g}%, unsettled)" if c.missed and c.verdict == "unsettled"
                 else "")
    return f"{c.over} of {c.requests} over {where}{unsettled}"


def _value_text(value_ms: float, limit: Limit) -> str:
    return ms_beside(value_ms, limit.value_ms) if math.isfinite(value_ms) else "not measured"


def values_words(point: Mapping[str, Any], limits: Limits) -> str:
    """'TTFT P99 80ms, TPOT P99 61ms': each limit's statistic at the probe, a decimal more beside its limit."""
    return ", ".join(f"{lim.name} {_value_text(point_value_ms(point, lim, limits), lim)}" for lim in limits)


def outcome(point: Mapping[str, Any], limits: Limits | float) -> Outcome:
    """Pure: did the probe meet the limits (the report's rule, measurement/rerank.py::qualifies), and if not, why:
    each limit it missed, by its count where the probe was judged at these limits ('12 of 800 over TPOT P99 50ms'),
    else by its value ('TPOT P99 61ms over 50ms'). A float is a TTFT P99 limit."""
    limits = as_limits(limits)
    judged_here = judged_at(point, limits) and point.get("requests") is not None \
        and point.get("over_limit") is not None
    counts = _counts(point, limits) if judged_here else []
    values = values_words(point, limits)
    if qualifies(point, limits):
        if not judged_here:
            return Outcome(PASSED, f"passed: {values}")
        return Outcome(PASSED, f"passed: {', '.join(_count_text(c, limits) for c in counts)}; {values}"
                       if len(counts) > 1 else f"passed: {_count_text(counts[0], limits)}, {values}")
    reasons: list[tuple[str, str]] = []
    completed, failed = point.get("completed") or 0, point.get("failed") or 0
    if completed == 0:
        reasons.append((BEHIND, "no request completed"))
    elif not point.get("sustained", True):
        reasons.append((BEHIND, "fell behind: its queue grew while requests arrived"))
    if judged_here:
        missed = [c for c in counts if c.missed]
        if len(limits) == 1 and missed:
            reasons.append((OVER, f"{_count_text(missed[0], limits)}, {values}"))
        for c in missed if len(limits) > 1 else ():
            value = "" if c.limit is None else \
                f", measured {_value_text(point_value_ms(point, c.limit, limits), c.limit)}"
            reasons.append((OVER, f"{_count_text(c, limits)}{value}"))
    else:
        for lim in limits:
            value = point_value_ms(point, lim, limits)
            if not math.isfinite(value) or value > lim.value_ms:
                reasons.append((OVER, f"{lim.name} {_value_text(value, lim)} over {format_ms(lim.value_ms)}"))
    if failed:  # withdrawn past the limit (they count as over), or failed: the marker where nothing else failed it
        reasons.append((WITHDRAWN, f"{failed} withdrawn or failed before their first token"))
    if not reasons:
        reasons.append((OVER, f"missed the limit{'s' if len(limits) > 1 else ''}, {values}"))
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
    probe's, the first limit's statistic (the latency axis) log."""

    rate_low_rps: float
    rate_max_rps: float
    latency_low_ms: float
    latency_high_ms: float

    @classmethod
    def of(cls, panels: Sequence[Panel], limits: Limits | float) -> Axes:
        """Axes that hold every probe of `panels` and the first limit, with a margin."""
        limits = as_limits(limits)
        first = limits.first
        rates = [r for p in panels for q in p.points if (r := chart_rate_rps(q)) is not None and math.isfinite(r)]
        values = [t for p in panels for q in p.points if _finite_positive(t := point_value_ms(q, first, limits))]
        low, high = min([*values, first.value_ms]), max([*values, first.value_ms])
        top = max(rates, default=1.0)
        return cls(min(rates, default=0.0) * 0.9, top + 0.05 * (top - min(rates, default=0.0) * 0.9), low / 1.3,
                   high * 1.3)

    def x(self, rate_rps: float) -> float:
        """The SVG x of a rate (clipped to the plot)."""
        span = max(self.rate_max_rps - self.rate_low_rps, 1e-9)
        return _LEFT + (_W - _LEFT - _RIGHT) * min(max(rate_rps - self.rate_low_rps, 0.0) / span, 1.0)

    def y(self, latency_ms: float) -> float:
        """The SVG y of a latency (log scale, clipped to the plot)."""
        span = math.log(self.latency_high_ms / self.latency_low_ms)
        frac = math.log(min(max(latency_ms, self.latency_low_ms), self.latency_high_ms) / self.latency_low_ms) / span
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


def _ticks(axes: Axes, limit: Limit) -> str:
    e, bottom = html.escape, _H - _BOTTOM
    out = [f"<line x1='{_LEFT}' y1='{bottom}' x2='{_W - _RIGHT}' y2='{bottom}' stroke='#999'/>",
           f"<line x1='{_LEFT}' y1='{_TOP}' x2='{_LEFT}' y2='{bottom}' stroke='#999'/>"]
    for frac, anchor in ((0.0, "middle"), (0.5, "middle"), (1.0, "end")):  # the last one inside the panel
        rate = axes.rate_low_rps + (axes.rate_max_rps - axes.rate_low_rps) * frac
        out.append(f"<text x='{axes.x(rate):.1f}' y='{_H - 5}' font-size='9' text-anchor='{anchor}'>{rate:.3g}</text>")
    y = axes.y(limit.value_ms)
    out.append(f"<line x1='{_LEFT}' y1='{y:.1f}' x2='{_W - _RIGHT}' y2='{y:.1f}' stroke='#d62728' "
               f"stroke-dasharray='4 3'/>")
    out.append(f"<text x='{_LEFT - 3}' y='{y + 3:.1f}' font-size='9' text-anchor='end' fill='#d62728'>"
               f"<title>{e(limit.text)}</title>{e(format_ms(limit.value_ms))}</text>")
    for value in (axes.latency_low_ms * 1.3, axes.latency_high_ms / 1.3):
        if abs(axes.y(value) - y) > 10:
            out.append(f"<text x='{_LEFT - 3}' y='{axes.y(value) + 3:.1f}' font-size='9' text-anchor='end'>"
                       f"{e(format_ms(value))}</text>")
    return "".join(out)


def panel_svg(panel: Panel, axes: Axes, limits: Limits | float) -> str:
    """One config's probes as an SVG: each probe a marker with its outcome under `limits` on hover, at the first
    limit's statistic, joined in rate order."""
    e = html.escape
    limits = as_limits(limits)
    placed = [(r, p, v) for p in panel.points if (r := chart_rate_rps(p)) is not None
              and _finite_positive(v := point_value_ms(p, limits.first, limits))]
    line = " ".join(f"{axes.x(r):.1f},{axes.y(v):.1f}" for r, _, v in sorted(placed, key=lambda rpv: rpv[0]))
    body = [f"<polyline points='{line}' fill='none' stroke='#bbb'/>"] if len(placed) > 1 else []
    for r, p, v in placed:
        found = outcome(p, limits)
        x, y = axes.x(r), axes.y(v)
        ring = (f"<circle cx='{x:.1f}' cy='{y:.1f}' r='7' fill='none' stroke='#000' stroke-width='1.3'/>"
                if _is_chosen(p, panel.chosen) else "")
        body.append(f"<g class='probe {found.kind.replace(' ', '-')}'><title>{e(rate_text(p))}: {e(found.words)}"
                    f"</title>{ring}{marker(found.kind, x, y)}</g>")
    return (f"<svg viewBox='0 0 {_W} {_H}' role='img' aria-label='{e(panel.title)}'>"
            f"<text x='6' y='14' font-size='11' font-weight='bold'>{e(panel.title)}</text>"
            f"{_ticks(axes, limits.first)}{''.join(body)}</svg>")


def legend_html() -> str:
    """The markers in words, for the line above the panels."""
    items = [(PASSED, "passed"), (OVER, "over a limit (its count, or its statistic)"),
             (BEHIND, "fell behind (queue grew)"), (WITHDRAWN, "requests withdrawn or failed")]
    return " ".join(f"<span class='key'><svg viewBox='0 0 12 12' width='12' height='12'>{marker(k, 6, 6)}</svg> "
                    f"{html.escape(words)}</span>" for k, words in items)


def chart_html(panels: Sequence[Panel], limits: Limits | float) -> str:
    """Every panel on shared axes (the first limit's statistic against the rate), in a grid that wraps to the
    window's width; each probe judged under every limit."""
    limits = as_limits(limits)
    axes = Axes.of(panels, limits)
    cells = "".join(f"<figure{' class=best' if p.highlight else ''}>{panel_svg(p, axes, limits)}"
                    f"</figure>" for p in panels)
    return f"<div class='probes'>{cells}</div>"
