"""A host's GPUs as a pool that concurrent trials reserve from: each trial gets as many GPUs as its layout needs,
close together, and no GPU serves two trials at once.

- **Which GPUs** (`parse_gpus`): `--gpus all`, a count (`4`: the first four), or indices (`0-3,6`).
- **How close** (`Topology`): NVML's view of the host, read once (`read_topology`): GPUs joined by NVLink are
  closest; otherwise the PCIe/CPU level of their common ancestor (`nvmlDeviceGetTopologyCommonAncestor`: the same
  switch, host bridge, NUMA node, or across the CPU interconnect). Each GPU's NUMA node and the cores NVML calls
  close to it (`nvmlDeviceGetCpuAffinity`) give a trial on it its share of cores.
- **Which group** (`choose_group`, pure): among the free GPUs, the group of the size asked whose farthest pair is
  closest; ties go to the group on the fewest NUMA nodes, then the lowest indices.
- **Held by whom** (`GpuPool`): a lock file per GPU (`flock`), taken while a pool-wide lock is held, so that
  processes of one study, and separate `optimize` runs on the host, never pick the same GPU; a process that dies
  releases its locks with it, so nothing is left to clean.

A GPU another program computes on is found by hardware/gpu_guard.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError, UsageError

NVLINK = 0  # the distance of two GPUs joined by NVLink: closer than any PCIe path
# NVML's farthest topology level (nvmlGpuTopologyLevel_t: 10 one board, 20 PCIe switches, 30 a host bridge, 40 one
# NUMA node, 50 across the CPU interconnect): what an unknown pair counts as
ACROSS_HOST = 50
P2P_CAPS_INDEX_NVLINK, P2P_STATUS_OK = 2, 0  # nvmlGpuP2PCapsIndex_t's NVLink, nvmlGpuP2PStatus_t's OK
POOL_LOCK = "pool.lock"


@dataclass(frozen=True)
class PoolGpu:
    """One GPU of the pool: its index (as `nvidia-smi` numbers it; a logical GPU's number), UUID, NUMA node (-1:
    unknown) and the cores close to it."""

    index: int
    uuid: str
    numa_node: int = -1
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Topology:
    """The pool's GPUs and the distance of each pair (`distances[(a, b)]` with a < b, by index; NVLINK, or an NVML
    topology level). `logical`: GPUs the simulated engine pretends to have, which NVML and CUDA know nothing of."""

    gpus: tuple[PoolGpu, ...]
    distances: Mapping[tuple[int, int], int] = field(default_factory=dict)
    logical: bool = False

    def distance(self, a: int, b: int) -> int:
        if a == b:
            return NVLINK
        return self.distances.get((min(a, b), max(a, b)), ACROSS_HOST)

    def by_index(self, index: int) -> PoolGpu:
        return next(g for g in self.gpus if g.index == index)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    def subset(self, indices: Iterable[int]) -> Topology:
        """These GPUs of the topology alone (the ones a cluster scheduler gave a task)."""
        keep = set(indices)
        return Topology(tuple(g for g in self.gpus if g.index in keep),
                        {k: d for k, d in self.distances.items() if keep.issuperset(k)}, self.logical)


def parse_gpus(spec: str, count: int) -> list[int]:
    """The GPU indices `spec` names on a host of `count` GPUs: "all"; a count ("4": the first four); indices and
    ranges ("0-3,6"). A UsageError naming the fix for anything else, or a GPU the host lacks."""
    text = spec.strip().lower()
    if text == "all":
        chosen = list(range(count))
    elif re.fullmatch(r"\d+", text):
        n = int(text)
        if not 1 <= n <= count:
            raise UsageError(f"--gpus {spec}: this host has {count} GPU{'s' * (count != 1)}: ask for 1 to {count}, "
                             f"or 'all'")
        chosen = list(range(n))
    elif re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text.replace(" ", "")):
        chosen = []
        for part in text.replace(" ", "").split(","):
            low, _, high = part.partition("-")
            first, last = int(low), int(high or low)
            if last < first:
                raise UsageError(f"--gpus {spec}: the range {part} runs backwards: write {last}-{first}")
            chosen.extend(i for i in range(first, last + 1) if i not in chosen)
        missing = [i for i in chosen if i >= count]
        if missing:
            raise UsageError(f"--gpus {spec}: this host has no GPU {missing[0]} (its GPUs are 0-{count - 1}): "
                             f"name GPUs it has, or 'all'")
    else:
        raise UsageError(f"--gpus {spec!r} is not a GPU list: write 'all', a count (4), or indices (0-3,6)")
    if not chosen:
        raise UsageError(f"--gpus {spec}: names no GPU: write 'all', a count, or indices")
    return chosen


def logical_topology(count: int, per_numa_node: int = 4, cpus: Sequence[int] = ()) -> Topology:
    """`count` logical GPUs for the simulated engine, laid out as an 8-GPU server: NVLink within groups of
    `per_numa_node`, each group on its own NUMA node, the host's cores split among the GPUs in turn."""
    gpus = tuple(PoolGpu(i, f"GPU-logical-{i:04d}", i // per_numa_node, tuple(cpus[i::count]) if cpus else ())
                 for i in range(count))
    distances = {(a, b): NVLINK if a // per_numa_node == b // per_numa_node else ACROSS_HOST
                 for a, b in itertools.combinations(range(count), 2)}
    return Topology(gpus, distances, logical=True)


def read_topology(indices: Iterable[int], nvml: Any, allowed_cpus: Iterable[int] | None = None) -> Topology:
    """The topology of the GPUs `indices` (physical, as `nvidia-smi` numbers them) as NVML reports it: NVLink
    where `nvmlDeviceGetP2PStatus` says NVLink works between two of them, else their common ancestor's level; each
    GPU's NUMA node and close cores (within `allowed_cpus`: this process's), the cores that several GPUs share split
    among them in turn so that concurrent trials do not share cores. What NVML cannot say is left unknown."""
    allowed = sorted(os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus)
    nvml.nvmlInit()
    try:
        handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        numa, close = {}, {}
        for i, h in handles.items():
            numa[i] = _or_default(lambda: int(nvml.nvmlDeviceGetNumaNodeId(h)), -1)
            close[i] = _or_default(lambda: _mask_cpus(nvml.nvmlDeviceGetCpuAffinity(h, _mask_words(allowed))), ())
        distances = {}
        for a, b in itertools.combinations(sorted(handles), 2):
            ha, hb = handles[a], handles[b]
            nvlink = _or_default(
                lambda: nvml.nvmlDeviceGetP2PStatus(ha, hb, P2P_CAPS_INDEX_NVLINK) == P2P_STATUS_OK, False)
            distances[(a, b)] = NVLINK if nvlink else \
                _or_default(lambda: int(nvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb)), ACROSS_HOST)
        uuids = {i: str(nvml.nvmlDeviceGetUUID(h)) for i, h in handles.items()}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    shares = share_cores({i: [c for c in close[i] if c in allowed] or allowed for i in handles})
    return Topology(tuple(PoolGpu(i, uuids[i], numa[i], shares[i]) for i in sorted(handles)), distances)


def share_cores(close: Mapping[int, Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """Pure: each GPU's own cores: the cores close to it, those that several GPUs share dealt out among them in turn
    (a GPU keeps at least one core)."""
    owners: dict[int, list[int]] = {}
    for gpu in sorted(close):
        for core in close[gpu]:
            owners.setdefault(core, []).append(gpu)
    groups: dict[tuple[int, ...], list[int]] = {}
    for core, gpus in sorted(owners.items()):
        groups.setdefault(tuple(gpus), []).append(core)
    mine: dict[int, list[int]] = {gpu: [] for gpu in close}
    for gpus, cores in groups.items():
        for k, core in enumerate(cores):
            mine[gpus[k % len(gpus)]].append(core)
    return {gpu: tuple(sorted(cores or close[gpu][:1])) for gpu, cores in mine.items()}


def choose_group(topology: Topology, free: Iterable[int], size: int) -> tuple[int, ...] | None:
    """Pure: `size` of the `free` GPUs, as close as the topology allows: the group whose farthest pair is nearest,
    then the one on the fewest NUMA nodes, then the smallest sum of distances, then the lowest indices. None when
    fewer are free."""
    free = sorted(set(free))
    if size < 1 or len(free) < size:
        return None
    numa = {g.index: g.numa_node for g in topology.gpus}

    def key(group: tuple[int, ...]) -> tuple[int, int, int, tuple[int, ...]]:
        pairs = [topology.distance(a, b) for a, b in itertools.combinations(group, 2)]
        return max(pairs, default=0), len({numa.get(i, -1) for i in group}), sum(pairs), group

    if math.comb(len(free), size) <= 50_000:
        return min(itertools.combinations(free, size), key=key)
    best = None  # a pool too large to try every group: grow one greedily from each start, keep the best
    for start in free:
        group = [start]
        while len(group) < size:
            group.append(min((i for i in free if i not in group),
                             key=lambda i: (max(topology.distance(i, j) for j in group), i)))
        candidate = tuple(sorted(group))
        best = candidate if best is None or key(candidate) < key(best) else best
    return best


@dataclass
class Reservation:
    """GPUs held for one trial until `release`: their pool entries, the environment that shows the engine exactly
    them (CUDA_VISIBLE_DEVICES by UUID, in the chosen order), their cores, and when they were taken and given back
    (Unix seconds)."""

    gpus: tuple[PoolGpu, ...]
    _files: list[int] = field(default_factory=list, repr=False)
    reserved_unix_s: float = field(default_factory=time.time)
    released_unix_s: float | None = None
    host: str = ""  # the host, where a cluster runs trials on several (--ray): its name and node, 'name (node)'

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in self.gpus)}

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted({c for g in self.gpus for c in g.cpus}))

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    def describe(self) -> str:
        """'GPUs 0,1' / 'GPU 3'."""
        return f"GPU{'s' * (len(self.gpus) != 1)} {','.join(str(i) for i in self.indices)}"

    def to_json(self) -> dict[str, Any]:
        return {"indices": list(self.indices), "uuids": [g.uuid for g in self.gpus], "cpus": list(self.cpus),
                "reserved_unix_s": self.reserved_unix_s, "released_unix_s": self.released_unix_s,
                **({"host": self.host} if self.host else {})}

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)  # closing the file releases its flock
        self._files.clear()
        self.released_unix_s = self.released_unix_s or time.time()

    @contextlib.contextmanager
    def applied(self, environ: MutableMapping[str, str] = os.environ, logical: bool = False) -> Iterator[None]:
        """This process, and the engine processes it starts meanwhile, on exactly these GPUs (CUDA_VISIBLE_DEVICES;
        not for logical GPUs) and their cores (the CPU affinity, where the cores are this process's to give);
        both as they were afterwards."""
        before_env = environ.get("CUDA_VISIBLE_DEVICES")
        before_cpus = os.sched_getaffinity(0)
        cpus = set(self.cpus) & before_cpus
        try:
            if not logical:
                environ.update(self.env)
            if cpus:
                os.sched_setaffinity(0, cpus)
            yield
        finally:
            if cpus:
                os.sched_setaffinity(0, before_cpus)
            if not logical:
                if before_env is None:
                    environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    environ["CUDA_VISIBLE_DEVICES"] = before_env


class PoolTooSmallError(OptimizerError):
    """A layout needs more GPUs than the pool has."""


def default_lock_dir() -> Path:
    """Where the host's GPU locks live (OPTIMIZER_GPU_LOCKS, else the system's temporary directory), shared by every
    `optimize` process on the host."""
    return Path(os.environ.get("OPTIMIZER_GPU_LOCKS") or Path(tempfile.gettempdir()) / "optimizer-gpu-locks")


@dataclass
class GpuPool:
    """The GPUs trials of this process reserve from (`reserve`); `lock_dir` is shared by every process that must
    not pick the same GPU."""

    topology: Topology
    lock_dir: Path = field(default_factory=default_lock_dir)
    host: str = ""  # recorded with each reservation, where trials run on several hosts (--ray)

    @property
    def size(self) -> int:
        return len(self.topology.gpus)

    def describe(self) -> str:
        """'4 GPUs (0,1,2,3)' / '8 logical GPUs'."""
        if self.topology.logical:
            return f"{self.size} logical GPU{'s' * (self.size != 1)}"
        return f"{self.size} GPU{'s' * (self.size != 1)} ({','.join(str(i) for i in self.topology.indices)})"

    def try_reserve(self, size: int) -> Reservation | None:
        """`size` GPUs now, as close as the free ones allow; None when fewer are free."""
        if size > self.size:
            raise PoolTooSmallError(f"needs {size} GPUs, the pool has {self.size}")
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        pool_fd = os.open(self.lock_dir / POOL_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(pool_fd, fcntl.LOCK_EX)
            held: dict[int, int] = {}
            for gpu in self.topology.gpus:
                fd = os.open(self.lock_dir / f"{gpu.uuid}.lock", os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                held[gpu.index] = fd
            group = choose_group(self.topology, held, size)
            for index, fd in held.items():
                if group is None or index not in group:
                    os.close(fd)
            if group is None:
                return None
            return Reservation(tuple(self.topology.by_index(i) for i in group), [held[i] for i in group],
                               host=self.host)
        finally:
            os.close(pool_fd)

    async def reserve(self, size: int, poll_s: float = 1.0,
                      sleep: Callable[[float], Any] = asyncio.sleep) -> Reservation:
        """`size` GPUs, waiting for other trials to give some back."""
        while True:
            got = self.try_reserve(size)
            if got is not None:
                return got
            await sleep(poll_s)


def pool_for(spec: str, logical: bool, logical_lock_dir: Path, nvml: Any | None = None) -> GpuPool:
    """The pool `--gpus spec` names: `logical` (the simulated engine), that many logical GPUs, locked in
    `logical_lock_dir` (the study's: no other run has them); else the GPUs NVML reads that this process may use,
    by their position among them (CUDA_VISIBLE_DEVICES applied), locked host-wide. A UsageError naming the fix for a
    spec that names none."""
    from optimizer.hardware.device import nvml_module, visible_gpus

    if logical:
        if not re.fullmatch(r"\s*\d+\s*", spec) or int(spec) < 1:
            raise UsageError(f"--gpus {spec!r}: with --engine sim, give the number of logical GPUs, e.g. --gpus 8")
        return GpuPool(logical_topology(int(spec)), logical_lock_dir)
    gpus = visible_gpus(nvml)
    if not gpus:
        raise UsageError(f"--gpus {spec}: NVML reads no GPU this process may use: leave out --gpus, check the driver "
                         f"and CUDA_VISIBLE_DEVICES, or simulate with --engine sim --gpus 8")
    chosen = parse_gpus(spec, len(gpus))
    return GpuPool(read_topology([gpus[i].index for i in chosen], nvml_module(nvml)))


def _or_default(read: Callable[[], Any], default: Any) -> Any:
    try:
        return read()
    except Exception:
        return default


def _mask_words(cpus: Sequence[int]) -> int:
    """64-bit words of an affinity mask that covers `cpus`."""
    return max(cpus, default=0) // 64 + 1


def _mask_cpus(words: Sequence[int]) -> tuple[int, ...]:
    """The cores set in an NVML affinity mask (a sequence of 64-bit words, lowest cores first)."""
    return tuple(64 * w + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1)
