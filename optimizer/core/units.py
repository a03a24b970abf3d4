"""Parse human durations and sizes once, at the edge. Inside, plain floats with units in their names."""

from __future__ import annotations

import re

from optimizer.core.errors import UsageError

_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Zµ]+)\s*$")
_TO_MS = {"us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1000.0, "sec": 1000.0, "m": 60_000.0, "min": 60_000.0,
          "h": 3_600_000.0}


def parse_duration_ms(text: str | float | int, what: str = "duration") -> float:
    """Parse "150ms", "0.2s", "2min" into milliseconds. A bare number is refused: the unit is the point."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        raise UsageError(f"{what} {text!r} has no unit: write it as e.g. '{text}ms' or '{text}s'")
    raw = str(text)
    match = _DURATION_RE.match(raw)
    if raw.strip().startswith("-"):
        raise UsageError(f"{what} {raw!r} is negative: give a positive duration such as '150ms'")
    if not match:
        if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", raw):
            raise UsageError(f"{what} {raw!r} has no unit: write it as e.g. '{raw.strip()}ms' or '{raw.strip()}s'")
        raise UsageError(f"{what} {raw!r} is not a duration: write a number with a unit, such as '150ms' or '0.5s'")
    value, unit = float(match.group(1)), match.group(2)
    factor = _TO_MS.get(unit) or _TO_MS.get(unit.lower())
    if factor is None:
        raise UsageError(
            f"{what} {raw!r} has an unknown unit {unit!r}: use one of ms, s, min, h (for example '150ms')"
        )
    ms = value * factor
    if ms <= 0:
        raise UsageError(f"{what} {raw!r} must be greater than zero, such as '150ms'")
    return ms


def format_ms(ms: float) -> str:
    """Short human form of a duration in milliseconds."""
    if ms >= 10_000:
        return f"{ms / 1000:.1f}s"
    if ms >= 1000:
        return f"{ms / 1000:.2f}s"
    return f"{ms:.0f}ms" if ms >= 10 else f"{ms:.1f}ms"
