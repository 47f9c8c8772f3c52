"""Waiting for a condition another thread or process makes true, polled, with a guard that only
a bug reaches (never a speed expectation: CI's machine is loaded)."""

from __future__ import annotations

import time
from collections.abc import Callable

GUARD = 120.0


def wait_until(condition: Callable[[], bool], what: str, *, guard: float = GUARD) -> None:
    """Return once ``condition()`` holds; fail, naming ``what``, after ``guard`` seconds."""
    deadline = time.monotonic() + guard
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
