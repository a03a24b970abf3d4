"""A circuit breaker for engine starts that fail because of the machine, not the config.

A CUDA context initialized before vLLM forked its engine core, a missing shared library, no visible GPU: every
config fails the same way, and without a breaker the study prunes trial after trial until its budget is spent (and
its baseline, pruned, is never measured). After `STREAK_LIMIT` consecutive starts that fail with the same
environment cause, the run stops with the log's excerpt and the fix. Those pruned trials do not count as
measurements of vLLM's defaults (`is_environment_failure`): the baseline is queued again on the next run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from optimizer.core.errors import OptimizerError
from optimizer.search.attrs import ENVIRONMENT_CAUSE

STREAK_LIMIT = 3  # consecutive starts failing with one environment cause


@dataclass(frozen=True)
class EnvironmentCause:
    """A start failure that no engine config can fix, and what fixes it."""

    name: str
    pattern: re.Pattern[str]
    what: str
    fix: str


CAUSES = [
    EnvironmentCause("cuda_initialized_before_fork", re.compile(
        r"Cannot re-initialize CUDA in forked subprocess|CUDA error: initialization error|"
        r"cudaErrorInitializationError|CUDA initialization: .*(error|failed)", re.IGNORECASE),
        "CUDA was initialized in the parent process before vLLM forked its engine core",
        "do not touch torch.cuda before the study starts (optimize detects GPUs through NVML), or set "
        "VLLM_WORKER_MULTIPROC_METHOD=spawn; then run the same command again to resume"),
    EnvironmentCause("no_gpu", re.compile(
        r"No CUDA GPUs are available|no CUDA-capable device is detected|Found no NVIDIA driver|"
        r"NVIDIA driver on your system is too old|CUDA driver version is insufficient", re.IGNORECASE),
        "the engine finds no usable GPU or driver",
        "check `nvidia-smi` and CUDA_VISIBLE_DEVICES (in docker: --gpus all), or install the CPU build and pass "
        "--device cpu; then run the same command again to resume"),
    EnvironmentCause("missing_library", re.compile(
        r"cannot open shared object file|undefined symbol|ModuleNotFoundError|"
        r"ImportError: .*(\.so|DLL|No module named)|operator \S+ does not exist", re.IGNORECASE),
        "a library vLLM needs is missing or built for another torch",
        "reinstall into a fresh environment with ./install.sh cpu (or ./install.sh cuda on a GPU host); then run "
        "the same command again to resume"),
    EnvironmentCause("nccl", re.compile(r"NCCL error|ncclSystemError|ncclInternalError|ncclUnhandledCudaError"),
        "NCCL cannot set up communication between the GPUs",
        "run with NCCL_DEBUG=INFO to see why; in docker give the container --ipc=host (or a large --shm-size); "
        "then run the same command again to resume"),
]


def environment_cause(text: str) -> EnvironmentCause | None:
    """The environment cause a failed start's log (or error text) shows, if any."""
    for cause in CAUSES:
        if cause.pattern.search(text):
            return cause
    return None


def is_environment_failure(trial: Any) -> bool:
    """A trial pruned because its engine could not start on this machine: it measured nothing of its config."""
    return bool(ENVIRONMENT_CAUSE.of(trial))


class EnvironmentBrokenError(OptimizerError):
    """Engine starts keep failing for a reason outside the config: the run stops (exit code 1)."""


def excerpt(log_text: str, lines: int = 12) -> str:
    """The log's last lines that say something (tracebacks' tails are where the cause is)."""
    kept = [ln.rstrip() for ln in log_text.splitlines() if ln.strip()]
    return "\n".join(f"  | {ln[:300]}" for ln in kept[-lines:])


@dataclass
class StartFailureBreaker:
    """Counts consecutive starts that failed with the same environment cause; `observe` after every start."""

    limit: int = STREAK_LIMIT
    streak: int = 0
    cause: EnvironmentCause | None = None

    def observe(self, cause: EnvironmentCause | None) -> bool:
        """Record one start (None: it started, or failed because of its config); True when the breaker trips."""
        if cause is None:
            self.streak, self.cause = 0, None
            return False
        self.streak = self.streak + 1 if self.cause is not None and self.cause.name == cause.name else 1
        self.cause = cause
        return self.streak >= self.limit

    def error(self, trial_number: int, log_path: str, log_text: str) -> EnvironmentBrokenError:
        """The error that stops the run: the cause, the fix, then the log's excerpt."""
        assert self.cause is not None
        return EnvironmentBrokenError(
            f"{self.streak} engine starts in a row failed the same way, which no config can fix: "
            f"{self.cause.what}. Fix: {self.cause.fix}. Log of trial #{trial_number} ({log_path}):\n"
            + excerpt(log_text))
