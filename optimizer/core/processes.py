"""End the processes an engine started, by the PIDs recorded at start (never by process name)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
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


def _signal(procs: list[psutil.Process], kill: bool) -> None:
    """SIGKILL (`kill`) or SIGTERM each of `procs`; one that has ended meanwhile is skipped."""
    for proc in procs:
        try:
            proc.kill() if kill else proc.terminate()
        except psutil.NoSuchProcess:
            pass


def kill_now(refs: list[ProcessRef], wait_s: float = 2.0) -> list[int]:
    """SIGKILL the live ones at once (a process that ignores SIGTERM while blocked); returns their PIDs."""
    live = [p for p in (r.alive() for r in refs) if p is not None]
    _signal(live, kill=True)
    psutil.wait_procs(live, timeout=wait_s)
    return [p.pid for p in live]


def named(refs: list[ProcessRef], prefix: str) -> list[ProcessRef]:
    """Those of `refs` alive whose process title starts with `prefix` (vLLM titles its processes `VLLM::...`)."""
    out = []
    for r in refs:
        proc = r.alive()
        try:
            if proc is not None and proc.name().startswith(prefix):
                out.append(r)
        except psutil.NoSuchProcess:
            pass
    return out


SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "psm_"  # Python's multiprocessing.shared_memory names: vLLM's message queues between its processes


def shared_memory_of(refs: list[ProcessRef]) -> set[str]:
    """The shared-memory segments (SEGMENT_PREFIX*) that the live processes of `refs` have mapped."""
    names: set[str] = set()
    for r in refs:
        if r.alive() is None:
            continue
        try:
            maps = Path(f"/proc/{r.pid}/maps").read_text()
        except OSError:
            continue
        names.update(line.rsplit("/", 1)[1] for line in maps.splitlines()
                     if f"{SHM_DIR}/{SEGMENT_PREFIX}" in line)
    return names


def release_shared_memory(names: set[str]) -> list[str]:
    """Unlink those of `names` still there, once the processes that mapped them have ended: an engine killed before
    its own teardown leaves its message queues behind (160-420 MB each on the CPU build, measured), in memory until
    this process exits. Returns the names unlinked."""
    from multiprocessing import shared_memory

    done = []
    for name in sorted(names):
        if not (SHM_DIR / name).exists():
            continue
        try:
            segment = shared_memory.SharedMemory(name=name)  # unlink() also drops it from the resource tracker
        except (FileNotFoundError, PermissionError, ValueError):
            continue
        segment.close()
        segment.unlink()
        done.append(name)
    return done


RPC_PATH_ENV = "VLLM_RPC_BASE_PATH"
RPC_DIR_PREFIX = "optimizer-ipc-"


def rpc_dir(env: Mapping[str, str], parent: Path | None = None) -> Path | None:
    """A fresh directory for one engine's ZMQ IPC sockets, for its RPC_PATH_ENV, named for this process (in `parent`,
    the system's temporary directory by default); None when `env` names one already (the user's choice is kept).

    vLLM makes each of its sockets a file under VLLM_RPC_BASE_PATH (the system's temporary directory by default), and
    only the process that bound a socket removes its file, when it closes it: an engine core and worker ended by PID
    once the measurement is over leave theirs behind (on the CPU build, measured: 84 in /tmp after a study's probe and
    its first 12 trials; 7 in each engine's directory). With a directory of its own, `remove_rpc_dir` takes them all
    once its processes end; the directories of processes that ended without that (killed) go the next time any
    process makes one."""
    if env.get(RPC_PATH_ENV):
        return None
    where = Path(parent or tempfile.gettempdir())
    for stale in where.glob(f"{RPC_DIR_PREFIX}*-*"):
        pid = stale.name[len(RPC_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            remove_rpc_dir(stale)
    return Path(tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{os.getpid()}-", dir=where))


def renew_rpc_dir(previous: Path | None, env: Mapping[str, str]) -> tuple[Path | None, dict[str, str]]:
    """For an engine start: `previous` removed (a start after a failed one), a fresh `rpc_dir`, and the environment
    that names it (empty where the user named one)."""
    remove_rpc_dir(previous)
    made = rpc_dir(env)
    return made, ({RPC_PATH_ENV: str(made)} if made is not None else {})


def remove_rpc_dir(path: Path | None) -> None:
    """Remove an engine's socket directory and what is left in it (nothing when `path` is None or already gone)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def end_processes(refs: list[ProcessRef], grace_s: float = 5.0) -> list[int]:
    """SIGTERM the live ones, SIGKILL what is left after `grace_s`. Returns the PIDs that had to be ended."""
    live = [p for p in (r.alive() for r in refs) if p is not None]
    _signal(live, kill=False)
    _, still = psutil.wait_procs(live, timeout=grace_s)
    _signal(still, kill=True)
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
def log_tail(log_path: Path, max_chars: int = 4000) -> str:
    """The end of a trial's engine log (whole lines), for a process that died."""
    try:
        with log_path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - max_chars, 0))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return text.split("\n", 1)[1] if len(text) >= max_chars and "\n" in text else text
