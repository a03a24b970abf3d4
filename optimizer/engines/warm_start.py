"""Warm engine starts on vLLM's CPU build: the engine's processes forked from one that has vLLM imported.

vLLM's CPU build starts its engine core with `spawn`, and the core spawns a separate worker process
(`platforms/cpu.py` forces both): each imports vLLM and torch again, ~7 s apiece on the project's 2-core machines,
half of an engine start (docs/machines.md#engine-start). Here a multiprocessing fork server is started once, with
the environment vLLM's CPU platform prepares for its children (LD_PRELOAD of torch's libgomp) and vLLM's engine
modules imported; the engine core is forked from it (`launch_from`), and the core forks its worker.

What a spawned process would have read when it started is given to the forked one:
- the parent's environment and its stdout/stderr (the trial's log) at the moment of the start (`WarmProcess`);
- in the worker, what libgomp reads only when it loads: the thread count (`OMP_NUM_THREADS`) and the CPU it binds
  its thread to (`GOMP_CPU_AFFINITY`), both set by vLLM in the core just before it starts the worker
  (`bind_openmp_as_at_load`).
A start that a fork cannot reproduce that way starts cold, as vLLM does (`refusal` says why): a worker with more
than one OpenMP thread (libgomp binds each of them at its load), a trial environment variable other than `VLLM_*`,
or a library-load environment that differs from the fork server's.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from multiprocessing import context as mp_context
from multiprocessing import forkserver, reduction
from typing import Any

import psutil

# Imported in the fork server, so that a forked engine core finds them loaded: what the core and the CPU worker
# import on a cold start (measured with `python -X importtime`: torch, transformers and vLLM's config are most of it).
PRELOAD = ("vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
           "vllm.model_executor.models.llama", "optimizer.engines.warm_start")

# Environment variables read when a library loads (the dynamic loader, OpenMP runtimes, allocators, Python itself):
# a forked process keeps what the fork server loaded with, so these must be equal for a start to be warm.
LOAD_TIME_PREFIXES = ("LD_", "OMP_", "GOMP_", "KMP_", "MALLOC_", "TCMALLOC_", "MKL_", "PYTHON")


def load_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` that libraries read when they load."""
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES)}


def refusal(trial_env: Mapping[str, str], env_now: Mapping[str, str], server_env: Mapping[str, str] | None,
            worker_cpus: list[list[int]] | None) -> str | None:
    """Why this start cannot be warm (None: it can).

    `trial_env`: the trial's own environment variables; `env_now`: this process's environment once vLLM has built
    the trial's config (its CPU platform sets LD_PRELOAD there); `server_env`: the environment the running fork
    server started with (None: none runs yet, one is started with `env_now`); `worker_cpus`: the CPUs vLLM binds
    each worker's OpenMP threads to, one list per worker (None: unknown; empty: vLLM binds nothing).
    """
    foreign = sorted(name for name in trial_env if not name.startswith("VLLM_"))
    if foreign:
        return f"the trial sets {', '.join(foreign)}, which a library may read only when it loads"
    if "libgomp" not in env_now.get("LD_PRELOAD", ""):
        return "vLLM did not preload torch's libgomp (LD_PRELOAD), the OpenMP runtime a warm start binds as vLLM does"
    if server_env is not None and load_time_env(server_env) != load_time_env(env_now):
        changed = sorted(set(load_time_env(server_env).items()) ^ set(load_time_env(env_now).items()))
        return f"the library-load environment differs from the fork server's ({', '.join(k for k, _ in changed)})"
    if worker_cpus is None:
        return "vLLM's CPU binding of the worker could not be read"
    wide = [cpus for cpus in worker_cpus if len(cpus) != 1]
    if wide:
        return (f"a worker runs {len(wide[0])} OpenMP threads, which libgomp binds one per CPU only when it loads "
                "(a warm start reproduces the binding of one thread)")
    return None


def gomp_cpus(affinity: str) -> list[int]:
    """CPU ids of a GOMP_CPU_AFFINITY value, in order: "0 3 1-2 4-8:2" -> [0, 3, 1, 2, 4, 6, 8]."""
    out: list[int] = []
    for item in affinity.replace(",", " ").split():
        span, _, step = item.partition(":")
        first, _, last = span.partition("-")
        out.extend(range(int(first), int(last or first) + 1, int(step or 1)))
    return out


def bind_openmp_as_at_load() -> None:
    """In a forked worker: what libgomp does with the worker's environment when it loads in a spawned one.

    vLLM's core sets OMP_NUM_THREADS and GOMP_CPU_AFFINITY around its worker's start; libgomp reads them only
    at its load, which a forked worker does not repeat. With one thread (`refusal` holds every warm start to that),
    libgomp binds the process's first thread to the first CPU listed, and every thread made after inherits it.
    """
    cpus = gomp_cpus(os.environ.get("GOMP_CPU_AFFINITY", ""))
    if cpus:
        os.sched_setaffinity(0, cpus[:1])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))  # before the worker's first parallel region: sets the count, starts none


def _rebuild_fd(dup: Any) -> int:
    return int(dup.detach())


class _InheritedFd:
    """A file descriptor of this process, duplicated into the forked child when the process object is sent."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_fd, (reduction.DupFd(self.fd),)


class WarmProcess(mp_context.ForkServerProcess):
    """A process forked from the fork server that starts as a spawned one would have: with the environment, the
    stdout and stderr its parent has when `start` is called; the processes it forks bind OpenMP as at load."""

    def start(self) -> None:
        self._parent_env = dict(os.environ)
        self._parent_stdio = (_InheritedFd(1), _InheritedFd(2))
        super().start()

    def run(self) -> None:
        try:
            import setproctitle

            setproctitle.getproctitle()  # set up before the environment moves: vLLM titles its processes with it
        except ImportError:  # vLLM goes without titles then, and so does a spawned process
            pass
        out, err = self._parent_stdio
        os.dup2(int(out), 1)
        os.dup2(int(err), 2)
        os.close(int(out))
        os.close(int(err))
        os.environ.clear()
        os.environ.update(self._parent_env)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # the core forks its worker: it has vLLM loaded too
        os.register_at_fork(after_in_child=bind_openmp_as_at_load)
        super().run()


class WarmContext(mp_context.ForkServerContext):
    Process = WarmProcess  # type: ignore[assignment]


_server_env: dict[str, str] | None = None


def server_env() -> dict[str, str] | None:
    """The environment the running fork server started with (None: none runs)."""
    return _server_env if _server_env is not None and server_pid() is not None else None


def server_pid() -> int | None:
    """The fork server's PID while it runs: a child of this process that outlives engines (not one of theirs)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # the stdlib's one fork server per process
    try:
        return pid if pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def ensure_server() -> WarmContext:
    """Start the fork server if none runs, with this process's environment and stdout/stderr (vLLM's import
    messages go there): it imports PRELOAD in the background and forks engines once it has."""
    global _server_env
    context = WarmContext()
    if server_pid() is None:
        context.set_forkserver_preload(list(PRELOAD))
        forkserver.ensure_running()
        _server_env = dict(os.environ)
    return context


def worker_cpus(vllm_config: Any) -> list[list[int]] | None:
    """The CPUs vLLM's multiprocess executor binds each worker's OpenMP threads to, read with vLLM's own code."""
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        manager = OMPProcessManager(vllm_config)
        return [] if manager.skip_setup else [list(cpus) for cpus in manager.cpu_lists]
    except Exception:  # another vLLM version, another platform: unknown, and the start is cold
        return None


def launcher_takes_a_context() -> bool:
    """Whether vLLM's launcher of engine cores gets its processes from `get_mp_context` (vLLM 0.32), which
    `launch_from` replaces; another vLLM version without it starts cold."""
    try:
        import vllm.v1.engine.utils as launcher
    except ImportError:
        return False
    return callable(getattr(launcher, "get_mp_context", None))


@contextmanager
def launch_from(context: multiprocessing.context.BaseContext | None) -> Iterator[None]:
    """While the block runs, vLLM's launcher of engine cores takes its processes from `context` (None: vLLM's own)."""
    if context is None:
        yield
        return
    import vllm.v1.engine.utils as launcher

    own = launcher.get_mp_context
    launcher.get_mp_context = lambda: context
    try:
        yield
    finally:
        launcher.get_mp_context = own
