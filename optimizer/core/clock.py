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
    """The real clock: `time.perf_counter`, with a short spin at the end of each wait for send precision."""

    spin_s = 0.002

    def now(self) -> float:
        return time.perf_counter()

    async def sleep_until(self, t: float) -> None:
        delay = t - time.perf_counter() - self.spin_s
        if delay > 0:
            await asyncio.sleep(delay)
        while time.perf_counter() < t:
            await asyncio.sleep(0)
