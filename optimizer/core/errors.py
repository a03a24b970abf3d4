"""One exception hierarchy. Every error a user can cause says what to do next."""

from __future__ import annotations


class OptimizerError(Exception):
    """Base of every error this tool raises on purpose (exit code 1 unless a subclass says otherwise)."""

    exit_code = 1


class UsageError(OptimizerError):
    """Bad input from the user: a flag, a file, a URL. Exit code 2, nothing written."""

    exit_code = 2


class EngineStartError(OptimizerError):
    """The engine did not start with the given parameters; `reason` is a short classification."""

    def __init__(self, message: str, reason: str, log_excerpt: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.log_excerpt = log_excerpt


class EngineDiedError(OptimizerError):
    """The engine died or hung after its start: a process of it gone, or a call past its bound."""

    def __init__(self, message: str, reason: str = "engine_died") -> None:
        super().__init__(message)
        self.reason = reason
