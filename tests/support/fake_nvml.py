"""A scripted NVML whose answers have the types the real one returns (nvidia-ml-py's `pynvml`, NVML's C API).

Copied from NVML's documented return types, not invented: `nvmlDeviceGetMemoryInfo` returns a `c_nvmlMemory_t`
(total, free, used in bytes), `nvmlDeviceGetUtilizationRates` a `c_nvmlUtilization_t` (gpu, memory in percent),
`nvmlDeviceGetName`/`nvmlDeviceGetUUID` a `str` (pynvml decodes the C string), `nvmlDeviceGetCount` an `int`, `nvmlSystemGetDriverVersion` a `str`,
`nvmlDeviceGetCudaComputeCapability` a `(major, minor)` tuple of ints, handles are `c_nvmlDevice_t` pointers;
failures raise `pynvml.NVMLError` subclasses with NVML's return codes (NVML_ERROR_LIBRARY_NOT_FOUND from
`nvmlInit` without a driver, NVML_ERROR_INVALID_ARGUMENT for an index past the count, NVML_ERROR_NOT_FOUND for an
unknown UUID, NVML_ERROR_GPU_IS_LOST for a device that fell off the bus). Calls before `nvmlInit` raise
NVML_ERROR_UNINITIALIZED, as the library does.
"""

from __future__ import annotations

import ctypes

import pynvml

GIB = 1024**3


class FakeNvml:
    """`devices`: (name, total bytes, compute capability) per physical GPU; `script`: (utilization %, used bytes)
    per reading of the watched device's memory, the last one repeated; after `lost_after_readings` readings
    the GPU is lost (NVML_ERROR_GPU_IS_LOST from every reading)."""

    def __init__(self, devices=(("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0)),) * 8, script=((0, 0),),
                 fail_init: bool = False, lost_after_readings: int | None = None):
        self.devices = list(devices)
        self.script = list(script)
        self.fail_init, self.lost_after_readings = fail_init, lost_after_readings
        self.initialized = 0
        self.inits = self.shutdowns = 0
        self.readings = 0
        self.handles: list = []
        self.driver = "550.54.15"

    # the NVML functions the tool calls
    def nvmlInit(self):
        if self.fail_init:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.inits += 1
        self.initialized += 1

    def nvmlShutdown(self):
        self._check()
        self.shutdowns += 1
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int):
        self._check()
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self.handles.append(index)
        return self._handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        self._check()
        for i in range(len(self.devices)):
            if self.uuid(i) == uuid:
                self.handles.append(uuid)
                return self._handle(i)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle) -> str:
        return self.devices[self._index(handle)][0]

    def nvmlDeviceGetUUID(self, handle) -> str:
        return self.uuid(self._index(handle))

    def nvmlDeviceGetCudaComputeCapability(self, handle) -> tuple[int, int]:
        major, minor = self.devices[self._index(handle)][2]
        return (major, minor)

    def nvmlDeviceGetMemoryInfo(self, handle) -> pynvml.c_nvmlMemory_t:
        total = self.devices[self._index(handle)][1]
        used = self._current()[1]
        self.readings += 1
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetUtilizationRates(self, handle) -> pynvml.c_nvmlUtilization_t:
        self._index(handle)
        return pynvml.c_nvmlUtilization_t(gpu=self._current()[0], memory=0)

    # helpers
    @staticmethod
    def uuid(index: int) -> str:
        return f"GPU-{index:08x}-0000-0000-0000-000000000000"

    def _current(self):
        if self.lost_after_readings is not None and self.readings >= self.lost_after_readings:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.script[min(self.readings, len(self.script) - 1)]

    def _check(self):
        if self.initialized <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _index(self, handle) -> int:
        self._check()
        return int(ctypes.cast(handle, ctypes.c_void_p).value) - 1

    @staticmethod
    def _handle(index: int):
        return ctypes.cast(ctypes.c_void_p(index + 1), pynvml.c_nvmlDevice_t)  # an opaque pointer, never NULL
