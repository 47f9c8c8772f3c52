"""Trajectory files (the original store's ``agent/trajectory.py``): JSONL samples for training
and review.

Independent of the database: :func:`save_trajectory` appends one JSON object per line to a
file, and two helpers turn the agent's ``<REASONING_SCRATCHPAD>`` tags into ShareGPT-style
``<think>`` tags and spot a scratchpad that a cut-off stream left open.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from datetime import datetime
from typing import Any

from hermes_store import jsontext

log = logging.getLogger(__name__)

SCRATCHPAD_OPEN = "<REASONING_SCRATCHPAD>"
SCRATCHPAD_CLOSE = "</REASONING_SCRATCHPAD>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

COMPLETED_FILE = "trajectory_samples.jsonl"
FAILED_FILE = "failed_trajectories.jsonl"


def save_trajectory(
    trajectory: list[dict[str, Any]],
    model: str | None,
    completed: bool,
    filename: str | os.PathLike[str] | None = None,
) -> None:
    """Append ``{"conversations", "timestamp", "model", "completed"}`` as one UTF-8 JSON line.

    ``filename`` defaults to ``trajectory_samples.jsonl`` (completed) or
    ``failed_trajectories.jsonl``; any error is logged and swallowed, as in the original store.
    """
    if filename is None:
        filename = COMPLETED_FILE if completed else FAILED_FILE
    entry = {
        "conversations": trajectory,
        "timestamp": datetime.now().isoformat(),
        "model": model,
        "completed": completed,
    }
    try:
        line = jsontext.dumps(entry, ensure_ascii=False) + "\n"
        with open(_append_only(filename), "a", encoding="utf-8") as handle:
            handle.write(line)
    except Exception as error:  # the agent must never fail because a sample was not saved
        log.warning("could not save the trajectory to %s: %s", filename, error)


def _append_only(filename: str | os.PathLike[str]) -> int:
    """A descriptor appending to ``filename`` (created as ``open(..., "a")`` would), refused
    unless it is a regular file of this user: the default name sits in the working folder, where
    a link planted by a checked-out project would have samples appended to whatever it names,
    and a file planted by another user would collect the conversations."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    try:
        fd = os.open(filename, flags | os.O_NOFOLLOW, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(error.errno, "a symbolic link: refused") from error
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EPERM, f"not a regular file ({stat.filemode(info.st_mode)})")
        if info.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"it belongs to uid {info.st_uid}, not to this user")
    except OSError:
        os.close(fd)
        raise
    return fd


def convert_scratchpad_to_think(content: str | None) -> str | None:
    """``<REASONING_SCRATCHPAD>``/``</REASONING_SCRATCHPAD>`` become ``<think>``/``</think>``.

    Empty content, or content without the opening tag, is returned unchanged.
    """
    if not content or SCRATCHPAD_OPEN not in content:
        return content
    return content.replace(SCRATCHPAD_OPEN, THINK_OPEN).replace(SCRATCHPAD_CLOSE, THINK_CLOSE)


def has_incomplete_scratchpad(content: str | None) -> bool:
    """True when the opening scratchpad tag is present and the closing one is not."""
    if not content:
        return False
    return SCRATCHPAD_OPEN in content and SCRATCHPAD_CLOSE not in content
