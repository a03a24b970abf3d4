"""Pure: in words and in rates, why a trial or a run met the limit at no rate (the console's line, the report's,
the HTML's): the rate it missed at, its TTFT P99 there, and why it went no lower."""

from __future__ import annotations

import math

from optimizer.core.units import format_ms
from optimizer.search.measured import TrialMeasurement


def rate_text(rate_rps: float | None) -> str:
    """12.5 -> '12.50 req/s'; None or inf (all requests at once) -> 'a burst'."""
    return "a burst" if rate_rps is None or not math.isfinite(rate_rps) else f"{rate_rps:.2f} req/s"


def answered_text(m: TrialMeasurement) -> str:
    """' of the 21 answered' where the probe at that rate stopped with requests still waiting for a first token, or
    some failed (their TTFT is not known: the P99 is of the answered ones); '' otherwise."""
    answered, sent = m.answered_at_rate, m.requests_at_rate
    return f" of the {answered} answered" if answered is not None and sent and answered < sent else ""


def count_text(m: TrialMeasurement) -> str:
    """', 5 of 26 requests over the limit': the count at that rate ('' for a trial stored
    without it), and ', falling behind' where the probe failed on its queue growing, not (only) on its count."""
    over, sent = m.over_limit_at_rate, m.requests_at_rate
    count = f", {over} of {sent} requests over the limit" if over is not None and sent else ""
    return count + (", falling behind" if m.behind_at_rate else "")


def why_infeasible(m: TrialMeasurement) -> str:
    """In words and in rates, what stopped a trial that met the limit at no rate: the rate it missed at, with its TTFT
    P99 there, and why it went no lower."""
    evidence = f" ({m.requests} requests)" if m.requests else ""
    closest = (f"{m.bound_text}{answered_text(m)}{count_text(m)}" if m.bound_text else
               f"TTFT P99 {format_ms(m.ttft_p99_ms)}{answered_text(m)} at {rate_text(m.rate_rps)}{count_text(m)}")
    floor = m.floor_rps
    if m.stopped_early and floor:
        return (f"over the limit down to {floor:.2f} req/s, 0.9 x the best's lower bound ({closest}): it cannot beat "
                f"the best, stopped early{evidence}")
    if m.stopped_early:
        return f"over the limit below the best's rate ({closest}): it cannot beat the best, stopped early{evidence}"
    if m.flat:
        return (f"over the limit at every rate tried, and the latency did not fall as the rate fell ({closest}, the "
                f"closest): not a queue that a lower rate drains, stopped{evidence}")
    return f"over the limit at every rate tried ({closest}, the closest){evidence}"
