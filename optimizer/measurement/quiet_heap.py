"""The measuring process's own pauses, kept out of what it measures.

A replay stamps every first token in this process: in process, vLLM's output handler runs on this event loop; over
HTTP, this process reads the stream. A full garbage collection walks every object the process holds, and with vLLM,
torch and Optuna imported that is ~640k objects: 150-350 ms on a 2-core EPYC (`benchmarks/gc_pauses.py`). No chunk
is read meanwhile, so every request waiting for its first token is stamped late by up to that much, together: a
run of requests over a 150 ms limit that the engine did not cause, which is what decides a P99. vLLM's own server
and engine core freeze their heap after start-up for the same reason (vllm/utils/gc_utils.py `freeze_gc_heap`).

A replay does the same (`frozen_heap`): the objects that exist when it starts leave the collector's generations
for its duration (`gc.freeze`, O(1)) and come back after it (`gc.unfreeze`), so a collection while it runs walks only
what the replay allocated, and the garbage from before it is collected after it, outside the measurement.
`GcPauses` records the collections that ran meanwhile and how long each took, for the benchmark and the tests.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def frozen_heap() -> Iterator[None]:
    """While inside: the objects that existed at entry are out of the garbage collector's generations."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class GcPauses:
    """The garbage collections of this process while it is active (a context manager): (generation, ms) each."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append((int(info.get("generation", -1)), 1000 * (time.perf_counter() - self._started)))
            self._started = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    @property
    def max_ms(self) -> float:
        return max((ms for _, ms in self.pauses), default=0.0)
