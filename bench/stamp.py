"""Where a figure comes from: the commit measured, when, and how busy the machine was.

Every section of ``docs/benchmarks.md`` carries one stamp, so a reader can tell whether a
figure predates a change (the commit, with ``+dirty`` when the tree differed from it) and how
much to trust it (the machine is shared: its cores and the load average when it began).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


def commit(checkout: str | Path, ignore: Sequence[str] = ()) -> str:
    """``git rev-parse --short HEAD`` of ``checkout``, ``+dirty`` when its tree differs from it
    (paths in ``ignore`` excepted: the report being rewritten); ``unknown`` outside git."""
    where = str(checkout)
    try:
        head = subprocess.run(
            ["git", "-C", where, "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        excluded = [f":(exclude){path}" for path in ignore]
        status = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--", ".", *excluded],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if status else head


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> float:
    return os.getloadavg()[0]


@dataclass(frozen=True)
class Settled:
    """How a run began: the load average it waited for (``limit``), how long it waited, and
    the load average it began at (``fell``: at or under the limit; not: the wait ran out)."""

    limit: float
    waited: float
    load: float
    fell: bool

    def said(self) -> str:
        """The wait in words, for the report's header ("" when there was none)."""
        if self.limit <= 0 or (self.fell and not self.waited):
            return ""
        if self.fell:
            return f"waited {self.waited:.0f} s for it to fall to {self.limit:.1f} or less"
        return f"still over {self.limit:.1f} after waiting {self.waited:.0f} s"


def settle(
    limit: float,
    within: float,
    *,
    every: float = 5.0,
    load: Callable[[], float] = load_average,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = print,
) -> Settled:
    """Wait, at most ``within`` seconds, until the 1-minute load average is at most ``limit``.

    Why: a run begun right after another job (the test suite) measures that job's tail too:
    the load average decays over a minute, and lone-writer rows begun at 2.9 read 8-12% slower
    than at 0.8 on this code. ``limit <= 0`` waits for nothing."""
    began = clock()
    current = load()
    if limit <= 0 or current <= limit:
        return Settled(limit, 0.0, current, limit <= 0 or current <= limit)
    say(f"load average {current:.1f}: waiting up to {within:.0f} s for {limit:.1f} or less")
    while current > limit:
        left = within - (clock() - began)
        if left <= 0:
            break
        sleep(min(every, left))
        current = load()
    return Settled(limit, clock() - began, current, current <= limit)


def line(measured: str) -> str:
    """One line for the top of a section: what was measured, when, and on what."""
    return (
        f"_Measured: commit `{measured}`, {now()}, {cores()} cores, "
        f"load average {load_average():.1f} at start._"
    )
