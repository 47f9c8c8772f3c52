"""Where a figure comes from: the commit measured, when, and how busy the machine was.

Every section of ``docs/benchmarks.md`` carries one stamp, so a reader can tell whether a
figure predates a change (the commit, with ``+dirty`` when the tree differed from it) and how
much to trust it (the machine is shared: its cores and the load average when it began).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
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


def line(measured: str) -> str:
    """One line for the top of a section: what was measured, when, and on what."""
    return (
        f"_Measured: commit `{measured}`, {now()}, {cores()} cores, "
        f"load average {load_average():.1f} at start._"
    )
