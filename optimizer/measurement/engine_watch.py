"""An engine under watch: its death is noticed within a second in every phase, and every call into it has a bound.

vLLM raises EngineDeadError into some awaits on a dead engine, but not into all of them: a request sent after its
engine core died can wait for an answer that never comes. So the watch does not rely on the engine to say it died.
It polls the engine's processes (`Engine.process_refs`) and, when one is gone, cancels whatever waits on the engine
and raises EngineDiedError naming the phase and the process. A call that outlives its bound (`CallBounds`) ends the
same way, as a hang: the engine's processes may all be alive and still never answer.

Phases, in a trial's order: start, warm-up (requests before the first prefix-cache reset), prefix-cache reset,
replay, stats collection, between replays (no call in flight), shutdown. A death during shutdown ends nothing: the
measurement is complete, and the shutdown ends what is left by PID within its bound.

Which processes count: those vLLM titles as its own (`VLLM::EngineCore`, `VLLM::Worker`, its API server where it
titles one), not helpers that may end by themselves (torch.compile's workers); where vLLM titles none, every process
the engine started that was alive when its start returned. During the start, vLLM's own start-up errors and the
start's bound cover the processes not yet titled.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from optimizer.config.resolved import Resolved
from optimizer.core import failures
from optimizer.core.errors import EngineDiedError, EngineStartError
from optimizer.core.processes import ProcessRef, end_processes, named
from optimizer.measurement.engine import Engine, EngineStats
from optimizer.measurement.workload import Request

T = TypeVar("T")

START, WARM_UP, RESET, REPLAY, STATS, BETWEEN, SHUTDOWN = (
    "start", "warm-up", "prefix-cache reset", "replay", "stats collection", "between replays", "shutdown")
PHASES = (START, WARM_UP, RESET, REPLAY, STATS, BETWEEN, SHUTDOWN)

# A test places an engine's death in a phase with this: "PHASE:PATH" makes the first trial's watch (`pause_from_env`)
# that enters PHASE (in the warm-up and the replay: at the first output token, with requests in flight) write the
# engine's PIDs to PATH as JSON and wait there until the engine dies (at most PAUSE_LIMIT_S), once per process, so
# that a kill lands in that phase every time.
PAUSE_ENV = "OPTIMIZER_TEST_PAUSE_AT"
PAUSE_LIMIT_S = 120.0
VLLM_TITLE_ENV, VLLM_TITLE_DEFAULT = "VLLM_PROCESS_NAME_PREFIX", "VLLM"  # vLLM titles its processes PREFIX::Name


@dataclass(frozen=True)
class CallBounds:
    """How long each kind of call into the engine may take before the engine is taken for hung (seconds)."""

    start_s: float = 1800.0
    reset_s: float = 120.0  # a reset waits for the requests still holding blocks (the HTTP engine retries)
    stats_s: float = 60.0
    stall_s: float = 300.0  # requests in flight and no output from any of them for this long
    shutdown_s: float = 120.0
    poll_s: float = 0.25  # how often the engine's processes are looked at
    start_grace_s: float = 5.0  # a process gone mid-start: vLLM's own start-up error is awaited this long


class WatchedEngine:
    """`engine` with its death noticed in every phase (module docstring). An Engine itself: pass it where the engine
    would go. The optional capabilities pass through: stats collection (bounded), virtual-time replays (no
    processes to watch)."""

    def __init__(self, engine: Engine, bounds: CallBounds = CallBounds(), pause_at: str = "") -> None:
        self.engine = engine
        self.bounds = bounds
        self.phase = START
        self._vital: list[ProcessRef] | None = None  # fixed when the start returns
        self._death: EngineDiedError | None = None
        self._dead = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._consumers: set[asyncio.Task[Any]] = set()  # tasks inside `generate`
        self._last_output_s = time.monotonic()
        self._reset_seen = False
        self._pause, self._pause_file = _parse_pause(pause_at)
        self._titled: set[ProcessRef] = set()  # mid-start: the processes vLLM titled as its own, once seen
        if hasattr(engine, "take_engine_stats"):
            self.take_engine_stats = self._take_engine_stats
        if hasattr(engine, "simulate_replay"):
            self.simulate_replay = engine.simulate_replay

    # the Engine protocol, passed through or watched
    @property
    def measure_only(self) -> bool:
        return self.engine.measure_only

    @property
    def pids(self) -> list[int]:
        return self.engine.pids

    @property
    def process_refs(self) -> list[ProcessRef]:
        return self.engine.process_refs

    def validate(self, params: dict[str, Any]) -> Resolved | None:
        return self.engine.validate(params)

    async def start(self, params: dict[str, Any], log_path: Path | None = None) -> dict[str, Any]:
        self._death, self._vital, self._reset_seen = None, None, False  # a start after a failed one starts afresh
        self._dead.clear()
        self._titled.clear()
        self._ensure_watching()
        self.phase = START
        try:
            resolved = await self._await(asyncio.ensure_future(self.engine.start(params, log_path)),
                                         self.bounds.start_s, grace_s=self.bounds.start_grace_s)
        except EngineStartError as exc:
            # vLLM's own start-up error, after a process of it was seen gone: a known cause (out of memory, an
            # invalid config) stays what it is; the rest is the engine's death
            if self._death is not None and exc.reason == failures.START_FAILED:
                raise self._death from None
            raise
        alive = [r for r in self.engine.process_refs if r.alive() is not None]
        self._vital = vllm_titled(alive) or alive  # not a helper that may end by itself (a compile worker)
        await self._pause_here(START)
        self._raise_if_dead()
        self.phase = BETWEEN
        return resolved

    async def generate(self, request: Request) -> AsyncIterator[int]:
        phase = REPLAY if self._reset_seen else WARM_UP
        self._raise_if_dead()
        task = asyncio.current_task()
        assert task is not None
        if not self._consumers:  # the stall clock starts with the first request in flight
            self._last_output_s = time.monotonic()
        self._consumers.add(task)
        self.phase = phase
        first = True
        try:
            async for n in self.engine.generate(request):
                self._last_output_s = time.monotonic()
                if first and self._pause == phase:
                    first = False
                    await self._pause_here(phase)
                yield n
        except asyncio.CancelledError:
            if self._death is None:
                raise
            task.uncancel()
            raise self._death from None
        except EngineDiedError as exc:  # the engine said so first: name its phase and processes as the watch would
            raise self._declare(str(exc)) from None
        finally:
            self._consumers.discard(task)
            if not self._consumers and self.phase == phase:
                self.phase = BETWEEN

    async def reset_prefix_cache(self) -> None:
        await self.call(RESET, self.engine.reset_prefix_cache, self.bounds.reset_s)
        self._reset_seen = True

    async def _take_engine_stats(self) -> EngineStats:
        return await self.call(STATS, self.engine.take_engine_stats, self.bounds.stats_s)  # type: ignore[attr-defined]

    async def shutdown(self) -> None:
        """The engine's own shutdown within its bound; what is still alive after it is ended by PID. A death now
        is no failure: the measurement is over."""
        if self._pause == SHUTDOWN and self._vital:
            await self._pause_here(SHUTDOWN)
        self.phase = SHUTDOWN
        try:
            await asyncio.wait_for(self.engine.shutdown(), timeout=self.bounds.shutdown_s)
        except (asyncio.TimeoutError, EngineDiedError):
            pass
        finally:
            end_processes(self.engine.process_refs, grace_s=2.0)
            if self._watcher is not None:
                self._watcher.cancel()
                self._watcher = None

    async def call(self, phase: str, fn: Callable[[], Awaitable[T]], bound_s: float) -> T:
        """`fn()` in `phase`, raced against the engine's death and its bound."""
        if phase == RESET and self._reset_seen and self.phase == BETWEEN:
            await self._pause_here(BETWEEN)
        self._raise_if_dead()
        before, self.phase = self.phase, phase
        try:
            await self._pause_here(phase)
            self._raise_if_dead()
            return await self._await(asyncio.ensure_future(fn()), bound_s)
        finally:
            if self.phase == phase:
                self.phase = BETWEEN if before != START else before

    async def guard(self, awaitable: Awaitable[T], bound_s: float | None = None) -> T:
        """`awaitable` (a whole measurement: many calls, and the waits between them) cancelled as soon as the engine
        dies, with EngineDiedError; asyncio.TimeoutError past `bound_s`."""
        self._raise_if_dead()
        task = asyncio.ensure_future(awaitable)
        if await self._race(task, bound_s):
            return task.result()
        if self._death is not None:
            raise self._death
        raise asyncio.TimeoutError

    async def _await(self, task: asyncio.Future[T], bound_s: float, grace_s: float = 0.0) -> T:
        """`task`'s result; EngineDiedError when the engine dies first, and as a hang past `bound_s`."""
        if await self._race(task, bound_s, grace_s):
            try:
                return task.result()
            except EngineDiedError as exc:
                raise self._declare(str(exc)) from None
        if self._death is not None:
            raise self._death
        raise self._declare(f"no answer within {bound_s:.0f} s (the engine hangs)")

    async def _race(self, task: asyncio.Future[Any], bound_s: float | None, grace_s: float = 0.0) -> bool:
        """Wait for `task` or the engine's death (then up to `grace_s` more, in which the engine may still raise its
        own error), at most `bound_s` in all. True when `task` finished; otherwise it is cancelled."""
        dead = asyncio.ensure_future(self._dead.wait())
        deadline = None if bound_s is None else time.monotonic() + bound_s
        try:
            done, _ = await asyncio.wait({task, dead}, timeout=bound_s, return_when=asyncio.FIRST_COMPLETED)
            if task not in done and dead in done and grace_s > 0:
                left = grace_s if deadline is None else max(min(grace_s, deadline - time.monotonic()), 0.0)
                done, _ = await asyncio.wait({task}, timeout=left)
        except BaseException:
            # cancelled from outside (Ctrl-C, SIGTERM, the trial's own bound): the call is cancelled too and ends as
            # it would unwatched, its own clean-up awaited (a start waits for vLLM's, then ends what it made)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            dead.cancel()
        if task in done:
            return True
        await _cancel(task)
        return False

    def _ensure_watching(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while self._death is None:
            await asyncio.sleep(self.bounds.poll_s)
            gone = self._gone()
            if gone:
                which = ", ".join(f"{r.pid}" for r in gone)
                self._declare(f"engine process{'es' if len(gone) > 1 else ''} {which} gone")
            elif self._consumers and time.monotonic() - self._last_output_s > self.bounds.stall_s:
                self._declare(f"{len(self._consumers)} requests in flight and no output for "
                              f"{self.bounds.stall_s:.0f} s (the engine hangs)")

    def _gone(self) -> list[ProcessRef]:
        if self.phase == SHUTDOWN:
            return []
        if self._vital is not None:
            return [r for r in self._vital if r.alive() is None]
        self._titled.update(vllm_titled(self.engine.process_refs))  # mid-start: vLLM's own, once seen
        return [r for r in self._titled if r.alive() is None]

    def _declare(self, why: str) -> EngineDiedError:
        """Record the engine's death (the first cause noticed wins), wake every waiter, cancel every request."""
        if self._death is None:
            gone = [r.pid for r in (self._vital or []) if r.alive() is None]
            extra = f"; engine process{'es' if len(gone) > 1 else ''} {', '.join(map(str, gone))} gone" \
                if gone and "gone" not in why else ""
            self._death = EngineDiedError(f"the engine died during the {self.phase}: {why}{extra}")
            self._dead.set()
            current = asyncio.current_task()
            for task in list(self._consumers):
                if task is not current:
                    task.cancel()
        return self._death

    def _raise_if_dead(self) -> None:
        if self._death is not None:
            raise self._death

    async def _pause_here(self, phase: str) -> None:
        """The test hook (PAUSE_ENV): once, on entering `phase`, say so and wait for the engine's death."""
        if self._pause != phase or self._pause_file is None:
            return
        self._pause = None
        refs = self._vital or self.engine.process_refs
        self._pause_file.write_text(json.dumps({"phase": phase, "pids": [r.pid for r in refs]}))
        try:
            await asyncio.wait_for(self._dead.wait(), timeout=PAUSE_LIMIT_S)
        except asyncio.TimeoutError:
            pass


def vllm_titled(refs: list[ProcessRef]) -> list[ProcessRef]:
    """Those of `refs` alive under a title vLLM gives its own processes (VLLM::EngineCore, VLLM::Worker_TP0, ...)."""
    return named(refs, f"{os.environ.get(VLLM_TITLE_ENV) or VLLM_TITLE_DEFAULT}::")


_paused: list[str] = []  # PAUSE_ENV is taken once per process


def pause_from_env() -> str:
    """PAUSE_ENV's value for the first engine that asks (a trial's), "" for every later one."""
    value = os.environ.get(PAUSE_ENV, "")
    if not value or _paused:
        return ""
    _paused.append(value)
    return value


def _parse_pause(value: str) -> tuple[str | None, Path | None]:
    """PAUSE_ENV's "PHASE:PATH" -> (PHASE, PATH); (None, None) when unset or not a phase."""
    phase, _, path = value.partition(":")
    return (phase, Path(path)) if phase in PHASES and path else (None, None)


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and give it a moment to end (a task stuck past its cancellation is left behind, not awaited);
    what it ended with is taken, so that nothing reports an exception never retrieved."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
    if task.done() and not task.cancelled():
        task.exception()
