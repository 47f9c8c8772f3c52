"""What a Unit of Work does differently on SQLite and on PostgreSQL, one strategy object each.

The Unit of Work (:mod:`hermes_store.uow.unit`) picks its backend once, at construction, as
Alembic picks an implementation per dialect; no call tests the dialect afterwards. A backend
gives the units their turn, their begun connection and their end, and runs the hot paths:
the single-call writes (``hot_write``), one-statement writes and reads (``statement``,
``read``) and the prebuilt reads (``rows``, ``scalar``). Where a path is the general one (a
unit like any other), the backend asks the Unit of Work for it through :class:`Units`.

- :class:`SqliteBackend`: the file's one writer (:mod:`~hermes_store.uow.writer`), its group
  commit (:mod:`~hermes_store.uow.groupcommit`), the held readers
  (:mod:`~hermes_store.uow.readers`), and the file's fork safety.
- :class:`PostgresBackend`: pooled units, and one statement as its own transaction on the
  autocommit twin (:mod:`~hermes_store.uow.autocommit`), grouped by
  :mod:`~hermes_store.uow.pggroup`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool, QueuePool
from sqlalchemy.sql import ClauseElement

from hermes_store.engine import fastpath
from hermes_store.engine.factory import WRITE_OPTION, SqliteSettings
from hermes_store.errors import ForkedProcessError, connection_lost, is_retryable
from hermes_store.uow import fork, pggroup, retry, writequeue
from hermes_store.uow.autocommit import Autocommit
from hermes_store.uow.counters import Counters
from hermes_store.uow.groupcommit import GroupCommit
from hermes_store.uow.interrupts import NOTHING_HELD, Holding, NothingHeld
from hermes_store.uow.readers import HeldReaders
from hermes_store.uow.uncontended import Missed, Uncontended
from hermes_store.uow.writer import SqliteWriter, again, discard, reraise, store_closed

T = TypeVar("T")


class Units(Protocol):
    """The general paths of the Unit of Work, for a backend whose hot path is one of them."""

    def run_own(self, fn: Callable[[Connection], T], *, write: bool) -> T: ...

    def reading(self) -> AbstractContextManager[Connection]: ...

    def read(self, fn: Callable[[Connection], T]) -> T: ...


def on_driver(fn: Callable[[Any], T]) -> Callable[[Connection], T]:
    """A unit given the DB-API connection itself, as a unit given the Connection."""

    def unit(conn: Connection) -> T:
        return fn(conn.connection.driver_connection)

    return unit


def rollback(conn: Connection) -> None:
    """Roll back a pooled unit's connection; one whose rollback failed or was cut short (an
    interrupt: SQLAlchemy's state for it is unknown) is discarded, never pooled again, and the
    interrupt is what goes on."""
    try:
        conn.rollback()
    except sa_exc.DBAPIError:
        conn.invalidate()
        raise
    except BaseException as error:
        discard(conn)
        reraise(error)


class SqliteBackend:
    """A SQLite file: one writer per process, group commit, held readers, fork safety."""

    #: Write units wait for the file's one writer: a write from the thread that runs an open
    #: block's body would wait for itself.
    serialises_writers = True

    def __init__(
        self,
        engine: Engine,
        settings: SqliteSettings,
        *,
        policy: retry.RetryPolicy,
        counters: Counters,
        queue_path: Path | None,
        wal_path: str | None,
        file_key: tuple[int, int] | None,
        group_commit: bool,
        uncontended: bool,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.counters = counters
        self.file_key = file_key
        self._reader_engine = engine.execution_options(**{WRITE_OPTION: False})
        self.writer = SqliteWriter(
            engine,
            settings,
            policy=policy,
            counters=counters,
            queue_path=queue_path,
            wal_path=wal_path,
            file_key=file_key,
            where=str(queue_path or engine.url.database),
        )
        self.readers = HeldReaders(engine, settings, counters)
        self.group: GroupCommit | None = None
        if group_commit:
            self.group = GroupCommit(self.writer, counters)
        #: A write that finds no one else writing goes straight in (chosen once, here).
        self.uncontended: Uncontended | None = None
        if uncontended:
            self.uncontended = Uncontended(self.writer, self.group, counters)
        # Fork: while a fork closes this file's connections no new one is opened (the gate).
        self.gate = fork.Gate()
        self._fork_locks: list[Any] = []

    # -- a unit's turn, begin and end --------------------------------------------------------

    def turn(self) -> Holding[writequeue.Turn | None]:
        return self.writer.turn()

    def begin(
        self, write: bool, waits: Iterator[float], turn: writequeue.Turn | None
    ) -> Connection:
        """A unit's begun connection: the writer's (``BEGIN IMMEDIATE``), or a pooled read
        connection (a deferred ``BEGIN``)."""
        if write:
            return self.writer.begin_unit(waits, turn)
        if self.writer.closed:
            raise store_closed()
        while True:
            refused = self.writer.refused
            if isinstance(refused, ForkedProcessError):
                raise again(refused)
            conn = self._reader_engine.connect()
            try:
                conn.begin()
            except sa_exc.DBAPIError as error:
                conn.close()
                if not is_retryable(error):
                    raise
                retry.pause(self.policy, waits, error, self.counters)
                continue
            except BaseException:  # an interrupt: given back now, not left to the collector
                conn.close()
                raise
            return conn

    def abort(self, conn: Connection) -> None:
        """Roll back a unit that raised."""
        self.counters.record_rollback()
        if conn is self.writer.connection:
            self.writer.rollback(conn)
            return
        rollback(conn)

    def discard(self, conn: Connection) -> None:
        """Close a unit's connection for good (its rollback was cut short before it began)."""
        self.writer.discard(conn)

    def put_back(self, conn: Connection) -> None:
        """A unit ended: its connection goes back to the pool (the writer's stays open); once
        the store closed, it is closed instead (a pool of a closed store keeps nothing)."""
        writer = self.writer
        if conn is not writer.connection:
            if writer.closed and not conn.closed:
                conn.invalidate()
            conn.close()

    def acknowledge(self, conn: Connection) -> None:
        """A write unit committed: the writer's WAL must still be the file's."""
        if conn is self.writer.connection:
            self.writer.acknowledge()

    # -- the hot paths -----------------------------------------------------------------------

    def hot_write(self, units: Units, fn: Callable[[Connection], T]) -> T:
        """A single-call write outside any unit (``fn`` uses only the DB-API cursor): straight
        in when no one else writes (:mod:`~hermes_store.uow.uncontended`); else in the line, in
        a group when group commit is on, or alone on the writer's driver connection; a lock met
        re-runs it whole."""
        uncontended = self.uncontended
        if uncontended is not None:
            straight = uncontended.run(fn)
            if not isinstance(straight, Missed):
                return straight
        return self._in_line(fn)

    def hot_driver_write(self, units: Units, fn: Callable[[Any], T]) -> T:
        """:meth:`hot_write` of a unit given the DB-API connection itself (straight in, no
        Connection to look it up from: the hottest units)."""
        uncontended = self.uncontended
        if uncontended is not None:
            straight = uncontended.run(fn, True)
            if not isinstance(straight, Missed):
                return straight
        return self.in_line_on_driver(fn)

    def in_line_on_driver(self, fn: Callable[[Any], T]) -> T:
        """:meth:`hot_driver_write` past its straight-in try (made, and missed, already)."""
        return self._in_line(on_driver(fn))

    def _in_line(self, fn: Callable[[Connection], T]) -> T:
        """A single-call write that did not go straight in: in the line, in a group when group
        commit is on, or alone on the writer's driver connection; a lock met re-runs it
        whole."""
        group = self.group
        if group is not None:
            done, grouped = group.run(fn)
            if done:
                return grouped  # type: ignore[return-value]
            self.counters.record_rerun()  # its group's transaction was lost: run it again, alone
        writer = self.writer
        waits = self.policy.waits()
        while True:
            try:
                return writer.run_alone(fn, waits)
            except sa_exc.DBAPIError as error:
                if not is_retryable(error):
                    raise
                writer.pause(waits, error)

    def statement(
        self,
        units: Units,
        fn: Callable[[Connection], T],
        *,
        idempotent: bool,
        grouped: pggroup.Grouped[T] | None,
    ) -> T:
        """One write statement: on SQLite a unit like any other."""
        return units.run_own(fn, write=True)

    def read(self, units: Units, fn: Callable[[Connection], T]) -> T:
        """A read of one statement: a read unit (``run_own``'s, which an interrupt never
        leaves open; the Unit of Work checked that none is open to join)."""
        return units.run_own(fn, write=False)

    def rows(
        self,
        units: Units,
        statement: ClauseElement,
        params: Mapping[str, Any] | None,
        expanding: Sequence[str],
    ) -> list[dict[str, Any]]:
        """A prebuilt read on this thread's held read connection (a list parameter: on a read
        unit of its own, through SQLAlchemy)."""
        if self.writer.closed:
            raise store_closed()
        if expanding:
            with units.reading() as conn:
                return fastpath.rows(conn, statement, params, expanding=expanding)
        names, found = self.readers.fetch(statement, params)
        return [dict(zip(names, row, strict=True)) for row in found]

    def scalar(
        self, units: Units, statement: ClauseElement, params: Mapping[str, Any] | None
    ) -> Any:
        if self.writer.closed:
            raise store_closed()
        return self.readers.scalar(statement, params)

    # -- the rest ----------------------------------------------------------------------------

    def checkpoint(self) -> bool:
        return self.writer.checkpoint()

    def queued(self) -> int:
        return self.group.queued() if self.group is not None else 0

    def wait_for_queued(self, count: int, timeout: float) -> bool:
        return self.group.wait_for_queued(count, timeout) if self.group is not None else False

    def wait_for_waiting_writers(self, count: int, timeout: float) -> bool:
        return self.writer.wait_for_waiting(count, timeout)

    def release(self) -> None:
        """Let go of every connection for good (the last store on the file closed): the
        writer and the readers open none again, so work started before is refused."""
        self.writer.release()
        self.readers.release()

    @property
    def closed(self) -> bool:
        return self.writer.closed

    # -- fork ----------------------------------------------------------------------------------

    def gate_connect(self) -> None:
        """Before each new connection: refused in a process refused the file; waits while
        a fork in another thread closes the file's connections."""
        refused = self.writer.refused
        if isinstance(refused, ForkedProcessError):
            raise again(refused)
        self.gate.enter()

    def before_fork(self, deadline: float, *, unit_open: bool) -> str | None:
        """In the forking thread: close every connection on the file, or say why not."""
        if self.file_key is None or self.writer.closed:  # closed: nothing left to close
            return None
        if self.writer.refused is not None:  # its connections stay open: the child is refused
            return f"this process was refused the file: {self.writer.refused}"
        self.gate.shut()
        if unit_open:
            return "a unit (db.transaction(), uow.connect()) was open in its thread"
        lock = self.writer.lock
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return f"another thread's write unit did not end within {fork.FORK_WAIT_S} s"
        self._fork_locks.append(lock)
        self.writer.drop(invalidate=False)
        pool = self.engine.pool
        while True:
            busy = self.readers.close_for_fork(deadline, self._fork_locks)
            if busy is not None:
                return busy
            if isinstance(pool, NullPool):
                return None  # keeps nothing idle; units close their connections
            if not isinstance(pool, QueuePool):
                return f"its engine's pool ({type(pool).__name__}) cannot be emptied"
            fork.close_idle(pool)
            with self.gate.cond:
                in_use = pool.checkedout() - self.gate.waiters
            if in_use <= 0:
                fork.close_idle(pool)  # returned meanwhile (none can be checked out now)
                return None
            if time.monotonic() >= deadline:
                return (
                    f"{in_use} connection(s) stayed in use by other threads (read units, "
                    f"streams, engine.connect()) for {fork.FORK_WAIT_S} s"
                )
            time.sleep(0.001)  # the fork path only: wait for other threads' units to end

    def after_fork_in_parent(self) -> None:
        """The fork happened: let this process's threads go on (connections reopen lazily)."""
        locks, self._fork_locks = self._fork_locks, []
        for lock in locks:
            lock.release()
        self.gate.lift()

    def after_fork_in_child(self, busy: str | None) -> None:
        """Forget the parent's connections without touching them; when one of them was in
        use at the fork (``busy`` says which), refuse the file in this process."""
        inherited = (self.writer.connection, *self.readers.forget_in_child(), self.engine.pool)
        if busy is not None and self.file_key is not None:
            fork.REFUSED[self.file_key] = ForkedProcessError(
                f"this process was forked while {self.writer.where} "
                f"was in use by its parent ({busy}): it inherited SQLite's lock "
                "records without the locks, so it must not use that file (its writes could be "
                "lost or corrupt it). Fork outside db.transaction() blocks and while other "
                "threads are idle, or start the process with 'spawn' or 'forkserver'"
            )
            fork.keep_forever(inherited)  # never closed or rolled back here, even at exit
        else:
            fork.INHERITED.append(inherited)


class PostgresBackend:
    """A PostgreSQL database: pooled units, and one-statement writes and reads on the
    autocommit twin (grouped, unless ``group_commit`` is off or the engine is asyncio's)."""

    #: The server orders writers: no unit waits for another unit of this process.
    serialises_writers = False

    def __init__(
        self,
        engine: Engine,
        *,
        policy: retry.RetryPolicy,
        counters: Counters,
        group_commit: bool,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.counters = counters
        self._writer_engine = engine.execution_options(**{WRITE_OPTION: True})
        # A read unit is READ ONLY on the server too (psycopg's BEGIN READ ONLY).
        self._reader_engine = engine.execution_options(
            **{WRITE_OPTION: False, "postgresql_readonly": True}
        )
        self.autocommit = Autocommit(engine, policy, counters)
        #: Released for good (its store closed): no unit or statement opens a connection.
        self.closed = False
        # Not under AsyncSessionDB: its calls share one thread (greenlets), so a caller waiting
        # for another's group would block the very thread that must finish it.
        self.group: pggroup.PgGroupCommit | None = None
        if group_commit and not engine.dialect.is_async:
            outlet = pggroup.Outlet(engine, counters)
            self.group = pggroup.PgGroupCommit(pggroup.for_database(engine), outlet)

    # -- a unit's turn, begin and end --------------------------------------------------------

    def turn(self) -> NothingHeld:
        return NOTHING_HELD

    def begin(self, write: bool, waits: Iterator[float], turn: object) -> Connection:
        """A unit's begun pooled connection; a server not reachable is waited for."""
        if self.closed:
            raise store_closed()
        engine = self._writer_engine if write else self._reader_engine
        patience: retry.Patience | None = None
        while True:
            try:
                conn = engine.connect()
            except sa_exc.DBAPIError as error:
                # A server not reachable (restarting): nothing was sent, wait for it.
                if not connection_lost(error):
                    raise
                patience = patience or retry.Patience(self.policy, self.counters)
                patience.pause(error, write=write)
                continue
            try:
                conn.begin()
            except sa_exc.DBAPIError as error:
                conn.close()
                if not is_retryable(error):
                    raise
                retry.pause(self.policy, waits, error, self.counters)
                continue
            except BaseException:  # an interrupt: given back now, not left to the collector
                conn.close()
                raise
            return conn

    def abort(self, conn: Connection) -> None:
        """Roll back a unit that raised (a connection that cannot is discarded)."""
        self.counters.record_rollback()
        rollback(conn)

    def discard(self, conn: Connection) -> None:
        """Close a unit's connection for good (its rollback was cut short before it began)."""
        discard(conn)

    def put_back(self, conn: Connection) -> None:
        conn.close()

    def acknowledge(self, conn: Connection) -> None:
        """Nothing to check after a commit: the server said it is durable."""

    # -- the hot paths -----------------------------------------------------------------------

    def hot_write(self, units: Units, fn: Callable[[Connection], T]) -> T:
        """A single-call write: a unit like any other (its statements need a transaction)."""
        return units.run_own(fn, write=True)

    def hot_driver_write(self, units: Units, fn: Callable[[Any], T]) -> T:
        """:meth:`hot_write` of a unit given the DB-API connection itself."""
        return units.run_own(on_driver(fn), write=True)

    def statement(
        self,
        units: Units,
        fn: Callable[[Connection], T],
        *,
        idempotent: bool,
        grouped: pggroup.Grouped[T] | None,
    ) -> T:
        """One write statement as its own transaction on the autocommit twin: in a group with
        the process's concurrent ones when it comes prebuilt (``grouped``)."""
        if self.closed:
            raise store_closed()
        group = self.group
        if grouped is not None and group is not None:
            grouped.idempotent = idempotent
            return group.run(
                grouped,
                lambda: self.autocommit.run(
                    fn, write=True, idempotent=idempotent, maybe_landed=grouped.maybe_landed
                ),
            )
        return self.autocommit.run(fn, write=True, idempotent=idempotent)

    def read(self, units: Units, fn: Callable[[Connection], T]) -> T:
        """A read of one statement (or of statements that need no common snapshot): on the
        autocommit twin, one round trip per statement; a lost connection is retried."""
        if self.closed:
            raise store_closed()
        return self.autocommit.run(fn, write=False, idempotent=True)

    def rows(
        self,
        units: Units,
        statement: ClauseElement,
        params: Mapping[str, Any] | None,
        expanding: Sequence[str],
    ) -> list[dict[str, Any]]:
        return units.read(lambda conn: fastpath.rows(conn, statement, params, expanding=expanding))

    def scalar(
        self, units: Units, statement: ClauseElement, params: Mapping[str, Any] | None
    ) -> Any:
        found = self.rows(units, statement, params, ())
        return next(iter(found[0].values())) if found else None

    # -- the rest ----------------------------------------------------------------------------

    def checkpoint(self) -> bool:
        """No WAL to checkpoint: the server does its own."""
        return False

    def queued(self) -> int:
        return self.group.queued() if self.group is not None else 0

    def wait_for_queued(self, count: int, timeout: float) -> bool:
        return self.group.wait_for_queued(count, timeout) if self.group is not None else False

    def wait_for_waiting_writers(self, count: int, timeout: float) -> bool:
        """No unit waits for another of this process on PostgreSQL: False once ``timeout``
        passed."""
        time.sleep(max(0.0, timeout))
        return False

    def release(self) -> None:
        """Nothing held between units (pooled connections go back as units end): from now
        on no unit or statement opens a connection (the store closed)."""
        self.closed = True

    # -- fork ----------------------------------------------------------------------------------

    def gate_connect(self) -> None:
        """No file to guard."""

    def before_fork(self, deadline: float, *, unit_open: bool) -> str | None:
        return None

    def after_fork_in_parent(self) -> None:
        pass

    def after_fork_in_child(self, busy: str | None) -> None:
        """The parent's pooled connections are kept, never closed here (closing a socket the
        parent shares would end its session)."""
        fork.INHERITED.append(self.engine.pool)
