"""Classify why an engine did not start or died, from the exception and the engine's own log.

The caller of vLLM only sees "Engine core initialization failed. See root cause above"; the root cause is in
the engine child's output, which each trial keeps in a log file.
"""

from __future__ import annotations

import re

OUT_OF_MEMORY = "out_of_memory"
INVALID_CONFIG = "invalid_config"
START_FAILED = "engine_start_failed"
ENGINE_DIED = "engine_died"
TIMEOUT = "timeout"

_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    (OUT_OF_MEMORY, re.compile(
        r"out of memory|OutOfMemoryError|less than requested memory for kv|Reduce CPU memory|"
        r"No available memory for the cache blocks|larger than the available KV cache memory|"
        r"Insufficient memory|Cannot allocate memory|MemoryError|KV cache memory .* is not enough|"
        r"Free memory on device .* is less than desired", re.IGNORECASE)),
    (INVALID_CONFIG, re.compile(
        r"ValidationError|must be (greater|less|at least|smaller|larger)|should be (greater|less)|"
        r"is not supported|cannot be (smaller|larger|greater|less)|exceeds|Invalid|ValueError", re.IGNORECASE)),
]

_ROOT_CAUSE = re.compile(r"(ValueError|RuntimeError|AssertionError|OutOfMemoryError|MemoryError|"
                         r"torch\.\w*OutOfMemoryError|TypeError)[:]\s*(.+)")


def root_cause(text: str) -> str:
    """The first line of the innermost error message found in `text`, or the last non-empty line."""
    causes = [m.group(0).strip() for m in _ROOT_CAUSE.finditer(text)]
    specific = [c for c in causes if "initialization failed" not in c and "See root cause" not in c]
    if specific:
        return _strip_log_prefix(specific[0])[:500]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return _strip_log_prefix(lines[-1])[:500] if lines else ""


def _strip_log_prefix(line: str) -> str:
    return re.sub(r"^\(\w+ pid=\d+\)\s+(ERROR|WARNING|INFO)\s+[\d\- :]+\[[^\]]+\]\s*", "", line)


def classify(error_text: str, log_text: str = "") -> tuple[str, str]:
    """Return (reason, one-line detail) for a failed start, looking at the log first: it holds the root cause."""
    for source in (log_text, error_text):
        cause = root_cause(source) if source else ""
        for reason, pattern in _PATTERNS:
            if cause and pattern.search(cause):
                return reason, cause
    combined = f"{log_text}\n{error_text}"
    for reason, pattern in _PATTERNS[:1]:
        if pattern.search(combined):
            return reason, root_cause(combined)
    return START_FAILED, root_cause(combined) or error_text[:500]
