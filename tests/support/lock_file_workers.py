"""Worker processes for the lock-file tests (``spawn``ed: they import only what they use). Each
talks to the test through a pipe: it says when it is ready and waits for the test's word.
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any


def hold_range(path: str, start: int, length: int, conn: Any) -> None:
    """A foreign process: write-lock ``[start, start + length)`` of ``path`` (POSIX lock;
    ``length`` 0: to the end and beyond), say "holding", keep it until told, say "released"."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
        conn.send("holding")
        conn.recv()
        fcntl.lockf(fd, fcntl.LOCK_UN, length, start)
    finally:
        os.close(fd)
    conn.send("released")


def timed_appends(db: str, count: int, wait: str, conn: Any) -> None:
    """Open the store (the queue's bounded wait set to ``wait`` seconds), say "ready", wait for
    "go", append ``count`` messages to session "q" and report (wall seconds, CPU seconds of
    this process, the queue's stats) for the appends alone."""
    os.environ["HERMES_STORE_WRITE_QUEUE_WAIT"] = wait
    from hermes_store import SessionDB

    store = SessionDB(db)
    conn.send("ready")
    conn.recv()
    wall, cpu = time.monotonic(), time.process_time()
    for n in range(count):
        store.append_message("q", "user", f"foreign-lock {n}")
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    queue = store.uow.write_queue
    stats = queue.stats() if queue is not None else None
    store.close()
    conn.send((wall, cpu, stats))
