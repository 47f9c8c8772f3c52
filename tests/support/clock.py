"""A clock tests hand to ``SessionDB(clock=...)`` to order events without sleeping."""

from __future__ import annotations

import time


class FakeClock:
    """A clock for ``SessionDB(clock=...)``: starts at the real time (so prune cutoffs and
    "recent" still mean what they say) and moves only by ``tick`` per reading and by
    :meth:`advance`, so tests order events without sleeping."""

    def __init__(self, start: float | None = None, tick: float = 1e-6) -> None:
        self.now = time.time() if start is None else start
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float = 1.0) -> float:
        """Move the clock forward; returns the new time."""
        self.now += seconds
        return self.now
