"""Waiting for a condition another thread or process makes true, polled, with a guard that only
a bug reaches (never a speed expectation: CI's machine is loaded)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: A bound on waits that only a bug reaches (a hang guard, generous for a loaded machine).
GUARD = 120.0


def wait_until(condition: Callable[[], bool], what: str, *, guard: float = GUARD) -> None:
    """Return once ``condition()`` holds; fail, naming ``what``, after ``guard`` seconds."""
    deadline = time.monotonic() + guard
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def in_thread(call: Callable[[], Any]) -> tuple[list[Any], threading.Thread]:
    """Run ``call`` in a new thread: its outcome (``("ok", result)`` or ``("error", error)``)
    lands in the list once it returns; join the thread before reading it."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("ok", call()))
        except BaseException as error:
            outcome.append(("error", error))

    thread = threading.Thread(target=run)
    thread.start()
    return outcome, thread
