"""On vLLM's CPU build, the engine core and the front end run on the CPUs the worker leaves free, not on its own.

vLLM binds each worker's OpenMP threads to CPUs of their own and keeps the rest out of the binding (at least one core
on x86, "reserved for the scheduler process"). It does not bind what runs there: the engine core, whose scheduler
busy-waits on the worker while a step runs, and the front end (AsyncLLM in this process, or the API server), beside
the client that drives it. The kernel places those where it likes; on a machine where they need more than the
reserved CPUs, it also runs them on the worker's CPU, and every step the worker shares it is a slower step. Measured
on a 2-core EPYC (docs/machines.md, "Where the engine core runs"): the worker had 86-98% of its core unbound and
99-100% bound; whole trials of vLLM's defaults on the demo's model, alternating, measured 52.5-67.0 req/s unbound
(CV 12%) and 66.5-74.2 bound (CV 5%).

So an engine's start binds its engine core and this process, every thread of both, to the CPUs the workers are
not bound to, and its shutdown gives this process back the CPUs it had. As served, the server starts on those CPUs
and its workers are bound by `VLLM_CPU_OMP_THREADS_BIND`: what a deployment writes to get the same layout
(`served_launch`).

As served, the engine core also runs at a lower priority than the API server and the client (SERVED_CORE_NICENESS):
while a step runs it waits on the worker's reply in a loop of `sched_yield()` (vLLM's shm_broadcast SpinCondition,
busy for a second after each read), and on the CPU it shares with them it starved both for up to seconds at a time:
vLLM's defaults on the demo's 4M model at 30 req/s, half their rate in process, read TTFT P99 80-5136 ms with stalls
of 1.8-10 s in 4 of 6 runs, and 41-71 ms in 6 of 6 with the core at nice 10 (docs/machines.md).
It still runs whenever they wait. In process the front end needs less: the same change measured no difference there,
so it is not made.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import psutil


def front_end_cpus(allowed: Iterable[int], worker_cpus: Sequence[Sequence[int]] | None) -> frozenset[int] | None:
    """The CPUs of `allowed` that no worker's OpenMP threads are bound to; None when there is nothing to separate:
    the binding is unknown (`worker_cpus` None) or off (empty), or the workers take every allowed CPU."""
    if not worker_cpus:
        return None
    bound = {cpu for cpus in worker_cpus for cpu in cpus}
    rest = frozenset(allowed) - bound
    return rest or None


def omp_bind_value(worker_cpus: Sequence[Sequence[int]]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for these lists, one per worker: [[0], [2, 3]] -> "0|2,3"."""
    return "|".join(",".join(str(cpu) for cpu in cpus) for cpus in worker_cpus)


def served_launch(allowed: Iterable[int], worker_cpus: Sequence[Sequence[int]] | None
                  ) -> tuple[frozenset[int], dict[str, str]] | None:
    """For a server started on this machine: the CPUs to start it on and the environment that binds its workers where
    vLLM would have bound them. None: nothing to separate (`front_end_cpus`)."""
    cpus = front_end_cpus(allowed, worker_cpus)
    if cpus is None or worker_cpus is None:
        return None
    return cpus, {"VLLM_CPU_OMP_THREADS_BIND": omp_bind_value(worker_cpus)}


# The engine core's nice value as served, beside the API server and the client on the CPUs the workers leave.
SERVED_CORE_NICENESS = 10


def bind_threads(pid: int, cpus: Iterable[int]) -> int:
    """Bind every thread of process `pid` to `cpus`; returns how many were bound (threads that ended meanwhile, or a
    process gone, are skipped). Threads the process starts later inherit the binding of the thread that starts them."""
    cpus = set(cpus)
    return _each_thread(pid, lambda tid: os.sched_setaffinity(tid, cpus))


def keep_off_workers(pids: Iterable[int], worker_cpus: Sequence[Sequence[int]] | None,
                     allowed: Iterable[int]) -> frozenset[int] | None:
    """Bind processes `pids` and this one to `front_end_cpus(allowed, worker_cpus)`; returns those CPUs, or None
    (nothing bound) when there is nothing to separate."""
    cpus = front_end_cpus(allowed, worker_cpus)
    if cpus is not None:
        for pid in (*pids, os.getpid()):
            bind_threads(pid, cpus)
    return cpus


def lower_priority(pid: int, niceness: int) -> int:
    """Give every thread of process `pid` the nice value `niceness`; returns how many were set (threads that ended
    meanwhile, or a process gone, are skipped). Threads it starts later inherit it from the thread that starts them."""
    return _each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, niceness))


def lower_engine_core(pids: Iterable[int]) -> list[int]:
    """Of processes `pids`, the engine cores (titled VLLM::EngineCore), each at SERVED_CORE_NICENESS; returns them."""
    lowered = []
    for pid in pids:
        try:
            if psutil.Process(pid).name() != "VLLM::EngineCore":
                continue
        except psutil.Error:  # gone meanwhile
            continue
        if lower_priority(pid, SERVED_CORE_NICENESS):
            lowered.append(pid)
    return lowered


def lowered_note(pid: int) -> str:
    """The trial log's line for an engine core `lower_engine_core` lowered, with the command that deploys the same."""
    return (f"optimizer: the engine core (pid {pid}) runs at nice {SERVED_CORE_NICENESS}, below the API server and "
            f"the client on its CPUs: it spins while it waits on the worker. To deploy the same: renice -n "
            f"{SERVED_CORE_NICENESS} -p $(pgrep -f VLLM::EngineCore)")


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """Each thread of `pid` and the CPUs it may run on (empty when the process is gone)."""
    out: dict[int, frozenset[int]] = {}
    for tid in _threads(pid):
        try:
            out[tid] = frozenset(os.sched_getaffinity(tid))
        except OSError:
            pass
    return out


def _each_thread(pid: int, act: Callable[[int], object]) -> int:
    """`act(tid)` on every thread of process `pid`; returns on how many it succeeded (a thread that ended meanwhile,
    or a process gone, raises OSError and is skipped)."""
    done = 0
    for tid in _threads(pid):
        try:
            act(tid)
            done += 1
        except OSError:
            pass
    return done


def _threads(pid: int) -> list[int]:
    """The thread ids of process `pid` (none when it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []
