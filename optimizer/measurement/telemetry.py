"""GPU telemetry during a trial's replays, through NVML: utilization and memory, sampled every ~0.5 s.

NVML is passed in (the `pynvml` module of `nvidia-ml-py` by default), so tests script it. Without a GPU, without
NVML or when trials run on the CPU, the trial records `{"available": false, "reason": ...}`: never an error.
Sampling runs in a thread: NVML calls are blocking C calls and must not delay the replay's sends.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType
from typing import Any

from optimizer.hardware.device import MIG_PREFIX, visible_indices, visible_mig

GIB = 1024**3


def device_handle(nvml: Any) -> Any:
    """NVML's handle of the GPU this process uses: the first CUDA sees under CUDA_VISIBLE_DEVICES (GPU 0 when it is
    unset; an index, a UUID or its prefix: `hardware.device.visible_indices`; a MIG instance by its UUID:
    `visible_mig`). A LookupError where CUDA would see none.

    NVML numbers devices physically and ignores CUDA_VISIBLE_DEVICES; a worker started with
    CUDA_VISIBLE_DEVICES=1 must watch device 1, not 0.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.startswith(MIG_PREFIX):
        mig = visible_mig(visible)
        if mig is None:
            raise LookupError(f"CUDA_VISIBLE_DEVICES={visible!r} names a MIG instance twice: CUDA sees none")
        return nvml.nvmlDeviceGetHandleByUUID(mig)
    count = int(nvml.nvmlDeviceGetCount())
    uuids = [str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
    indices = visible_indices(visible, uuids)
    if not indices:
        raise LookupError(f"CUDA_VISIBLE_DEVICES={visible!r} names none of the "
                          f"{count} GPUs NVML sees")
    return nvml.nvmlDeviceGetHandleByIndex(indices[0])


def _nvml(nvml: Any | None) -> Any:
    if nvml is not None:
        return nvml
    import pynvml

    return pynvml


class GpuTelemetry:
    """Samples one GPU's utilization and memory. `with GpuTelemetry(...) as t:` samples in a thread meanwhile."""

    def __init__(self, nvml: Any | None = None, interval_s: float = 0.5, enabled: bool = True,
                 disabled_reason: str = "") -> None:
        self._nvml_arg = nvml
        self._nvml: Any = None
        self.interval_s = interval_s
        self._handle: Any = None
        self.device_name = ""
        self.memory_total_bytes = 0
        self.reason = "" if enabled else (disabled_reason or "disabled")
        self.mig = False  # the device is a MIG instance (CUDA_VISIBLE_DEVICES=MIG-...): memory only
        self.utilization_pct: list[float] = []
        self.memory_used_bytes: list[int] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def open(self) -> bool:
        """Initialise NVML and find the device; False (with `reason`) when there is none."""
        if self.reason:
            return False
        try:
            self._nvml = _nvml(self._nvml_arg)
            self._nvml.nvmlInit()
        except Exception as exc:  # no module, no driver, no GPU: all mean "no telemetry"
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
            self._nvml = None
            return False
        try:
            handle = device_handle(self._nvml)
            name = self._nvml.nvmlDeviceGetName(handle)
            self.device_name = name.decode() if isinstance(name, bytes) else str(name)
            self.memory_total_bytes = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total)
            self.mig = (os.environ.get("CUDA_VISIBLE_DEVICES") or "").startswith(MIG_PREFIX)
            self._handle = handle
        except Exception as exc:
            self.reason = f"no GPU visible to NVML: {type(exc).__name__}: {exc}"
            self.close()
            return False
        return True

    def sample(self) -> None:
        """One reading; a failed reading is counted, never raised. A MIG instance's memory is read without its
        utilization: NVML reads none on MIG-enabled GPUs (its documentation of nvmlDeviceGetUtilizationRates), and
        the memory alone is still the reading that says how close a config came to running out of it."""
        if self._handle is None:
            return
        try:
            util = None if self.mig else self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception:
            self.errors += 1
            return
        if util is not None:
            self.utilization_pct.append(float(util.gpu))
        self.memory_used_bytes.append(int(mem.used))

    def close(self) -> None:
        self._handle = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None

    def summary(self) -> dict[str, Any]:
        """What the trial stores as its `telemetry` user attribute."""
        if not self.memory_used_bytes and self.reason:
            return {"available": False, "reason": self.reason}
        n, u = len(self.memory_used_bytes), len(self.utilization_pct)
        return {
            "available": True,
            "device": self.device_name,
            "samples": n,
            "sample_errors": self.errors,
            "interval_s": self.interval_s,
            "utilization_mean_pct": round(sum(self.utilization_pct) / u, 2) if u else None,
            "utilization_max_pct": max(self.utilization_pct, default=None),
            "memory_used_max_gib": round(max(self.memory_used_bytes) / GIB, 3) if n else None,
            "memory_total_gib": round(self.memory_total_bytes / GIB, 3),
            **({"utilization": "not read: NVML reads none of a MIG instance"} if self.mig else {}),
        }

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> GpuTelemetry:
        if self.open():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)
            self._thread = None
        handle_was_open = self._handle is not None
        self.close()
        if handle_was_open and not self.memory_used_bytes:
            self.reason = "no sample succeeded"


def for_device(device: str, nvml: Any | None = None, interval_s: float = 0.5) -> GpuTelemetry:
    """Telemetry for the device trials run on: NVML on cuda; on the CPU build, recorded as unavailable."""
    if device != "cuda":
        return GpuTelemetry(enabled=False, disabled_reason=f"trials run on {device}: no GPU telemetry")
    return GpuTelemetry(nvml=nvml, interval_s=interval_s)
