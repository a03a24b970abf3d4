"""Pure: in words and in rates, why a trial or a run met the limit at no rate (the console's line, the report's,
the HTML's): the rate it missed at, its TTFT P99 there, and why it went no lower."""

from __future__ import annotations

import math

from optimizer.core.units import format_ms


def rate_text(rate_rps: float | None) -> str:
    """12.5 -> '12.50 req/s'; None or inf (all requests at once) -> 'a burst'."""
    return "a burst" if rate_rps is None or not math.isfinite(rate_rps) else f"{rate_rps:.2f} req/s"


def answered_text(result: dict) -> str:
    """' of the 21 answered' where the probe at that rate stopped with requests still waiting for a first token, or
    some failed (their TTFT is not known: the P99 is of the answered ones); '' otherwise."""
    answered, sent = result.get("answered_at_rate"), result.get("requests_at_rate")
    return f" of the {answered} answered" if answered is not None and sent and answered < sent else ""


def count_text(result: dict) -> str:
    """', 5 of 26 requests over the limit': the count at that rate ('' for a trial stored
    without it), and ', falling behind' where the probe failed on its queue growing, not (only) on its count."""
    over, sent = result.get("over_limit_at_rate"), result.get("requests_at_rate")
    count = f", {over} of {sent} requests over the limit" if over is not None and sent else ""
    return count + (", falling behind" if result.get("behind_at_rate") else "")


def why_infeasible(result: dict) -> str:
    """In words and in rates, what stopped a trial that met the limit at no rate: the rate it missed at, with its TTFT
    P99 there, and why it went no lower."""
    tried = result.get("requests")
    evidence = f" ({tried} requests)" if tried else ""
    bound = (result.get("bound_by") or {}).get("text")
    closest = (f"{bound}{answered_text(result)}{count_text(result)}" if bound else
               f"TTFT P99 {format_ms(result.get('ttft_p99_ms', math.nan))}{answered_text(result)} at "
               f"{rate_text(result.get('rate_rps'))}{count_text(result)}")
    floor = result.get("floor_rps")
    if result.get("stopped_early") and floor:
        return (f"over the limit down to {floor:.2f} req/s, 0.9 x the best's lower bound ({closest}): it cannot beat "
                f"the best, stopped early{evidence}")
    if result.get("stopped_early"):
        return f"over the limit below the best's rate ({closest}): it cannot beat the best, stopped early{evidence}"
    if result.get("flat"):
        return (f"over the limit at every rate tried, and the latency did not fall as the rate fell ({closest}, the "
                f"closest): not a queue that a lower rate drains, stopped{evidence}")
    return f"over the limit at every rate tried ({closest}, the closest){evidence}"
