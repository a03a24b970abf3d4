"""Time is passed in: the replay reads a clock object, so tests can script it."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    async def sleep_until(self, t: float) -> None:
        """Return at `t` on this clock (immediately if it has passed)."""
        ...


class MonotonicClock:
    """The real clock: `time.perf_counter`. A wait ends on the event loop's timer, never early, and up to a few ms late
    (send error P99 2.0-2.2 ms on a 2-core EPYC, `benchmarks/send_precision.py`); TTFT is timed from the actual send,
    so a late send only jitters the arrivals.

    `spin_s` > 0 spins (yielding to the loop) for the last part of each wait: 2 ms made the send error's P99 0.1-0.2
    ms, but the spin burns the core the client shares with vLLM's engine core and API server (on the CPU build, the
    CPU the workers leave: optimizer/engines/cpu_layout.py). As served, at 30 req/s, our client then read TTFT P99
    612-933 ms where vLLM's own client read 84-113; without it 120-379 (docs/http.md). In process, whole trials
    measured alike with and without it (docs/http.md).
    """

    spin_s = 0.0

    def now(self) -> float:
        return time.perf_counter()

    async def sleep_until(self, t: float) -> None:
        delay = t - time.perf_counter() - self.spin_s
        if delay > 0:
            await asyncio.sleep(delay)
        while time.perf_counter() < t:
            await asyncio.sleep(0)
