"""What else ran on the measured CPUs while a trial replayed: the machine's time taken by other processes and by the
hypervisor (steal), against the time its own engine and client took.

A rate at the limit is a statement about the engine; a replay while another program takes a core measures the two
together. On the 2-core Xeon, 80 s of unit tests beside a confirmation run put vLLM's defaults at 79.5 req/s where
their other rounds read 96-111, and 100 s more put a candidate at 47.5 against 96-115: one such run widened its
pair's per-round gain interval to +-19 points. Nothing in the run's own numbers tells such a run from a slow engine;
the machine's counters do.

The CPUs watched are those this process tree may run on (the engine's worker, its engine core and the client); the
processes' time of those CPUs in /proc/stat (user, nice, system) less the CPU time of this process and its
descendants is the others' share; steal is the hypervisor's; interrupts (irq, softirq: a served run's loopback TCP)
are no one's, and count only as time the CPUs were not idle. Both are reported in cores (seconds per second of the
replay). Linux only: elsewhere, or where /proc/stat cannot be read, the record says `available: false`.

`disturbed` is the rule the confirmation re-runs a run by (search/confirmed.py): a quarter of a core or more taken
by others (their processes and steal), on average over the replays, while the CPUs had less than that left idle. On
the 2-core Xeon, runs with nothing else running read 0.004-0.031 cores of others, and a one-thread busy loop beside
them 0.84.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

DISTURBED_CORES = 0.25  # others' share (their processes and steal), in cores over the replays, that re-runs a run
TASK_FIELDS = (0, 1, 2)  # /proc/stat: user, nice, system: processes' time, as their own CPU times count it
IRQ_FIELDS = (5, 6)  # irq, softirq: the kernel's (a served run's loopback TCP), no process's: not the others'
STEAL_FIELD = 7


def cpu_seconds(stat_text: str, cpus: Iterable[int], hz: float) -> tuple[float, float, float]:
    """Pure: (processes', interrupts', steal) seconds of `cpus` from the text of /proc/stat, its counters in 1/`hz`
    s. A ValueError when none of `cpus` has a line (a container's /proc/stat that numbers them otherwise)."""
    wanted = {f"cpu{c}" for c in cpus}
    task = irq = steal = found = 0
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            values = [int(v) for v in fields[1:]]
            task += sum(values[i] for i in TASK_FIELDS if i < len(values))
            irq += sum(values[i] for i in IRQ_FIELDS if i < len(values))
            steal += values[STEAL_FIELD] if len(values) > STEAL_FIELD else 0
            found += 1
    if wanted and not found:
        raise ValueError(f"/proc/stat has no line for CPUs {sorted(cpus)}")
    return task / hz, irq / hz, steal / hz


def load_summary(wall_s: float, task_s: float, steal_s: float, own_s: float, cpus: Iterable[int],
                 irq_s: float = 0.0) -> dict[str, Any]:
    """Pure: the record of one trial's replays from the deltas of its CPUs' process, steal and interrupt seconds and
    of its own processes' CPU seconds over `wall_s`: the others' share, the steal and the CPUs left idle, in cores
    (never below 0: the counters' ticks)."""
    cpus = sorted(cpus)
    others_s = max(task_s - own_s, 0.0)
    per_s = 1 / wall_s if wall_s > 0 else 0.0
    idle = max(len(cpus) - (task_s + irq_s + steal_s) * per_s, 0.0)
    return {"available": True, "cpus": cpus, "wall_s": round(wall_s, 3), "own_cpu_s": round(own_s, 3),
            "others_cpu_s": round(others_s, 3), "steal_s": round(steal_s, 3),
            "others_cores": round(others_s * per_s, 3), "steal_cores": round(steal_s * per_s, 3),
            "idle_cores": round(idle, 3)}


def disturbed(summary: dict[str, Any] | None, cores: float = DISTURBED_CORES) -> bool:
    """Pure: True when others took `cores` or more of the measured CPUs over the replays (other processes' time and
    the hypervisor's steal) while the CPUs had less than `cores` left idle: on a machine of many cores, what a
    neighbour runs on cores the trial leaves idle takes nothing from it. False where nothing was measured."""
    if not summary or not summary.get("available"):
        return False
    if float(summary.get("idle_cores", 0.0)) >= cores:  # records without it: as if none was idle
        return False
    return float(summary.get("others_cores", 0.0)) + float(summary.get("steal_cores", 0.0)) >= cores


def disturbance_text(summary: dict[str, Any] | None) -> str:
    """'other processes took 0.93 of a core, the hypervisor 0.01' ('' where nothing was measured)."""
    if not summary or not summary.get("available"):
        return ""
    return (f"other processes took {summary['others_cores']:.2f} of a core, the hypervisor "
            f"{summary['steal_cores']:.2f}")


def _unavailable(exc: BaseException) -> dict[str, Any]:
    return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def _tree_cpu_s(pid: int) -> tuple[float, set[int]]:
    """CPU seconds (user + system) of process `pid` and its descendants, those they have waited for included (a
    child that ended between two readings), and the CPUs they may run on."""
    import psutil

    total, cpus = 0.0, set()
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
            cpus.update(p.cpu_affinity() or ())
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue
    return total, cpus


class MachineLoad:
    """`with MachineLoad(): ...replays...`, then `summary()`: what others took of the CPUs this process tree runs on
    while it ran. The clock and the readers are passed in for tests; by default the monotonic clock, /proc/stat and
    psutil on this process."""

    def __init__(self, clock: Callable[[], float] | None = None, read_stat: Callable[[], str] = _read_stat,
                 tree: Callable[[int], tuple[float, set[int]]] = _tree_cpu_s, pid: int | None = None,
                 hz: float | None = None, virtual_time: bool = False) -> None:
        import time

        self.clock = clock or time.monotonic
        self.read_stat, self.tree, self.pid = read_stat, tree, os.getpid() if pid is None else pid
        self.hz = hz if hz is not None else float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._start: tuple[float, float, float, float, float, set[int]] | None = None
        self._summary: dict[str, Any] = {"available": False, "reason": "not measured"}
        # an engine that serves in virtual time (the simulator) measures no wall clock: nothing can disturb it
        self.virtual_time = virtual_time

    def _sample(self, cpus: set[int] | None = None) -> tuple[float, float, float, float, float, set[int]]:
        own_s, mine = self.tree(self.pid)
        watched = cpus if cpus is not None else mine
        task_s, irq_s, steal_s = cpu_seconds(self.read_stat(), watched, self.hz)
        return self.clock(), task_s, irq_s, steal_s, own_s, watched

    def __enter__(self) -> MachineLoad:
        if self.virtual_time:
            self._summary = {"available": False, "reason": "the engine serves in virtual time"}
            return self
        try:
            self._start = self._sample()
        except (OSError, ValueError, ImportError) as exc:  # no /proc/stat (not Linux), no psutil
            self._summary = _unavailable(exc)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._start is None:
            return
        try:
            t0, task0, irq0, steal0, own0, cpus = self._start
            t1, task1, irq1, steal1, own1, _ = self._sample(cpus)
        except (OSError, ValueError, ImportError) as exc_:
            self._summary = _unavailable(exc_)
            return
        self._summary = load_summary(t1 - t0, task1 - task0, steal1 - steal0, own1 - own0, cpus, irq1 - irq0)

    def summary(self) -> dict[str, Any]:
        return dict(self._summary)
