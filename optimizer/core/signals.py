"""Stopping a run: Ctrl-C (SIGINT) and SIGTERM (`timeout`, `docker stop`, `kill`) end it with one line, no traceback.

Both become a KeyboardInterrupt in the main thread, so the running trial's engine is shut down in its `finally`
blocks and the trial is recorded as interrupted (FAIL, queued again on resume). The exit code says which signal
stopped the run, as shells do: 130 (128 + SIGINT) or 143 (128 + SIGTERM).

Optuna logs a trial that ends in an exception with its traceback ("Trial 0 failed ... KeyboardInterrupt" and two
chained tracebacks): for a stop that is noise, so `quiet_interrupted_trials` drops those two records; the same for
an OptimizerError (a database gone for good), which the CLI reports in one line of its own.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

from optimizer.core.errors import OptimizerError

EXIT_SIGINT = 128 + signal.SIGINT  # 130
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143

_received: list[int] = []  # [SIGTERM] once a SIGTERM has stopped this process


def install_stop_handlers() -> None:
    """SIGINT raises KeyboardInterrupt (restored: a shell's background job inherits it ignored); SIGTERM does the
    same through SIGINT, once: a second SIGTERM while the engine shuts down does not cut the shutdown short.
    Only SIGTERM is recorded: any KeyboardInterrupt without it was Ctrl-C."""
    _received.clear()

    def on_term(signum: int, frame: FrameType | None) -> None:
        if signal.SIGTERM in _received:
            return
        _received.append(signal.SIGTERM)
        # Through SIGINT, so that asyncio.run (which installs its own SIGINT handler) cancels the trial's task
        # and raises KeyboardInterrupt exactly as for Ctrl-C.
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own handler, exactly: asyncio.run then cancels the running trial's task cleanly on Ctrl-C instead
    # of raising KeyboardInterrupt wherever the event loop happens to be (it checks for this very handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_term)
    quiet_interrupted_trials()


RESOURCE_TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"


def quiet_resource_tracker() -> None:
    """Keep multiprocessing's resource tracker from printing after a stop's one line.

    vLLM's engine processes register shared memory and semaphores with the tracker of the process that spawned them;
    an engine ended by a stop (or killed during its start) leaves them registered, and when this process exits the
    tracker unlinks them and warns "There appear to be N leaked shared_memory objects" on our stderr, after the
    line that says how the run ended. The cleanup is what we want; the warning is not. The tracker is a separate
    Python process started on first use: it inherits the environment, so the filter goes into PYTHONWARNINGS before
    that (its own filters are set at its start). Nothing else is silenced: the filter names the tracker's module.
    """
    current = os.environ.get("PYTHONWARNINGS", "")
    if RESOURCE_TRACKER_QUIET not in current.split(","):
        os.environ["PYTHONWARNINGS"] = f"{current},{RESOURCE_TRACKER_QUIET}" if current else RESOURCE_TRACKER_QUIET


def quiet_interrupted_trials() -> None:
    """Drop Optuna's warnings (with traceback) about a trial that a stop interrupted. A logger's own filters do not
    see its children's records, so the filter goes on the handlers of Optuna's library logger."""
    import optuna

    optuna.logging.get_verbosity()  # makes sure Optuna's default handler is attached
    for handler in logging.getLogger("optuna").handlers:
        if _drop_interrupted_trial_records not in handler.filters:
            handler.addFilter(_drop_interrupted_trial_records)


def stop_signal() -> int:
    """The signal that stopped the run: SIGTERM if one came first, else SIGINT."""
    return _received[0] if _received else signal.SIGINT


def interrupted_exit_code() -> int:
    """130 after Ctrl-C, 143 after SIGTERM."""
    return EXIT_SIGTERM if stop_signal() == signal.SIGTERM else EXIT_SIGINT


RUN_STOPPED = "the running trial was stopped; run the same command again to resume"


def interrupted_message(stopped: str = RUN_STOPPED) -> str:
    """The one line a stopped command prints: how it was stopped, then `stopped` (a study's run: what resumes it)."""
    how = "SIGTERM" if stop_signal() == signal.SIGTERM else "Ctrl-C"
    return f"interrupted ({how}): {stopped}"


_interrupted_trials: set[str] = set()


def _drop_interrupted_trial_records(record: logging.LogRecord) -> bool:
    """Optuna's two warnings about a trial stopped by a KeyboardInterrupt or an OptimizerError: the first carries
    the exception (and its traceback), the second ("failed with value None") follows it for the same trial."""
    exc = record.exc_info[1] if record.exc_info else None
    message = record.getMessage()
    if isinstance(exc, (KeyboardInterrupt, OptimizerError)):  # the run ends with our own one-line message
        _interrupted_trials.add(message.split(" failed", 1)[0])
        return False
    head = message.split(" failed with value", 1)[0]
    if " failed with value" in message and head in _interrupted_trials:
        _interrupted_trials.discard(head)
        return False
    return True
