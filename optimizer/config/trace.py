"""Read a request trace (CSV or JSONL): input length, output length and an optional timestamp per request.

CSV needs a header with `input_len` and `output_len` (and optionally `timestamp`, in seconds); JSONL has one
object per line with the same keys. Any malformed row stops the load with its line number and the fix.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from optimizer.core.errors import UsageError
from optimizer.core.paths import require_file

TraceRow = tuple[int, int, float | None]
_ALIASES = {"input_len": ("input_len", "input_tokens", "prompt_len", "prompt_tokens"),
            "output_len": ("output_len", "output_tokens", "completion_tokens"),
            "timestamp": ("timestamp", "timestamp_s", "arrival_s", "time")}


def _pick(row: dict, key: str):
    for name in _ALIASES[key]:
        if name in row and row[name] not in (None, ""):
            return row[name]
    return None


def _row(raw: dict, where: str) -> TraceRow:
    values = []
    for key in ("input_len", "output_len"):
        v = _pick(raw, key)
        try:
            n = int(float(v)) if v is not None else None
        except (TypeError, ValueError, OverflowError):  # OverflowError: "inf"
            n = None
        if n is None or n < 1 or (v is not None and float(v) != n):
            raise UsageError(f"trace {where}: {key} must be a whole number of tokens >= 1, got {v!r}: fix or drop "
                             f"that row")
        values.append(n)
    ts = _pick(raw, "timestamp")
    if ts is not None:
        try:
            ts = float(ts)
        except (TypeError, ValueError):
            ts = math.nan
        if not math.isfinite(ts) or ts < 0:
            raise UsageError(f"trace {where}: timestamp must be seconds >= 0, got {_pick(raw, 'timestamp')!r}")
    return values[0], values[1], ts


def load_trace(path: str | Path) -> list[TraceRow]:
    """Rows of the trace, in file order; timestamps must be all present or all absent and never decrease."""
    p = require_file(path, "trace")
    rows: list[TraceRow] = []
    text = p.read_text(errors="replace")
    if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"trace {p.name} line {n}: not valid JSON ({exc.msg})") from None
            if not isinstance(raw, dict):
                raise UsageError(f"trace {p.name} line {n}: expected an object with input_len and output_len")
            rows.append(_row(raw, f"{p.name} line {n}"))
    else:
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames or not any(a in reader.fieldnames for a in _ALIASES["input_len"]):
            raise UsageError(f"trace {p.name}: the CSV needs a header with input_len,output_len[,timestamp]")
        for n, raw in enumerate(reader, start=2):
            rows.append(_row(raw, f"{p.name} line {n}"))
    if len(rows) < 2:
        raise UsageError(f"trace {p.name} has {len(rows)} usable rows: a replay needs at least 2")
    stamped = [r[2] is not None for r in rows]
    if any(stamped) and not all(stamped):
        raise UsageError(f"trace {p.name}: timestamps must be given on every row or on none")
    if all(stamped) and any(b[2] < a[2] for a, b in zip(rows, rows[1:])):  # type: ignore[operator]
        raise UsageError(f"trace {p.name}: timestamps must not decrease: sort the rows by time")
    return rows
