"""A store opened on a thread of its own, for tests that change the server while the opening
waits for it: the outcome (the store or the error) is handed to the test's thread."""

from __future__ import annotations

import threading
from typing import Any

from hermes_store import SessionDB


class Opening:
    """``SessionDB(target, **options)`` started on a thread now; ``ended`` (when given) is set
    once it has an outcome, so a test waiting for something else learns at once that the
    opening ended instead (it fails early, showing the error)."""

    def __init__(
        self, target: str, *, ended: threading.Event | None = None, **options: Any
    ) -> None:
        self._outcomes: list[SessionDB | BaseException] = []
        self._ended = ended
        self._thread = threading.Thread(
            target=self._open, args=(target, options), name="hermes-test-opening"
        )
        self._thread.start()

    def _open(self, target: str, options: dict[str, Any]) -> None:
        try:
            self._outcomes.append(SessionDB(target, **options))
        except BaseException as error:  # handed to the test's thread
            self._outcomes.append(error)
        if self._ended is not None:
            self._ended.set()

    def outcome(self) -> SessionDB | BaseException | None:
        """The store or the error, or None while the opening still runs."""
        return self._outcomes[0] if self._outcomes else None

    def store(self, deadline_s: float) -> SessionDB:
        """The opened store (waiting up to ``deadline_s``); the opening's error is raised."""
        self._thread.join(deadline_s)
        found = self.outcome()
        if found is None:
            raise AssertionError(f"the opening still ran after {deadline_s:.0f} s")
        if isinstance(found, BaseException):
            raise found
        return found
