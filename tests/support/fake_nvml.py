"""A scripted NVML whose answers have the types the real one returns (nvidia-ml-py's `pynvml`, NVML's C API).

Copied from NVML's documented return types, not invented: `nvmlDeviceGetMemoryInfo` returns a `c_nvmlMemory_t`
(total, free, used in bytes), `nvmlDeviceGetUtilizationRates` a `c_nvmlUtilization_t` (gpu, memory in percent),
`nvmlDeviceGetName`/`nvmlDeviceGetUUID` a `str` (pynvml decodes the C string), `nvmlDeviceGetCount` an `int`,
`nvmlSystemGetDriverVersion` a `str`, `nvmlDeviceGetCudaComputeCapability` a `(major, minor)` tuple of ints,
`nvmlDeviceGetIndex` an `int`, handles are `c_nvmlDevice_t` pointers (a MIG instance's too:
`nvmlDeviceGetHandleByUUID` takes its "MIG-" UUID, `nvmlDeviceGetDeviceHandleFromMigDeviceHandle` gives its parent
GPU's handle, and its utilization is NVML_ERROR_NOT_SUPPORTED, as NVML documents for MIG-enabled GPUs); failures
raise `pynvml.NVMLError` subclasses with NVML's return codes (NVML_ERROR_LIBRARY_NOT_FOUND from `nvmlInit` without
a driver, NVML_ERROR_INVALID_ARGUMENT for an index past the count, NVML_ERROR_NOT_FOUND for an
unknown UUID, NVML_ERROR_GPU_IS_LOST for a device that fell off the bus). Calls before `nvmlInit` raise
NVML_ERROR_UNINITIALIZED, as the library does. The topology functions answer as NVML's do: `nvmlDeviceGetP2PStatus`
an `nvmlGpuP2PStatus_t` value (0 OK), `nvmlDeviceGetTopologyCommonAncestor` an `nvmlGpuTopologyLevel_t` value,
`nvmlDeviceGetNumaNodeId` an `int`, `nvmlDeviceGetCpuAffinity` a ctypes array of 64-bit mask words,
`nvmlDeviceGetComputeRunningProcesses` a list of `c_nvmlProcessInfo_v3_t`, `nvmlSystemGetProcessName` the name (bytes
decoded to `str`, as pynvml's `convertStrBytes` does).
"""

from __future__ import annotations

import ctypes

import pynvml

GIB = 1024**3
MIG_HANDLES = 1000  # MIG instance k's handle is the pointer MIG_HANDLES + k + 1 (a physical GPU i's: i + 1)


class FakeNvml:
    """`devices`: (name, total bytes, compute capability) per physical GPU; `script`: (utilization %, used bytes)
    per reading of the watched device's memory, the last one repeated; after `lost_after_readings` readings
    the GPU is lost (NVML_ERROR_GPU_IS_LOST from every reading); `migs`: (parent GPU's index, name, total bytes) per
    MIG instance, found by `mig_uuid(k)`; `unreadable`: indices of GPUs whose handle NVML cannot get (lost);
    `nvlink`: groups of indices joined by NVLink; `numa`: each GPU's NUMA node (the level of two GPUs on one node is
    NODE, else SYSTEM); `affinity`: each GPU's close cores; `processes`: by index, (pid, name, used bytes) of the
    compute processes on it."""

    def __init__(self, devices=(("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0)),) * 8, script=((0, 0),),
                 fail_init: bool = False, lost_after_readings: int | None = None, migs=(), unreadable=(),
                 nvlink=(), numa=(), affinity=(), processes=None):
        self.nvlink = [set(g) for g in nvlink]
        self.numa, self.affinity = list(numa), [list(a) for a in affinity]
        self.processes = dict(processes or {})
        self.devices = list(devices)
        self.unreadable = set(unreadable)
        self.migs = list(migs)
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
        if index in self.unreadable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        self.handles.append(index)
        return self._handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        self._check()
        for i in range(len(self.devices)):
            if self.uuid(i) == uuid:
                self.handles.append(uuid)
                return self._handle(i)
        for k in range(len(self.migs)):
            if self.mig_uuid(k) == uuid:
                self.handles.append(uuid)
                return self._handle(MIG_HANDLES + k)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle):
        k = self._mig(handle)
        if k is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._handle(self.migs[k][0])

    def nvmlDeviceGetIndex(self, handle) -> int:
        if self._mig(handle) is not None:  # a MIG instance has no physical index of its own
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._index(handle)

    def nvmlDeviceGetName(self, handle) -> str:
        k = self._mig(handle)
        return self.devices[self._index(handle)][0] if k is None else self.migs[k][1]

    def nvmlDeviceGetUUID(self, handle) -> str:
        k = self._mig(handle)
        return self.uuid(self._index(handle)) if k is None else self.mig_uuid(k)

    def nvmlDeviceGetCudaComputeCapability(self, handle) -> tuple[int, int]:
        if self._mig(handle) is not None:  # not known to be read of an instance: the tool reads its parent's
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        major, minor = self.devices[self._index(handle)][2]
        return (major, minor)

    def nvmlDeviceGetMemoryInfo(self, handle) -> pynvml.c_nvmlMemory_t:
        k = self._mig(handle)
        total = self.devices[self._index(handle)][1] if k is None else self.migs[k][2]
        used = self._current()[1]
        self.readings += 1
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetUtilizationRates(self, handle) -> pynvml.c_nvmlUtilization_t:
        if self._mig(handle) is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._index(handle)
        return pynvml.c_nvmlUtilization_t(gpu=self._current()[0], memory=0)

    def nvmlDeviceGetP2PStatus(self, a, b, index) -> int:
        i, j = self._index(a), self._index(b)
        if index != pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        joined = any(i in g and j in g for g in self.nvlink)
        return pynvml.NVML_P2P_STATUS_OK if joined else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b) -> int:
        i, j = self._index(a), self._index(b)
        if not self.numa:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_TOPOLOGY_NODE if self.numa[i] == self.numa[j] else pynvml.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetNumaNodeId(self, handle) -> int:
        i = self._index(handle)
        if not self.numa:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.numa[i]

    def nvmlDeviceGetCpuAffinity(self, handle, words: int):
        i = self._index(handle)
        mask = (ctypes.c_ulonglong * words)()
        for core in self.affinity[i] if self.affinity else ():
            if core // 64 < words:
                mask[core // 64] |= 1 << (core % 64)
        return mask

    def nvmlDeviceGetComputeRunningProcesses(self, handle) -> list:
        i = self._index(handle)
        return [pynvml.c_nvmlProcessInfo_v3_t(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                              computeInstanceId=0xFFFFFFFF)
                for pid, _, used in self.processes.get(i, ())]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._check()
        for procs in self.processes.values():
            for p, name, _ in procs:
                if p == pid:
                    return name
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    # helpers
    @staticmethod
    def uuid(index: int) -> str:
        return f"GPU-{index:08x}-0000-0000-0000-000000000000"

    @staticmethod
    def mig_uuid(k: int) -> str:
        return f"MIG-{k:08x}-1111-2222-3333-444444444444"

    def _mig(self, handle) -> int | None:
        """The MIG instance a handle stands for, or None for a physical GPU's."""
        self._check()
        k = int(ctypes.cast(handle, ctypes.c_void_p).value) - 1 - MIG_HANDLES
        return k if 0 <= k < len(self.migs) else None

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
