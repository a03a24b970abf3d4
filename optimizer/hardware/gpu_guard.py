"""A GPU another program computes on is not measured on: NVML's compute processes on a trial's GPUs that are not
this study's engines (`foreign_processes`) are waited for, then the run stops with one line naming them
(`wait_until_unused`). A config is never pruned as out of memory for memory another program holds."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError
from optimizer.hardware.gpu_pool import PoolGpu


class GpuInUseError(OptimizerError):
    """A reserved GPU stays in use by a program that is not this study's: the run stops, nothing is pruned."""


@dataclass(frozen=True)
class ForeignProcess:
    gpu_index: int
    pid: int
    name: str
    used_bytes: int

    def describe(self) -> str:
        held = f", {self.used_bytes / 1024**3:.1f} GiB" if self.used_bytes else ""
        return f"pid {self.pid} ({self.name}{held}) on GPU {self.gpu_index}"


def foreign_processes(nvml: Any, gpus: Sequence[PoolGpu], ours: Callable[[int], bool]) -> list[ForeignProcess]:
    """The compute processes NVML lists on `gpus` that `ours` does not claim (this study's engines); [] where
    NVML cannot list them."""
    found: list[ForeignProcess] = []
    try:
        nvml.nvmlInit()
    except Exception:
        return []
    try:
        for gpu in gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                continue
            for p in procs:
                pid = int(p.pid)
                if ours(pid):
                    continue
                name = _process_name(nvml, pid)
                used = getattr(p, "usedGpuMemory", None)  # NVML_VALUE_NOT_AVAILABLE (all ones) where it cannot say
                known = isinstance(used, int) and used < 2**63
                found.append(ForeignProcess(gpu.index, pid, name, used if known else 0))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return found


async def wait_until_unused(nvml: Any, gpus: Sequence[PoolGpu], ours: Callable[[int], bool], wait_s: float,
                            poll_s: float, now_s: Callable[[], float],
                            sleep: Callable[[float], Any] = asyncio.sleep) -> None:
    """Return once no other program computes on `gpus`; past `wait_s`, GpuInUseError naming them and the fix."""
    deadline = now_s() + wait_s
    while True:
        others = foreign_processes(nvml, gpus, ours)
        if not others:
            return
        if now_s() >= deadline:
            listed = "; ".join(p.describe() for p in others)
            raise GpuInUseError(f"another program uses a GPU this study was given: {listed}: stop it, or leave its "
                                f"GPU out with --gpus (waited {wait_s:.0f} s; no config was pruned for it)")
        await sleep(poll_s)


def of_this_process(pid: int) -> bool:
    """Whether `pid` is this process or one it started (an engine of this study's trial, still exiting)."""
    import psutil

    if pid == os.getpid():
        return True
    try:
        return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def _process_name(nvml: Any, pid: int) -> str:
    """The process's name as NVML reports it ("unknown" where it cannot say)."""
    try:
        name = nvml.nvmlSystemGetProcessName(pid)
    except Exception:
        return "unknown"
    text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    return Path(text).name or "unknown"
