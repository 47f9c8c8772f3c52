"""The leader queue both group commits share: units of one process queue, whoever finds no
leader leads, running groups until its own unit is settled; the others wait for the outcome.

SQLite's group commit (:mod:`hermes_store.uow.groupcommit`) and PostgreSQL's
(:mod:`hermes_store.uow.pggroup`) each subclass :class:`LeaderQueue` with how one group runs.
Interrupts (Ctrl-C, any ``BaseException``) always reach the caller they were raised in: a
waiting caller's unit is withdrawn, a leader hands on the lead.
"""

from __future__ import annotations

import threading
from collections import deque
from functools import partial
from itertools import islice
from typing import Any, Generic, TypeVar, cast

from hermes_store.errors import mapped_errors
from hermes_store.uow.interrupts import uninterrupted

#: Most units in one transaction: bounds the turn a leader holds (and a lost group's re-runs).
MAX_GROUP = 32

QUEUED, DONE, FAILED, RERUN = range(4)  #: a queued unit's state (``Queued.state``)


class Queued:
    """A unit in a :class:`LeaderQueue` and, once its group ended, its outcome."""

    __slots__ = ("error", "result", "state")

    def __init__(self) -> None:
        self.state = QUEUED
        self.result: Any = None
        self.error: BaseException | None = None


U = TypeVar("U", bound=Queued)


class LeaderQueue(Generic[U]):
    """Units of one process queue; whoever finds no leader leads, running groups (its
    :meth:`_lead`) until its own unit is settled; the others wait for the outcome."""

    def __init__(self, *, max_group: int = MAX_GROUP) -> None:
        self.max_group = max_group
        # Interrupts (Ctrl-C) must never leave the lock held, or released while held by
        # another thread: ``with self._lock`` enters in C (Condition's Python __enter__ can be
        # interrupted after taking it), and an RLock makes ``cond.wait()`` take the lock back
        # in C, uninterruptibly (with a Lock an interrupt there leaves wait() without it).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[U] = deque()
        self._leading: U | None = None  #: the unit whose caller leads (its groups run)
        self._watchers = 0
        self._group: list[U] = []  #: the units the running leader took (see :meth:`_take`)
        #: A group took more than one unit once: threads of this process meet (never reset).
        self.met = False

    def _settled(self, unit: U) -> tuple[bool, Any]:
        """Queue ``unit``, lead or wait until its group ended: ``(True, result)`` when it was
        committed, ``(False, None)`` when it must run again alone; a unit that failed raises.

        An exception raised in this caller (an interrupt: Ctrl-C reaches the main thread while
        it waits or leads) goes on to this caller, always: its unit is withdrawn if no group
        took it yet, and a leader hands on the lead (its groups are settled by :meth:`_lead`).
        """
        try:
            with self._lock:
                self._queue.append(unit)
                if self._watchers:
                    self._cond.notify_all()
                while unit.state == QUEUED and self._leading is not None:
                    self._wait()
                if unit.state == QUEUED:
                    self._leading = unit
            if self._leading is unit:  # only this caller sets or clears it to its unit
                while unit.state == QUEUED:  # mine may be past the first group
                    self._lead(unit)
                self._leave(unit)
        except BaseException:
            uninterrupted(partial(self._leave, unit))
            raise
        if unit.state == DONE:
            return True, unit.result
        if unit.state == FAILED:
            assert unit.error is not None
            with mapped_errors():
                raise unit.error
        return False, None

    def _wait(self) -> None:
        """``cond.wait()`` that leaves holding the lock whatever interrupts it: an interrupt
        raised between the wait's release of the lock and its waiting (CPython checks signals
        there) leaves without it, and the caller's ``with`` would then release a lock it does
        not hold."""
        try:
            self._cond.wait()
        except BaseException:
            if not cast(Any, self._lock)._is_owned():
                self._lock.acquire()
            raise

    def _leave(self, unit: U) -> None:
        """Done with the queue: a leader hands on the lead and wakes the others; a unit no
        group took (its caller was interrupted) is withdrawn, so it never runs. Idempotent:
        the lead is handed on only while this caller still holds it."""
        with self._lock:
            if unit.state == QUEUED and unit in self._queue:
                self._queue.remove(unit)
                unit.state = RERUN
            if self._leading is unit:
                self._leading = None
                self._cond.notify_all()

    def _lead(self, own: U) -> None:
        """Run one group (taking queued units with :meth:`_take`); settle every unit taken."""
        raise NotImplementedError

    def _take(self) -> list[U]:
        """Up to ``max_group`` queued units, oldest first (the group's). They are the group's
        (``_group``) before they leave the queue: an interrupt meanwhile loses none."""
        with self._lock:
            queue = self._queue
            if len(queue) <= self.max_group:
                self._group = group = list(queue)
                queue.clear()
            else:
                self._group = group = list(islice(queue, self.max_group))
                for _ in group:
                    queue.popleft()
            if len(group) > 1:
                self.met = True
            return group

    @property
    def idle(self) -> bool:
        """No leader and nothing queued (read without the lock: a hint, for a writer deciding
        whether it may go straight in)."""
        return self._leading is None and not self._queue

    def queued(self) -> int:
        """Units waiting for a group (the running group's are no longer counted)."""
        with self._lock:
            return len(self._queue)

    def wait_for_queued(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` units wait for a group (False: timed out); lets
        tests and callers know units are queued without polling."""
        with self._lock:
            self._watchers += 1
            try:
                return self._cond.wait_for(lambda: len(self._queue) >= count, timeout)
            finally:
                self._watchers -= 1
