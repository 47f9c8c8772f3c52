"""Fork safety: every live Unit of Work closes its file's connections before ``os.fork()``,
and a forked child starts with none of its parent's.

Why: SQLite keeps one record per database file and process with the process's lock state; a
forked child inherits the record but not the locks (POSIX locks belong to a process). A
connection the child opens finds the record, believes the locks held and takes none; its
parent's last close then checkpoints and deletes the WAL the child writes into. So before a
fork every connection on the file is closed (the parent reopens them lazily) and the child
starts with no record; a connection in use at the fork cannot be closed, and then the child is
refused the file (:data:`REFUSED`).

What a child inherited is never closed, rolled back or finalized there (:func:`keep_forever`):
that would act on the parent's locks and shared memory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Protocol

from sqlalchemy.pool import QueuePool
from sqlalchemy.util import queue as sa_queue

from hermes_store.errors import ForkedProcessError, HermesStoreError

log = logging.getLogger(__name__)

#: How long ``os.fork()`` waits for other threads' units on a SQLite file to end, so the file's
#: connections can be closed before the fork (else the child is refused the file).
FORK_WAIT_S = 2.0


class ForkAware(Protocol):
    """What the fork hooks ask of a live Unit of Work."""

    def before_fork(self, deadline: float) -> None:
        """In the forking thread: close the file's connections by ``deadline``, or note why
        not (the child is then refused the file)."""

    def fork_failed(self, why: str) -> None:
        """``before_fork`` raised: refuse the file in the child, saying ``why``."""

    def after_fork_in_parent(self) -> None:
        """The fork happened: let this process's threads go on."""

    def after_fork_in_child(self) -> None:
        """Forget the parent's connections, locks and open unit without touching them."""


#: Every live Unit of Work, so a forked child can reset them all.
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
#: What a forked child inherited from its parent: kept referenced, never used or closed.
INHERITED: list[object] = []
#: Files (device, inode) this process must not use, and why (inherited by its children).
REFUSED: dict[tuple[int, int], HermesStoreError] = {}
#: Forks this process has gone through (as a child): a unit open across one sees it change.
generation = 0


def register(member: ForkAware) -> None:
    """Have the fork hooks call ``member`` (held weakly: it ends with its Unit of Work)."""
    _LIVE.add(member)


def keep_forever(thing: object) -> None:
    """Keep something inherited from the parent alive for the life of this process, never
    finalized, not even at interpreter exit: closing or rolling back a parent's SQLite
    connection here would act on the parent's locks and shared memory."""
    import ctypes

    INHERITED.append(thing)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thing))


def left_in_child(write: bool) -> ForkedProcessError:
    """The error of a unit opened by the parent and ended in the child."""
    kind = "transaction" if write else "read unit"
    return ForkedProcessError(
        f"this {kind} was opened by the parent process before it forked: the child cannot "
        "commit or roll it back (it belongs to the parent, whose transaction is untouched), "
        "so nothing in it was saved here"
    )


def close_idle(pool: QueuePool) -> None:
    """Close the connections idle in ``pool``, keeping its count of checked-out ones right."""
    while True:
        try:
            record = pool._pool.get(False)
        except sa_queue.Empty:
            return
        record.close()
        pool._dec_overflow()


class Gate:
    """While a fork closes a file's connections, no new one is opened: :meth:`enter` (every
    connect) waits from :meth:`shut` until :meth:`lift`."""

    def __init__(self) -> None:
        # ``with self.lock`` enters in C (Condition's Python __enter__ can be interrupted
        # after taking the lock, leaving it held); an RLock makes ``wait_for`` take the lock
        # back in C whatever interrupts it.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.forking = False
        self.waiters = 0

    def enter(self) -> None:
        with self.lock:
            if self.forking:
                self.waiters += 1
                try:
                    self.cond.wait_for(lambda: not self.forking)
                finally:
                    self.waiters -= 1

    def shut(self) -> None:
        with self.lock:
            self.forking = True

    def lift(self) -> None:
        with self.lock:
            self.forking = False
            self.cond.notify_all()


def _before_fork() -> None:
    deadline = time.monotonic() + FORK_WAIT_S
    for member in list(_LIVE):
        try:
            member.before_fork(deadline)
        except Exception as error:  # never let a fork fail here: refuse the child instead
            member.fork_failed(f"its connections could not be closed: {error!r}")


def _after_fork_in_parent() -> None:
    for member in list(_LIVE):
        member.after_fork_in_parent()


def _after_fork_in_child() -> None:
    global generation
    generation += 1
    for member in list(_LIVE):
        member.after_fork_in_child()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
