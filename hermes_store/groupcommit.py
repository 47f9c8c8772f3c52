"""Group commit: the hot single-call writes queued in one process share one transaction.

Why: with ``synchronous=FULL`` every commit costs an fsync (4 ms typically here, up to 0.5 s
on a loaded disk), and the fair writer queue hands the write lock over one writer at a time.
While one writer commits, the others of its process queue up; one ``BEGIN IMMEDIATE ..
COMMIT`` for all of them makes one fsync and one queue turn serve up to :data:`MAX_GROUP`
callers.

How: a caller queues its unit (a function of the writer connection). When no leader runs in
the process it becomes the leader: it takes the writer's turn (the fair queue across
processes, then the in-process lock), begins, and only then takes up to :data:`MAX_GROUP`
queued units, oldest first, so every unit that arrived while it waited for the turn rides
along. Each unit runs inside its own ``SAVEPOINT`` (a unit alone: inside its transaction):

- a unit that raises rolls back to its savepoint: only its own work is undone and only its
  caller sees the error; the others go on;
- the callers are woken, with their results, only after ``COMMIT`` returned: nothing is
  acknowledged before it is on disk;
- when the whole transaction is lost (SQLite rolled it back by itself on ``SQLITE_FULL``,
  ``SQLITE_IOERR``, ``SQLITE_NOMEM`` ..., a savepoint could not be rolled back or released,
  or ``COMMIT`` failed), released savepoints are gone too, so no unit of the group is
  acknowledged: every caller runs its own unit again, alone, on the ordinary path (with its
  retries), and gets that run's result or error.

Only units that may run twice are grouped: ``UnitOfWork.run`` already re-runs its function
whole after a lock error, and the store's single-call writes (``append_message(s)``,
``update_token_counts``) are all-or-nothing statements. ``transaction()`` blocks and other
units that joined an open unit are never grouped.

One thing group commit cannot decide: a ``COMMIT`` that fails with an I/O error after SQLite
wrote the commit record may still be on disk. The callers then run again, as a single unit's
caller would retry, which can write a unit twice; a failed fsync is the only case, and the
original store reports it as an error to a caller that retries the same way.

Set ``HERMES_STORE_GROUP_COMMIT=0`` to run every unit in its own transaction (benchmarks).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from hermes_store.errors import mapped_errors

if TYPE_CHECKING:
    from hermes_store.uow import UnitOfWork

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Most units in one transaction: bounds the turn a leader holds (and a lost group's re-runs).
MAX_GROUP = 32
ENV_SWITCH = "HERMES_STORE_GROUP_COMMIT"

#: SQLite primary result codes after which a transaction cannot be trusted to be whole: SQLite
#: may have rolled it all back (released savepoints included).
_ABORTS_TRANSACTION = frozenset({5, 6, 7, 9, 10, 11, 13, 26})  # BUSY LOCKED NOMEM INTERRUPT
# IOERR CORRUPT FULL NOTADB

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
    :meth:`_lead`) until its own unit is settled; the others wait for the outcome. Shared by
    SQLite's group commit (here) and PostgreSQL's (:mod:`hermes_store.pggroup`)."""

    def __init__(self, *, max_group: int = MAX_GROUP) -> None:
        self.max_group = max_group
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[U] = deque()
        self._leading = False
        self._watchers = 0

    def _settled(self, unit: U) -> tuple[bool, Any]:
        """Queue ``unit``, lead or wait until its group ended: ``(True, result)`` when it was
        committed, ``(False, None)`` when it must run again alone; a unit that failed raises."""
        cond = self._cond
        with cond:
            self._queue.append(unit)
            if self._watchers:
                cond.notify_all()
            while unit.state == QUEUED and self._leading:
                cond.wait()
            lead = unit.state == QUEUED
            if lead:
                self._leading = True
        if lead:
            try:
                while unit.state == QUEUED:  # mine may be past the first group
                    self._lead(unit)
            finally:
                with cond:
                    self._leading = False
                    if unit.state == QUEUED:  # interrupted: no later leader may run it
                        self._queue.remove(unit)
                        unit.state = RERUN
                    cond.notify_all()
        if unit.state == DONE:
            return True, unit.result
        if unit.state == FAILED:
            assert unit.error is not None
            with mapped_errors():
                raise unit.error
        return False, None

    def _lead(self, own: U) -> None:
        """Run one group (taking queued units with :meth:`_take`); settle every unit taken."""
        raise NotImplementedError

    def _take(self) -> list[U]:
        """Up to ``max_group`` queued units, oldest first (the group's)."""
        with self._cond:
            take = min(len(self._queue), self.max_group)
            return [self._queue.popleft() for _ in range(take)]

    def queued(self) -> int:
        """Units waiting for a group (the running group's are no longer counted)."""
        with self._cond:
            return len(self._queue)

    def wait_for_queued(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` units wait for a group (False: timed out); lets
        tests and callers know units are queued without polling."""
        with self._cond:
            self._watchers += 1
            try:
                return self._cond.wait_for(lambda: len(self._queue) >= count, timeout)
            finally:
                self._watchers -= 1


class Pending(Queued, Generic[T]):
    """One queued unit of work: a function of the writer connection."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any], T]) -> None:
        super().__init__()
        self.fn = fn


class GroupCommit(LeaderQueue[Pending[Any]]):
    """The group-commit queue of one Unit of Work (one per process and file)."""

    def __init__(self, uow: UnitOfWork, *, max_group: int = MAX_GROUP) -> None:
        super().__init__(max_group=max_group)
        self._uow = uow

    def run(self, fn: Callable[[Any], T]) -> tuple[bool, T | None]:
        """Run ``fn(writer_connection)`` in a group; ``(True, result)`` once committed, or
        ``(False, None)``: the group's transaction was lost, run ``fn`` again alone."""
        return self._settled(Pending(fn))

    def _lead(self, own: Pending[Any]) -> None:
        """One group: the turn, BEGIN, up to ``max_group`` queued units, COMMIT, wake them."""
        uow = self._uow
        waits = uow.retry.waits()
        batch: list[Pending[Any]] = []
        lost: BaseException | None = None
        committed = False
        while True:
            try:
                with uow._write_turn() as turn:
                    conn = uow._begin_driver(turn)
                    batch = self._take()
                    try:
                        lost = self._execute(conn, batch)
                    except BaseException as error:  # never leave a taken unit waiting
                        lost = error
                    lost = uow._end_group(conn, len(batch), lost)
                    committed = lost is None
            except BaseException as error:
                if committed:  # on disk: releasing the turn failed, the units did not
                    log.warning("write queue: releasing a committed group's turn: %s", error)
                    break
                if batch:  # taken, then lost: never leave a taken unit waiting
                    lost = lost or error
                    break
                if uow._begin_is_retryable(error):  # a fallback turn: today's retry
                    try:
                        uow._pause(waits, error)
                    except BaseException as final:
                        error = final
                    else:
                        continue
                with self._cond:  # BEGIN failed for good: only the leader's unit fails
                    if own.state == QUEUED:
                        self._queue.remove(own)
                        own.state, own.error = FAILED, error
                return
            break
        with self._cond:
            for pending in batch:
                if lost is not None:
                    pending.state, pending.result, pending.error = RERUN, None, None
                elif pending.state == QUEUED:
                    pending.state = DONE
            self._cond.notify_all()
        if lost is None:
            uow._count_writes(sum(1 for pending in batch if pending.state == DONE))

    def _execute(self, conn: Any, batch: list[Pending[Any]]) -> BaseException | None:
        """Each unit in its own savepoint; the error that lost the transaction, if any. A
        unit alone needs none: its transaction is its savepoint (rolled back on its error,
        the COMMIT that follows then has nothing to do)."""
        driver: Any = conn.connection.driver_connection
        dbapi_error: type[Exception] = self._uow._dbapi_error
        alone = len(batch) == 1
        for pending in batch:
            try:
                if not alone:
                    driver.execute("SAVEPOINT hermes_unit")
            except dbapi_error as error:
                return error
            try:
                pending.result = pending.fn(conn)
            except Exception as error:
                if _aborts_transaction(error) or not driver.in_transaction:
                    return error
                try:
                    if alone:
                        driver.rollback()
                    else:
                        driver.execute("ROLLBACK TO hermes_unit")
                        driver.execute("RELEASE hermes_unit")
                except dbapi_error as undo_error:
                    return undo_error
                pending.state, pending.error = FAILED, error
                continue
            try:
                if not alone:
                    driver.execute("RELEASE hermes_unit")
            except dbapi_error as error:
                return error
        return None


def _aborts_transaction(error: BaseException) -> bool:
    """A driver error after which SQLite may have rolled the whole transaction back."""
    orig = getattr(error, "orig", error)
    code = getattr(orig, "sqlite_errorcode", None)
    return code is not None and int(code) & 0xFF in _ABORTS_TRANSACTION
