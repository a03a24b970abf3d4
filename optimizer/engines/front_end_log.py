"""Where vLLM's own log records go while an engine runs in this process: the trial's log, not the terminal."""

from __future__ import annotations

import logging
from pathlib import Path


class FrontEndLog:
    """Between start and shutdown, the records of vLLM's loggers in this process (the front end: AsyncLLM, its
    output handler) go to the trial's log instead of the terminal: when the engine core dies, the output handler
    logs the error with a traceback, which belongs beside the engine's own output, not in the user's terminal."""

    def __init__(self, log_path: Path | None) -> None:
        self._logger = logging.getLogger("vllm")
        self._saved = list(self._logger.handlers)
        self._handler: logging.Handler | None = None
        if log_path is None:
            return
        self._handler = logging.FileHandler(log_path, delay=True)
        formatter = next((h.formatter for h in self._saved if h.formatter is not None), None)
        if formatter is not None:
            self._handler.setFormatter(formatter)
        self._logger.handlers = [self._handler]

    def close(self) -> None:
        if self._handler is None:
            return
        self._logger.handlers = self._saved
        self._handler.close()
        self._handler = None
