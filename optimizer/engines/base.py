"""The Engine protocol, owned by its caller (replay and objective).

Lifecycle: `validate(params)` (cheap, optional) -> `start(params)` once -> any number of `generate` and `reset_prefix_cache` -> `shutdown()` once,
which must leave no process behind. `generate` yields, per output chunk, how many new tokens it carried.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from optimizer.workload import Request


@runtime_checkable
class Engine(Protocol):
    """An engine that serves token-id requests with one trial's parameters."""

    def validate(self, params: dict[str, Any]) -> None:
        """Check `params` as the engine would at start, without starting it; raise EngineStartError if invalid."""
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

    @property
    def pids(self) -> list[int]:
        """Process ids this engine started (empty for in-thread engines)."""
        ...


EngineFactory = Callable[[], Engine]
