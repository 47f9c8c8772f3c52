"""Group commit: the hot single-call writes queued in one process share one transaction.

Why: with ``synchronous=FULL`` every commit costs an fsync (4 ms typically here, up to 0.5 s
on a loaded disk), and the fair writer queue hands the write lock over one writer at a time.
While one writer commits, the others of its process queue up; one ``BEGIN IMMEDIATE ..
COMMIT`` for all of them makes one fsync and one queue turn serve up to :data:`MAX_GROUP`
callers.

A write that finds no one else writing never comes here: it goes straight in
(:mod:`hermes_store.uow.uncontended`), so a group forms only behind writers already there.

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

An interrupt (Ctrl-C, any ``BaseException``) always reaches the caller it was raised in and
never re-runs a committed group: in the leader after ``COMMIT`` returned (SQLite then has no
open transaction), the units are done; before, the group is rolled back and its units run
again alone; in a caller still waiting, its unit is withdrawn (no group runs it later).

Only units that may run twice are grouped: ``UnitOfWork.run`` already re-runs its function
whole after a lock error, and the store's single-call writes (``append_message(s)``,
``update_token_counts``) are all-or-nothing statements. ``transaction()`` blocks and other
units that joined an open unit are never grouped.

One thing group commit cannot decide: a ``COMMIT`` that fails with an I/O error after SQLite
wrote the commit record may still be on disk. The callers then run again, as a single unit's
caller would retry, which can write a unit twice; a failed fsync is the only case, and the
original store reports it as an error to a caller that retries the same way.

Its collaborators come through its constructor: the file's writer
(:class:`~hermes_store.uow.writer.SqliteWriter`: the turn, ``begin``, the retry pauses, the WAL
check, the rollback of a lost group) and the Unit of Work's
:class:`~hermes_store.uow.counters.Counters`, where its groups are recorded.

Set ``HERMES_STORE_GROUP_COMMIT=0`` to run every unit in its own transaction (benchmarks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

from hermes_store.errors import WalDeletedError
from hermes_store.uow.counters import Counters
from hermes_store.uow.interrupts import uninterrupted
from hermes_store.uow.leaders import (
    DONE,
    FAILED,
    MAX_GROUP,
    QUEUED,
    RERUN,
    LeaderQueue,
    Queued,
)
from hermes_store.uow.writer import SqliteWriter

log = logging.getLogger(__name__)

T = TypeVar("T")

ENV_SWITCH = "HERMES_STORE_GROUP_COMMIT"

#: SQLite primary result codes after which a transaction cannot be trusted to be whole: SQLite
#: may have rolled it all back (released savepoints included).
_ABORTS_TRANSACTION = frozenset({5, 6, 7, 9, 10, 11, 13, 26})  # BUSY LOCKED NOMEM INTERRUPT
# IOERR CORRUPT FULL NOTADB

_OPEN, _COMMITTING, _COMMITTED = range(3)  #: how far a SQLite group got (``GroupCommit._stage``)


class Pending(Queued, Generic[T]):
    """One queued unit of work: a function of the writer connection."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any], T]) -> None:
        super().__init__()
        self.fn = fn


class GroupCommit(LeaderQueue[Pending[Any]]):
    """The group-commit queue of one Unit of Work (one per process and file): its groups run
    on ``writer`` and are counted in ``counters``."""

    def __init__(
        self, writer: SqliteWriter, counters: Counters, *, max_group: int = MAX_GROUP
    ) -> None:
        super().__init__(max_group=max_group)
        self._writer = writer
        self._counters = counters
        self._stage = _OPEN

    def run(self, fn: Callable[[Any], T]) -> tuple[bool, T | None]:
        """Run ``fn(writer_connection)`` in a group; ``(True, result)`` once committed, or
        ``(False, None)``: the group's transaction was lost, run ``fn`` again alone."""
        return self._settled(Pending(fn))

    def _lead(self, own: Pending[Any]) -> None:
        """One group: the turn, BEGIN, up to ``max_group`` queued units, COMMIT, wake them.

        Whatever is raised meanwhile (an interrupt too), every unit taken is settled before
        it goes on: done once its ``COMMIT`` returned, run again alone otherwise (rolled back,
        nothing landed). An interrupt is then raised to the leader's caller, never swallowed.
        """
        writer = self._writer
        waits = writer.waits()
        while True:
            self._stage = _OPEN
            taking = writer.turn(hot=True)
            try:
                with taking as turn:
                    try:
                        committed = self._run_group(writer, turn)
                    except BaseException as error:
                        uninterrupted(partial(self._unwind_in_turn, error))
                        raise
                self._settle_group(committed)
                return
            except BaseException as error:
                taking.release()  # an interrupt as the turn was given or its with ended
                if self._group or self._stage == _COMMITTED:
                    committed = self._stage == _COMMITTED
                    uninterrupted(partial(self._settle_group, committed, interrupted=True))
                    if not isinstance(error, Exception):
                        raise
                    if committed:  # on disk: releasing the turn failed, the units did not
                        log.warning("write queue: releasing a committed group's turn: %s", error)
                    return
                if not isinstance(error, Exception):
                    raise
                if writer.is_retryable(error):  # a fallback turn: today's retry
                    try:
                        writer.pause(waits, error)
                    except Exception as final:
                        error = final
                    else:
                        continue
                with self._lock:  # BEGIN failed for good: only the leader's unit fails
                    if own.state == QUEUED:
                        if own in self._queue:
                            self._queue.remove(own)
                        own.state, own.error = FAILED, error
                return

    def _run_group(self, writer: SqliteWriter, turn: Any) -> bool:
        """BEGIN, the queued units, then COMMIT (True) or, the transaction lost, ROLLBACK
        (False). ``_stage`` says how far it got, for an exception that leaves midway."""
        conn = writer.begin(turn)
        batch = self._take()
        lost = self._execute(conn, batch)
        if lost is None:
            driver: Any = conn.connection.driver_connection
            dbapi_error = writer.dbapi_error
            self._stage = _COMMITTING
            try:
                driver.commit()
            except dbapi_error as error:
                self._stage = _OPEN  # no check for signals between the two: nothing to undo
                lost = error
            else:
                try:
                    writer.acknowledge()
                except WalDeletedError:  # not saved: the units run again and meet the refusal
                    self._stage = _OPEN
                    self._counters.record_group(len(batch), lost=True)
                    return False
                self._stage = _COMMITTED
                self._counters.record_group(len(batch), lost=False)
                return True
        writer.end_group(conn, len(batch), lost)
        return False

    def _unwind_in_turn(self, error: BaseException) -> None:
        """An exception left :meth:`_run_group` (still in the writer's turn): tell whether
        its COMMIT went through (an interrupt raised as it returned: SQLite has no open
        transaction then) and roll back whatever is still open. Idempotent."""
        writer = self._writer
        conn = writer.connection
        pooled: Any = None if conn is None or conn.closed or conn.invalidated else conn.connection
        open_transaction = pooled is not None and bool(pooled.driver_connection.in_transaction)
        if self._stage == _COMMITTING:
            self._stage = _OPEN if open_transaction else _COMMITTED
        if self._stage != _COMMITTED and open_transaction:
            assert conn is not None
            writer.end_group(conn, len(self._group), error)

    def _settle_group(self, committed: bool, *, interrupted: bool = False) -> None:
        """Wake the group's callers: done once committed (a unit that failed keeps its
        error), else all to run again alone. After an interrupt, a unit still queued (the take
        was cut short) stays queued for the next group. Idempotent."""
        done = 0
        with self._lock:
            queue = self._queue
            for pending in self._group:
                if committed:
                    if pending.state == QUEUED:
                        pending.state = DONE
                    done += pending.state == DONE
                elif not (interrupted and pending.state == QUEUED and pending in queue):
                    pending.state, pending.result, pending.error = RERUN, None, None
            self._group = []
            self._cond.notify_all()
        self._counters.count_writes(done)

    def _execute(self, conn: Any, batch: list[Pending[Any]]) -> BaseException | None:
        """Each unit in its own savepoint; the error that lost the transaction, if any. A
        unit alone needs none: its transaction is its savepoint (rolled back on its error,
        the COMMIT that follows then has nothing to do)."""
        driver: Any = conn.connection.driver_connection
        dbapi_error: type[Exception] = self._writer.dbapi_error
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
