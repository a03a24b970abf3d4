"""The one table renderer: rows of scalars as aligned text, JSON, CSV or HTML (`--format`)."""

from __future__ import annotations

import csv
import html
import io
import json
import math
from typing import Any

from optimizer.config.limits import Limit, Limits
from optimizer.core.errors import UsageError


FORMATS = ("table", "json", "csv")  # what `--format` offers; "html" is the report page's own


def check_format(fmt: str) -> str:
    """`fmt` when it is one of FORMATS; else the UsageError every `--format` gives."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def json_text(value: Any) -> str:
    """`value` as indented JSON, NaN and infinity as null (JSON has neither): what `--format json` prints."""
    return json.dumps(_json_safe(value), indent=2)


def drop_empty_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` without the columns that hold no value in any row (None or NaN): for a table that must fit a terminal."""
    keep = [k for k in dict.fromkeys(k for row in rows for k in row)
            if any(_json_safe(row.get(k)) is not None for row in rows)]
    return [{k: row.get(k) for k in keep} for row in rows]


def format_output(rows: list[dict[str, Any]], fmt: str) -> str:
    """Rows of scalars as `table` (aligned text), `json`, `csv`, or `html` (a <table>): the one formatter."""
    if fmt != "html":
        check_format(fmt)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    if fmt == "json":
        return json_text([{k: row.get(k) for k in columns} for row in rows])
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


# `report --trial` as a table: what each probe decided and on what (its counts; with several limits, the one its
# verdict rests on), its latency, what the engine did; `--format csv` or `json` carries every column of the curve's
# rows (decision/views.py::curve_rows).
CURVE_TABLE_COLUMNS = ("replay", "arrivals", "offered_rate_rps", "requests", "over_limit", "verdict", "binding",
                       "ttft_p50_ms", "ttft_p99_ms", "output_throughput_tok_s", "meets_limit", "chosen",
                       "engine_running_peak", "engine_queued_p99_ms")


def limit_column(limit: Limit, limits: Limits) -> str:
    """The column of a limit's statistic, its unit in the name: 'tpot_p99_ms', 'e2e_mean_ms'; under goodput, each
    metric's percentile at the goodput share ('tpot_p99_ms' at 99%)."""
    stat = limit.stat if limits.goodput_pct is None else f"p{limits.goodput_pct:g}"
    return f"{limit.metric}_{stat}_ms"


def curve_table(rows: list[dict[str, Any]], limits: Limits | None = None) -> list[dict[str, Any]]:
    """A trial's curve rows cut to CURVE_TABLE_COLUMNS and, with `limits`, each limit's statistic after the TTFT
    P99, for a terminal (~210 characters instead of ~330)."""
    columns = list(CURVE_TABLE_COLUMNS)
    if limits is not None:
        at = columns.index("ttft_p99_ms") + 1
        columns[at:at] = [c for lim in limits if (c := limit_column(lim, limits)) not in columns]
    return [{k: r[k] for k in columns if k in r} for r in rows]
