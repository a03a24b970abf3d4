"""The engine watch on an engine whose process is a real child process and whose calls never return once it is gone
(what vLLM does to some awaits): the death is noticed within a second in each phase, named with the phase and the
PID; a hang with the process alive ends at the call's bound. The real engine's deaths: tests/e2e/test_engine_dies.py.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from optimizer.core.clock import MonotonicClock
from optimizer.core.errors import EngineDiedError
from optimizer.core.processes import ProcessRef
from optimizer.measurement.engine import ReportsEngineStats, ServesInVirtualTime
from optimizer.measurement.engine_watch import (BETWEEN, PHASES, RESET, SHUTDOWN, START, STATS, CallBounds,
                                                WatchedEngine)
from optimizer.measurement.engine import EngineStats
from optimizer.measurement.replay import replay
from optimizer.measurement.workload import Request


class NeverAnswersOnceDead:
    """An engine process (a real child) whose calls block forever, as a call into a dead vLLM engine can."""

    measure_only = False

    def __init__(self, hang=()):
        self.proc = None
        self.refs = []
        self.hang = set(hang)  # calls that never return even while the process lives

    @property
    def process_refs(self):
        return list(self.refs)

    @property
    def pids(self):
        return [r.pid for r in self.process_refs]

    def validate(self, params):
        pass

    async def start(self, params, log_path=None):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        self.refs = [ProcessRef.of(psutil.Process(self.proc.pid))]
        return {}

    def alive(self):
        return self.proc.poll() is None

    async def _forever_unless_alive(self, name):
        while self.alive() and name not in self.hang:
            return
        await asyncio.Event().wait()

    async def generate(self, request):
        for _ in range(request.output_len):
            if not self.alive() or "generate" in self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(0.01)
            yield 1

    async def reset_prefix_cache(self):
        await self._forever_unless_alive("reset")

    async def take_engine_stats(self):
        await self._forever_unless_alive("stats")
        return EngineStats()

    async def shutdown(self):
        if self.proc and self.alive():
            self.proc.kill()
            self.proc.wait()


REQUESTS = [Request(index=i, prompt_token_ids=(1, 2, 3), output_len=50, unit_arrival_s=float(i)) for i in range(8)]


async def _trial(engine):
    """A trial's calls in order: start, warm-up, reset, replay, stats, (between replays) reset, replay, shutdown."""
    clock = MonotonicClock()
    await engine.start({})
    await replay(engine, REQUESTS[:2], [0.0, 0.0], clock)
    for _ in range(2):
        await engine.reset_prefix_cache()
        await replay(engine, REQUESTS, [0.05 * i for i in range(len(REQUESTS))], clock)
        await engine.take_engine_stats()


@pytest.mark.parametrize("phase", [p for p in PHASES if p not in (START, SHUTDOWN)])
def test_a_kill_in_each_phase_ends_the_trial_within_a_second_naming_the_phase_and_the_process(tmp_path, phase):
    pause = tmp_path / "pause.json"
    inner = NeverAnswersOnceDead()
    killed = {}

    async def kill_when_paused():
        while not pause.exists():
            await asyncio.sleep(0.01)
        pid = json.loads(pause.read_text())["pids"][0]
        killed["pid"], killed["at"] = pid, time.monotonic()
        os.kill(pid, signal.SIGKILL)

    async def main():
        engine = WatchedEngine(inner, CallBounds(poll_s=0.1), pause_at=f"{phase}:{pause}")
        killer = asyncio.ensure_future(kill_when_paused())
        try:
            with pytest.raises(EngineDiedError) as died:
                await engine.guard(_trial(engine), bound_s=60)
            return died.value, time.monotonic()
        finally:
            killer.cancel()
            await engine.shutdown()

    err, ended = asyncio.run(main())
    assert f"the engine died during the {phase}:" in str(err)
    assert f"{killed['pid']} gone" in str(err)
    assert ended - killed["at"] < 1.0, f"noticed after {ended - killed['at']:.2f} s"
    assert not inner.alive()


def test_a_kill_right_after_the_start_is_noticed_before_the_first_call():
    inner = NeverAnswersOnceDead()

    async def main():
        engine = WatchedEngine(inner, CallBounds(poll_s=0.05))
        await engine.start({})
        inner.proc.kill()
        t0 = time.monotonic()
        with pytest.raises(EngineDiedError, match="during the between replays|during the warm-up"):
            await engine.guard(replay(engine, REQUESTS, [0.0] * len(REQUESTS), MonotonicClock()), bound_s=30)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 1.0


@pytest.mark.parametrize("call", ["reset", "stats", "generate"])
def test_a_call_that_hangs_with_its_process_alive_ends_at_its_bound(call):
    inner = NeverAnswersOnceDead(hang={call})
    bounds = CallBounds(reset_s=0.5, stats_s=0.5, stall_s=0.5, poll_s=0.05)

    async def main():
        engine = WatchedEngine(inner, bounds)
        await engine.start({})
        t0 = time.monotonic()
        try:
            with pytest.raises(EngineDiedError, match="hangs") as died:
                await engine.guard(_trial(engine), bound_s=30)
            return died.value, time.monotonic() - t0
        finally:
            await engine.shutdown()

    err, took_s = asyncio.run(main())
    assert took_s < 3.0
    phase = {"reset": RESET, "stats": STATS, "generate": "warm-up"}[call]
    assert f"during the {phase}" in str(err)
    assert not inner.alive()  # the shutdown ended it by PID


def test_a_death_at_shutdown_is_no_failure_and_leaves_no_process(tmp_path):
    pause = tmp_path / "pause.json"
    inner = NeverAnswersOnceDead()

    async def main():
        engine = WatchedEngine(inner, CallBounds(poll_s=0.05), pause_at=f"{SHUTDOWN}:{pause}")
        await engine.start({})
        shutting = asyncio.ensure_future(engine.shutdown())
        while not pause.exists():
            await asyncio.sleep(0.01)
        inner.proc.kill()
        await asyncio.wait_for(shutting, 10)
        return engine

    engine = asyncio.run(main())
    assert engine.phase == SHUTDOWN and not inner.alive()


def test_an_engine_without_processes_passes_through_with_its_capabilities():
    from tests.support.fakes import SimEngine

    sim = SimEngine()
    watched = WatchedEngine(sim)
    assert isinstance(watched, ServesInVirtualTime) == isinstance(sim, ServesInVirtualTime)
    assert isinstance(watched, ReportsEngineStats) == isinstance(sim, ReportsEngineStats)
    assert not isinstance(WatchedEngine(NeverAnswersOnceDead()), ServesInVirtualTime)
    assert watched.phase == START and BETWEEN != START


class TitledWithAHelper(NeverAnswersOnceDead):
    """An engine process titled as vLLM titles its own, beside a helper that ends by itself (a compile worker)."""

    async def start(self, params, log_path=None):
        title = "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(600)"
        self.proc = subprocess.Popen([sys.executable, "-c", title])
        self.helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
        while psutil.Process(self.proc.pid).name() != "VLLM::EngineCore":
            await asyncio.sleep(0.02)
        self.refs = [ProcessRef.of(psutil.Process(p.pid)) for p in (self.proc, self.helper)]
        return {}


def test_a_helper_that_ends_by_itself_is_no_death_and_vllms_own_process_is_watched():
    pytest.importorskip("setproctitle")
    inner = TitledWithAHelper()

    async def main():
        engine = WatchedEngine(inner, CallBounds(poll_s=0.05))
        await engine.start({})
        inner.helper.wait(timeout=10)
        await asyncio.sleep(0.3)
        await engine.reset_prefix_cache()  # the helper is gone; the engine is not dead
        inner.proc.kill()
        t0 = time.monotonic()
        try:
            with pytest.raises(EngineDiedError, match=f"{inner.proc.pid} gone"):
                await engine.guard(asyncio.sleep(30))
            return time.monotonic() - t0
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) < 1.0
