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

Set ``HERMES_STORE_GROUP_COMMIT=0`` to run every unit in its own transaction (benchmarks).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from hermes_store.errors import WalDeletedError, mapped_errors

if TYPE_CHECKING:
    from hermes_store.uow.unit import UnitOfWork

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
_OPEN, _COMMITTING, _COMMITTED = range(3)  #: how far a SQLite group got (``GroupCommit._stage``)


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
    SQLite's group commit (here) and PostgreSQL's (:mod:`hermes_store.uow.pggroup`)."""

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
            _uninterrupted(partial(self._leave, unit))
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
            return group

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
        uow = self._uow
        waits = uow.retry.waits()
        while True:
            self._stage = _OPEN
            try:
                with uow._write_turn() as turn:
                    try:
                        committed = self._run_group(uow, turn)
                    except BaseException as error:
                        _uninterrupted(partial(self._unwind_in_turn, error))
                        raise
                self._settle_group(committed)
                return
            except BaseException as error:
                if self._group or self._stage == _COMMITTED:
                    committed = self._stage == _COMMITTED
                    _uninterrupted(partial(self._settle_group, committed, interrupted=True))
                    if not isinstance(error, Exception):
                        raise
                    if committed:  # on disk: releasing the turn failed, the units did not
                        log.warning("write queue: releasing a committed group's turn: %s", error)
                    return
                if not isinstance(error, Exception):
                    raise
                if uow._begin_is_retryable(error):  # a fallback turn: today's retry
                    try:
                        uow._pause(waits, error)
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

    def _run_group(self, uow: UnitOfWork, turn: Any) -> bool:
        """BEGIN, the queued units, then COMMIT (True) or, the transaction lost, ROLLBACK
        (False). ``_stage`` says how far it got, for an exception that leaves midway."""
        conn = uow._begin_driver(turn)
        batch = self._take()
        lost = self._execute(conn, batch)
        if lost is None:
            driver: Any = conn.connection.driver_connection
            dbapi_error = uow._dbapi_error
            self._stage = _COMMITTING
            try:
                driver.commit()
            except dbapi_error as error:
                self._stage = _OPEN  # no check for signals between the two: nothing to undo
                lost = error
            else:
                try:
                    uow._acknowledge()
                except WalDeletedError:  # not saved: the units run again and meet the refusal
                    self._stage = _OPEN
                    uow._record_group(len(batch), lost=True)
                    return False
                self._stage = _COMMITTED
                uow._record_group(len(batch), lost=False)
                return True
        uow._end_group(conn, len(batch), lost)
        return False

    def _unwind_in_turn(self, error: BaseException) -> None:
        """An exception left :meth:`_run_group` (still in the writer's turn): tell whether
        its COMMIT went through (an interrupt raised as it returned: SQLite has no open
        transaction then) and roll back whatever is still open. Idempotent."""
        uow = self._uow
        conn = uow._writer_conn
        pooled: Any = None if conn is None or conn.closed or conn.invalidated else conn.connection
        open_transaction = pooled is not None and bool(pooled.driver_connection.in_transaction)
        if self._stage == _COMMITTING:
            self._stage = _OPEN if open_transaction else _COMMITTED
        if self._stage != _COMMITTED and open_transaction:
            assert conn is not None
            uow._end_group(conn, len(self._group), error)

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
        self._uow._count_writes(done)

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


def _uninterrupted(step: Callable[[], None]) -> None:
    """Run ``step`` (idempotent bookkeeping) to its end, again if an interrupt (Ctrl-C)
    cut it short: the interrupt being raised already is the one its caller gets."""
    while True:
        try:
            step()
            return
        except Exception:
            raise
        except BaseException:
            continue
