"""Engines started outside a trial (the demo's probe) are kept on record while they run, and a later run ends what a
killed run left there: real child processes, ended by PID."""

import asyncio
import json
import socket
import subprocess
import sys

import psutil

from optimizer.core.processes import ProcessRef
from optimizer.search.fitting import recorded
from optimizer.search.recovery import end_recorded, record_engine


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def dead_worker() -> dict:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(gone.pid)
    identity = {"host": socket.gethostname(), "pid": gone.pid, "create_time": proc.create_time()}
    gone.wait()
    return identity


def test_a_dead_workers_engine_is_ended_and_its_record_removed(tmp_path):
    engine = sleeper()
    try:
        path = tmp_path / "probe.engine.json"
        record_engine(path, [ProcessRef.of(psutil.Process(engine.pid))])
        data = json.loads(path.read_text())
        data["worker"] = dead_worker()  # the run that recorded it was killed
        path.write_text(json.dumps(data))
        assert end_recorded(path) == [engine.pid]
        assert engine.wait(timeout=10) is not None and not path.exists()
    finally:
        engine.kill()


def test_a_live_workers_record_is_left_alone(tmp_path):
    engine = sleeper()
    try:
        path = tmp_path / "probe.engine.json"
        record_engine(path, [ProcessRef.of(psutil.Process(engine.pid))])  # this process: alive, probing
        assert end_recorded(path) == [] and path.exists() and engine.poll() is None
        assert end_recorded(tmp_path / "none.json") == []  # nothing on record
    finally:
        engine.kill()


class Engine:
    def __init__(self) -> None:
        self.proc = sleeper()

    @property
    def process_refs(self) -> list[ProcessRef]:
        return [ProcessRef.of(psutil.Process(self.proc.pid))]


def test_the_probes_engine_is_on_record_while_it_runs(tmp_path):
    path = tmp_path / "probe.engine.json"
    seen = []

    async def measure(factory, wait_s):
        engine = factory()
        try:
            await asyncio.sleep(wait_s)
            seen.append(json.loads(path.read_text()))
            return engine.proc.pid
        finally:
            engine.proc.kill()

    pid = asyncio.run(recorded(measure, Engine, path, 1.5))
    assert [p for p, _ in seen[0]["processes"]] == [pid]
