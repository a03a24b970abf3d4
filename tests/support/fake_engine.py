"""A small honest fake engine for fast tests of replay, rate search and study logic.

A toy continuous-batching loop in real time: each step admits waiting requests up to `max_num_seqs`, takes
`step_s + per_seq_s * running + prefill_s_per_token * new prompt tokens`, and gives every running request one
token. So larger batches raise throughput and queueing raises TTFT, as in vLLM, in milliseconds.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from optimizer.core import failures
from optimizer.core.errors import EngineStartError
from optimizer.core.processes import ProcessRef
from optimizer.measurement.workload import Request


class _Seq:
    def __init__(self, request: Request) -> None:
        self.request = request
        self.left = request.output_len
        self.out: asyncio.Queue[int | None] = asyncio.Queue()


class FakeEngine:
    def __init__(self, step_s: float = 0.002, per_seq_s: float = 0.0004, prefill_s_per_token: float = 2e-5,
                 max_memory_fraction: float = 0.9) -> None:
        self.step_s, self.per_seq_s, self.prefill_s_per_token = step_s, per_seq_s, prefill_s_per_token
        self.max_memory_fraction = max_memory_fraction
        self.cache_resets = 0
        self.max_num_seqs = 0
        self._waiting: deque[_Seq] = deque()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None

    measure_only = False

    @property
    def pids(self) -> list[int]:
        return []

    @property
    def process_refs(self) -> list[ProcessRef]:
        return []

    @property
    def started(self) -> bool:
        return self._loop_task is not None

    def validate(self, params: dict[str, Any]) -> None:
        if "unknown_arg" in params:
            raise EngineStartError("fake: unexpected keyword argument 'unknown_arg'", failures.INVALID_CONFIG)

    async def start(self, params: dict[str, Any], log_path: Path | None = None) -> dict[str, Any]:
        self.validate(params)
        if params.get("gpu_memory_utilization", 0.5) > self.max_memory_fraction:
            raise EngineStartError("fake: requested memory exceeds the device", failures.OUT_OF_MEMORY)
        self.max_num_seqs = int(params.get("max_num_seqs", 16))
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._loop())
        return {**params, "max_num_seqs": self.max_num_seqs}

    async def _loop(self) -> None:
        assert self._wake is not None
        running: list[_Seq] = []
        while True:
            new = []
            while self._waiting and len(running) < self.max_num_seqs:
                new.append(self._waiting.popleft())
            running += new
            if not running:
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = sum(s.request.input_len for s in new)
            await asyncio.sleep(self.step_s + self.per_seq_s * len(running) + self.prefill_s_per_token * prefill)
            for seq in running:
                seq.left -= 1
                seq.out.put_nowait(1)
                if seq.left <= 0:
                    seq.out.put_nowait(None)
            running = [s for s in running if s.left > 0]

    async def generate(self, request: Request) -> AsyncIterator[int]:
        assert self._wake is not None and self.started, "generate before start"
        seq = _Seq(request)
        self._waiting.append(seq)
        self._wake.set()
        while (n := await seq.out.get()) is not None:
            yield n

    async def reset_prefix_cache(self) -> None:
        self.cache_resets += 1

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._loop_task = None
