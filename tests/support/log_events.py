"""Waiting on what the store logs: an event set when a logger says something, so a test can
act at the moment the store reports a state (waiting for a server) instead of sleeping."""

from __future__ import annotations

import logging
import threading
from types import TracebackType


class LogSays(logging.Handler):
    """``said`` is set when ``logger`` emits a record containing ``text``. As a context
    manager it attaches itself (letting INFO records through) and detaches on exit."""

    def __init__(self, logger: str, text: str) -> None:
        super().__init__(logging.INFO)
        self.logger = logging.getLogger(logger)
        self.text = text
        self.said = threading.Event()
        self._level = self.logger.level

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.said.set()

    def __enter__(self) -> LogSays:
        self._level = self.logger.level
        self.logger.addHandler(self)
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        return self

    def __exit__(
        self,
        _kind: type[BaseException] | None,
        _error: BaseException | None,
        _trace: TracebackType | None,
    ) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)
