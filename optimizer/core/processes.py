"""End the processes an engine started, by the PIDs recorded at start (never by process name)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class ProcessRef:
    """A PID plus its start time, so that a reused PID is never mistaken for ours."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, proc: psutil.Process) -> ProcessRef:
        return cls(proc.pid, proc.create_time())

    def alive(self) -> psutil.Process | None:
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None


def children() -> set[ProcessRef]:
    """All descendants of this process."""
    refs = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            refs.add(ProcessRef.of(proc))
        except psutil.NoSuchProcess:
            pass
    return refs


# vLLM's multiprocess executor waits this long for its worker to exit by itself before it sends SIGTERM. On the CPU
# build the worker never exits in the wait (measured: "workers still running after grace period" after its default
# 5 s, at every shutdown), so the default only adds 5 s to every engine's shutdown: the worker is ended after 1 s.
WORKER_EXIT_WAIT_ENV = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}


def worker_exit_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """Those of WORKER_EXIT_WAIT_ENV that `env` does not set itself (a user's own value is kept)."""
    return {k: v for k, v in WORKER_EXIT_WAIT_ENV.items() if k not in env}


def end_processes(refs: list[ProcessRef], grace_s: float = 5.0) -> list[int]:
    """SIGTERM the live ones, SIGKILL what is left after `grace_s`. Returns the PIDs that had to be ended."""
    live = [p for p in (r.alive() for r in refs) if p is not None]
    for proc in live:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(live, timeout=grace_s)
    for proc in still:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(still, timeout=grace_s)
    return [p.pid for p in live]


@contextmanager
def output_to(log_path: Path | None) -> Iterator[None]:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at `log_path` for the block.

    Child processes spawned inside the block inherit the file and keep writing there afterwards, which is how
    each trial keeps its engine's own log (the root cause of a failed start is only printed there).
    """
    if log_path is None:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
