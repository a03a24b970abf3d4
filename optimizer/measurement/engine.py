"""The Engine protocol, owned by its caller (replay and objective).

Lifecycle: `validate(params)` (cheap, no process started) -> `start(params)` once -> any number of `generate` and
`reset_prefix_cache` -> `shutdown()` once, which must leave no process behind. `generate` yields, per output chunk,
how many new tokens it carried. `process_refs` names every process the engine started, kept current during the start,
so that a run killed mid-trial can end them from the study's record. A measure-only engine (`measure_only`) measures
a server someone else runs: it takes no parameters, and its shutdown ends nothing.

Optional capabilities, each a protocol of its own that an engine implements or not: `ReportsEngineStats` (the
scheduler's own statistics) and `ServesInVirtualTime` (a whole replay served at once, the simulator).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from optimizer.config.resolved import Resolved
from optimizer.core.processes import ProcessRef
from optimizer.measurement.workload import Request


@runtime_checkable
class Engine(Protocol):
    """An engine that serves token-id requests with one trial's parameters."""

    def validate(self, params: dict[str, Any]) -> Resolved | None:
        """Check `params` as the engine would at start, without starting it; raise EngineStartError if invalid.
        Returns what the engine resolves for them where it can say (vLLM: config/resolved.py), else None."""
        ...

    async def start(self, params: dict[str, Any], log_path: Path | None = None) -> dict[str, Any]:
        """Start with `params` (engine keyword arguments). Returns the resolved engine configuration.

        Raises EngineStartError with a classified reason when the configuration cannot run.
        """
        ...

    def generate(self, request: Request) -> AsyncIterator[int]:
        """Serve one request; yield the number of new tokens of each output chunk as it arrives."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Forget cached prefixes so that the next replay starts cold."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine and every process it started. Safe to call twice or after a failed start."""
        ...

    measure_only: bool
    """True when the engine measures a server it did not start: `start` takes no parameters and `shutdown` ends
    nothing (the prefix-cache reset may be missing there: a replay is then measured warm, and says so)."""

    @property
    def pids(self) -> list[int]:
        """Process ids this engine started (empty for in-thread engines)."""
        ...

    @property
    def process_refs(self) -> list[ProcessRef]:
        """The processes this engine started, with their start times (a reused PID is not ours); empty for in-thread
        engines. Current during the start, so that a kill mid-start leaves them on record."""
        ...


EngineFactory = Callable[[], Engine]


@dataclass(frozen=True)
class RequestTiming:
    """The engine's own view of one request, from its scheduler's timestamps (seconds)."""

    queued_s: float  # waiting in the engine's queue: queued -> first scheduled
    prefill_s: float  # first scheduled -> first token (preemptions during prefill included)
    preemptions: int = 0


@dataclass
class EngineStats:
    """What the engine's scheduler saw since the last `take_engine_stats()`.

    Scheduler values are sampled once per engine step. `requests` is keyed by `Request.index`.
    """

    steps: int = 0
    running_peak: int = 0
    running_sum: int = 0  # over steps, for the mean
    waiting_peak: int = 0
    kv_usage_peak: float = 0.0  # fraction of the KV cache blocks in use, 0..1
    preemptions: int = 0
    max_num_seqs: int | None = None
    requests: dict[int, RequestTiming] = field(default_factory=dict)

    @property
    def running_mean(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0


@runtime_checkable
class ReportsEngineStats(Protocol):
    """Optional capability of an Engine: its own scheduler statistics and per-request timings.

    Engines that cannot see inside the scheduler (an HTTP server, a fake) simply do not implement it.
    """

    async def take_engine_stats(self) -> EngineStats:
        """The stats collected since the previous call (or the start), and start collecting afresh."""
        ...


@runtime_checkable
class ServesInVirtualTime(Protocol):
    """Optional capability of an Engine: serve a whole replay at once in modelled time (the simulator), with the
    records a real-time replay would give."""

    def simulate_replay(self, requests: list[Request] | tuple[Request, ...], arrivals_s: list[float]) -> list[Any]:
        """The replay's per-request records, times relative to its start."""
        ...
