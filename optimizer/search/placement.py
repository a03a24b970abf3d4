"""Where a trial runs, under `--gpus`: its layout's GPUs reserved from the study's pool (hardware/gpu_pool.py) once
no other program computes on them (hardware/gpu_guard.py), the trial run on exactly them and their cores, and the
GPUs stored with the trial when they are given back."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from optuna.trial import FrozenTrial

from optimizer.hardware.device import nvml_module
from optimizer.hardware.gpu_guard import of_this_process, wait_until_unused
from optimizer.hardware.gpu_pool import GpuPool, PoolTooSmallError, Reservation
from optimizer.search.attrs import GPUS


async def reserve(pool: GpuPool, needed: int, nvml: Any, wait_s: float, poll_s: float,
                  now_s: Callable[[], float]) -> Reservation:
    """`needed` GPUs of `pool`, as close as the free ones allow (waiting for other trials to give some back), once no
    other program computes on them: GpuInUseError past `wait_s` (the run stops, nothing is pruned);
    PoolTooSmallError where the pool has fewer."""
    if needed > pool.size:
        raise PoolTooSmallError(f"its layout needs {needed} GPUs; the study's --gpus gives it {pool.size}")
    held = await pool.reserve(needed, poll_s=poll_s)
    try:
        if not pool.topology.logical:
            await wait_until_unused(nvml or nvml_module(), held.gpus, of_this_process, wait_s, poll_s, now_s)
    except BaseException:
        held.release()
        raise
    return held


@contextlib.contextmanager
def on_gpus(held: Reservation | None, logical: bool, record: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Run on `held` (nothing without a reservation): its GPUs and cores applied, then given back, and `record`ed
    when they were taken and when given back."""
    if held is None:
        yield
        return
    record(held.to_json())
    try:
        with held.applied(logical=logical):
            yield
    finally:
        held.release()
        record(held.to_json())


def gpus_text(trial: FrozenTrial) -> str:
    """' on GPUs 0,1' for a trial the study's pool gave GPUs (--gpus), ' on GPUs 0,1 of HOST' on a cluster (--ray);
    '' otherwise."""
    held = GPUS.of(trial)
    if not held:
        return ""
    indices = held.get("indices") or []
    host = f" of {held['host']}" if held.get("host") else ""
    return f" on GPU{'s' * (len(indices) != 1)} {','.join(str(i) for i in indices)}{host}"
