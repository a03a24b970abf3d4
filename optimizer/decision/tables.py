"""The one table renderer: rows of scalars as aligned text, JSON, CSV or HTML (`--format`)."""

from __future__ import annotations

import csv
import html
import io
import json
import math
from typing import Any

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
    return None if isinstance(value, float) and not math.isfinite(value) else value


def format_output(rows: list[dict[str, Any]], fmt: str) -> str:
    """Rows of scalars as `table` (aligned text), `json`, `csv`, or `html` (a <table>): the one formatter."""
    if fmt != "html":
        check_format(fmt)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    if fmt == "json":
        return json.dumps([{k: _json_safe(row.get(k)) for k in columns} for row in rows], indent=2)
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
