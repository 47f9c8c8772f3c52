"""Waiting for a pipe to have something to read, whatever its descriptor's number.

``select.select`` refuses descriptors from 1024 on (``ValueError: filedescriptor out of range
in select()``), and a test worker that ran many tests can hold that many (the writer queues
of the stores it has open, and of queues tests make and never close). ``poll`` has no such
bound.
"""

from __future__ import annotations

import select
from typing import IO, Any


def readable(source: int | IO[Any], timeout: float) -> bool:
    """Whether ``source`` (a descriptor or a file) has data or end of file within ``timeout``
    seconds (0: now)."""
    fd = source if isinstance(source, int) else source.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI | select.POLLHUP)
    return bool(poller.poll(max(0.0, timeout) * 1000))
