"""The Unit of Work: one connection, one transaction, commit on success, rollback on error.

Every unit, read or write, hot path included, begins through ``engine.begin_on_driver`` (the
engine's begin hook; SQLite: ``BEGIN IMMEDIATE`` for writes, a deferred ``BEGIN`` for reads).
Repositories take the unit's connection and never begin or commit. Units compose: the open
unit of a thread (or asyncio task) is kept in a :class:`~contextvars.ContextVar`, and any unit
asked for meanwhile joins it.

Retries (:mod:`hermes_store.uow.retry`): a unit that meets a lock before it ran anything
(waiting for ``BEGIN IMMEDIATE``) is retried up to 15 times, ``random.uniform(0.020, 0.150)`` s
apart, the original store's policy that keeps competing processes from retrying in lockstep.
``run(fn)`` also re-runs ``fn`` whole on a lock met midway; a ``transaction()`` block runs
once, so a lock met inside it rolls the block back and raises :class:`DatabaseLockedError`.

What differs between SQLite and PostgreSQL is the backend (:mod:`hermes_store.uow.backends`),
picked once here at construction: on SQLite the file's one writer with its fair queue and
group commit, held readers and fork safety; on PostgreSQL pooled units and one statement as
its own transaction on the autocommit twin.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, NestedTransaction
from sqlalchemy.sql import ClauseElement

from hermes_store.engine import fastpath
from hermes_store.engine.factory import (
    SqliteSettings,
    autocommit_engine,
    install_sqlite_hooks,
    sqlite_file,
    sqlite_settings,
)
from hermes_store.errors import (
    SQLITE_READONLY,
    DatabaseLockedError,
    DatabaseUnavailableError,
    ForkedProcessError,
    ReadOnlyUnitError,
    StoreMisuseError,
    TransactionMisuseError,
    WriteNotLandedError,
    WriteOutcomeUnknownError,
    is_retryable,
    mapped_errors,
    server_connection_lost,
    wrap_driver_error,
)
from hermes_store.uow import fork, groupcommit, pggroup, retry, uncontended, writequeue
from hermes_store.uow.backends import PostgresBackend, SqliteBackend, on_driver
from hermes_store.uow.counters import Counters, StoreStats
from hermes_store.uow.fork import FORK_WAIT_S
from hermes_store.uow.interrupts import NOTHING_HELD, Holding, holding
from hermes_store.uow.readers import MAX_HELD_READERS
from hermes_store.uow.retry import DEFAULT_UNAVAILABLE_TIMEOUT_S, RetryPolicy
from hermes_store.uow.writer import QUEUE_HEAD_BUSY_TIMEOUT_S, WAL_CHECK_EVERY_S, reraise

__all__ = [
    "DEFAULT_UNAVAILABLE_TIMEOUT_S",
    "FORK_WAIT_S",
    "MAX_HELD_READERS",
    "QUEUE_HEAD_BUSY_TIMEOUT_S",
    "WAL_CHECK_EVERY_S",
    "RetryPolicy",
    "StoreStats",
    "Unit",
    "UnitOfWork",
    "driver_cursor",
]

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A SQLite file's straight-in try (:meth:`Uncontended.run`) and its line when that missed
#: (:meth:`SqliteBackend.in_line_on_driver`).
_Straight = tuple[
    Callable[[Callable[[Any], Any], bool], Any], Callable[[Callable[[Any], Any]], Any]
]

#: Open write blocks on PostgreSQL of every Unit of Work in this process, each with the
#: database whose rows it may hold locked (see :meth:`UnitOfWork._refuse_other_store`).
_SERVER_BLOCKS: dict[Unit, UnitOfWork] = {}
os.register_at_fork(after_in_child=_SERVER_BLOCKS.clear)  # the parent's blocks, not the child's
#: Which tables a PostgreSQL connection writes, asked of the server (an address can be spelled
#: many ways, PgBouncer in front of it too): the server by its start time and port, then the
#: database, then the schema (inside a unit: the placement's ``search_path``).
_TABLES_SQL = (
    "SELECT pg_postmaster_start_time()::text, current_setting('port'), current_database(), "
    "current_schema()"
)


def _tables_of(conn: Connection) -> tuple[object, ...]:
    """The identity of the tables ``conn`` writes (one round trip)."""
    return tuple(conn.exec_driver_sql(_TABLES_SQL).one())


#: The task an ``AsyncSessionDB`` call was made in: the call itself runs in a task (and
#: SQLAlchemy's greenlet) of its own, so that task is not the caller's.
CALLING_TASK: ContextVar[asyncio.Task[Any] | None] = ContextVar("hermes_calling_task", default=None)


def _running_task() -> asyncio.Task[Any] | None:
    """The asyncio task this code was called from, if any."""
    task = CALLING_TASK.get()
    if task is not None:
        return task
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop runs in this thread
        return None


#: Frames that can be suspended and resumed in another thread: generators and coroutines.
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class _Nested:
    """A nested ``transaction()`` block: its SAVEPOINT, and whether a block it was opened in
    ended first and rolled it back (``orphaned``: its own exit never touches the connection,
    which may be another unit's by then)."""

    __slots__ = ("orphaned", "savepoint")

    def __init__(self, savepoint: NestedTransaction) -> None:
        self.savepoint = savepoint
        self.orphaned = False


class Unit:
    """An open unit: its connection, whether it may write, and who owns it.

    ``owner``: the thread that opened it (and whose context holds it); ``body_thread``: the
    thread that runs the block's code, which must never wait for this unit's writer (the owner,
    except for ``AsyncSessionDB``'s blocks: the event loop's thread); ``frames``: the
    generators and coroutines the block was opened in (resumed in another thread, they run
    inside a block that thread cannot join); ``closed``: ended, perhaps by another thread.
    """

    __slots__ = (
        "body_thread",
        "closed",
        "conn",
        "frames",
        "misnested",
        "nested",
        "opener",
        "owner",
        "task",
        "write",
    )

    def __init__(self, conn: Connection, write: bool) -> None:
        self.conn = conn
        self.write = write
        self.owner = self.body_thread = threading.get_ident()
        self.frames: tuple[FrameType, ...] = ()
        self.closed = False
        #: The nested ``transaction()`` blocks open in it, innermost last (see _savepoint).
        self.nested: list[_Nested] = []
        #: One of its blocks ended before a block opened inside it: it never commits.
        self.misnested = False
        #: A write block's: the thread that opened it (an ident may be reused once it ends).
        self.opener: threading.Thread | None = None
        #: A PostgreSQL write block's: the asyncio task it was opened in, if any.
        self.task: asyncio.Task[Any] | None = None


def driver_cursor(conn: Connection) -> Any:
    """A DB-API cursor on the unit's own connection (the SQLite hot path's statements)."""
    return conn.connection.driver_connection.cursor()  # type: ignore[union-attr]


class UnitOfWork:
    """Runs read and write units against one engine; thread-safe, shared by a whole process.

    ``with uow.transaction():`` (or ``uow.connect()`` / ``uow.session()``) opens a unit that
    every unit asked for in the same thread or task joins; ``uow.run(fn)`` re-runs
    ``fn(connection)`` whole on lock errors when it opens the unit itself.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        retry: RetryPolicy | None = None,
        checkpoint_every: int = 50,
        write_queue: bool = True,
        group_commit: bool | None = None,
    ) -> None:
        self.engine = engine
        self.retry = retry or RetryPolicy()
        self.checkpoint_every = checkpoint_every
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._dialect = engine.dialect
        #: An asyncio engine's sync side (AsyncSessionDB on PostgreSQL): usable only in the
        #: greenlet SQLAlchemy runs it in.
        self._asyncio = engine.dialect.is_async
        #: PostgreSQL: the tables this Unit of Work writes (:func:`_tables_of`), asked once,
        #: when a block opens or a write meets another store's block. SQLite needs none: the
        #: stores of a file in a process share one Unit of Work, so one's block is joined.
        self._tables: tuple[object, ...] | None = None
        self.settings: SqliteSettings | None = None
        if self.is_sqlite:
            self.settings = sqlite_settings(engine) or install_sqlite_hooks(engine)
        # Across processes and threads, writers to a SQLite file line up in the fair writer
        # queue (off with write_queue=False or HERMES_STORE_WRITE_QUEUE=0: benchmarks).
        path = sqlite_file(engine.url) if self.is_sqlite else None
        self._queue_path = path if write_queue else None
        #: The file's identity and its WAL's path (fork safety, the WAL check of each commit).
        self._file_key: tuple[int, int] | None = None
        self._wal_path: str | None = None
        if path is not None:
            try:
                st = os.stat(path)
            except OSError:
                pass  # not created yet (an Engine on a new file): no fork or WAL bookkeeping
            else:
                self._file_key = (st.st_dev, st.st_ino)
                self._wal_path = f"{os.path.realpath(path)}-wal"  # beside a symlink's target
        if group_commit is None:
            switch = os.environ.get(groupcommit.ENV_SWITCH, "1").lower()
            group_commit = switch not in ("0", "off", "false", "no")
        self._group_commit = group_commit
        switch = os.environ.get(uncontended.ENV_SWITCH, "1").lower()
        self._uncontended = switch not in ("0", "off", "false", "no")
        # The backend, picked once: every process state below is remade in a forked child.
        self._make_backend: Callable[[Counters], SqliteBackend | PostgresBackend] = (
            self._sqlite_backend if self.settings is not None else self._postgres_backend
        )
        self._fork_busy: str | None = None  # why the last fork could not close the file
        #: Released for good (the last store on it closed): its backend opens no connection.
        self.closed = False
        self._fresh_process_state()
        if self._file_key is not None:
            owner = weakref.ref(self)

            def gate_connect(*_args: Any) -> None:
                uow = owner()
                if uow is not None:
                    uow.backend.gate_connect()

            event.listen(engine, "do_connect", gate_connect)
        fork.register(self)

    def _sqlite_backend(self, counters: Counters) -> SqliteBackend:
        assert self.settings is not None
        return SqliteBackend(
            self.engine,
            self.settings,
            policy=self.retry,
            counters=counters,
            queue_path=self._queue_path,
            wal_path=self._wal_path,
            file_key=self._file_key,
            group_commit=self._group_commit,
            uncontended=self._uncontended,
        )

    def _postgres_backend(self, counters: Counters) -> PostgresBackend:
        return PostgresBackend(
            self.engine, policy=self.retry, counters=counters, group_commit=self._group_commit
        )

    def _fresh_process_state(self) -> None:
        """Counters, backend (connections, locks) and the open-unit variable of this process
        (after a fork the child gets new ones and never touches its parent's)."""
        self._pid = os.getpid()
        self._current: ContextVar[Unit | None] = ContextVar(f"hermes_unit_{id(self)}", default=None)
        self._blocks: set[Unit] = set()  # open write blocks (transaction(), connect(), session())
        self.counters = Counters(self.checkpoint_every)
        self._blocks_lock = self.counters.lock
        self.backend = backend = self._make_backend(self.counters)
        if self.closed:  # a forked child's copy of a closed one: closed too
            backend.release()
        self.counters.checkpoint = backend.checkpoint
        # The hottest writes' straight-in try and their line, looked up once (run_on_driver).
        self._straight: _Straight | None = None
        if isinstance(backend, SqliteBackend) and backend.uncontended is not None:
            self._straight = (backend.uncontended.run, backend.in_line_on_driver)

    # -- what it holds and counts --------------------------------------------------------------

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters (shared by every store on the file in this process)."""
        return self.counters.snapshot()

    @property
    def writes(self) -> int:
        """Committed write units (kept for callers of the first release)."""
        return self.stats.write_units

    @property
    def checkpoints(self) -> int:
        return self.stats.checkpoints

    @property
    def group(self) -> groupcommit.GroupCommit | pggroup.PgGroupCommit | None:
        """This store's group commit (None: off)."""
        return self.backend.group

    @property
    def statement_groups(self) -> pggroup.StatementGroups | None:
        """PostgreSQL: the statement groups this store's one-statement writes join (shared by
        every store on the database and schema in this process); None on SQLite or when off."""
        group = self.backend.group
        return group.groups if isinstance(group, pggroup.PgGroupCommit) else None

    @property
    def write_queue(self) -> writequeue.WriteQueue | None:
        """This process's fair writer queue for the database file (None: not a file, or off)."""
        backend = self.backend
        return backend.writer.write_queue if isinstance(backend, SqliteBackend) else None

    @property
    def wal_check_every(self) -> float:
        """Seconds between two checks that the writer's WAL is still the file's."""
        backend = self.backend
        if isinstance(backend, SqliteBackend):
            return backend.writer.wal_check_every
        return WAL_CHECK_EVERY_S

    @wal_check_every.setter
    def wal_check_every(self, seconds: float) -> None:
        backend = self.backend
        if isinstance(backend, SqliteBackend):
            backend.writer.wal_check_every = seconds

    @property
    def autocommit_engine(self) -> Engine:
        """The autocommit twin of a PostgreSQL engine (see :func:`engine.autocommit_engine`)."""
        return autocommit_engine(self.engine)

    def wait_for_waiting_writers(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` threads wait for their write turn (False: timed out);
        lets callers and tests know a writer is queued without polling."""
        return self.backend.wait_for_waiting_writers(count, timeout)

    def queued_units(self) -> int:
        """Hot writes of this process waiting for a group (0 without group commit)."""
        return self.backend.queued()

    def wait_for_queued_units(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` hot writes wait for a group (False: timed out, or no
        group commit); lets tests and callers know writes are queued without polling."""
        return self.backend.wait_for_queued(count, timeout)

    # -- the units ---------------------------------------------------------------------------

    def current(self) -> Unit | None:
        """The unit open in this thread or task, if any."""
        return self._joinable()

    def _joinable(self) -> Unit | None:
        """The open unit of this thread or task; one that another thread ended (a misuse it
        was told about, and rolled back) is forgotten here."""
        unit = self._current.get()
        if unit is not None and unit.closed:
            self._current.set(None)
            return None
        return unit

    @holding
    def unit(self, *, write: bool = True) -> Iterator[Unit]:
        """A unit: joins the open one, else begins one (waiting for the lock is retried)."""
        open_unit = self._joinable()
        if open_unit is not None:
            if write and not open_unit.write:
                raise ReadOnlyUnitError(
                    "a write inside a read-only unit (uow.connect(write=False)); open a write "
                    "unit (db.transaction() or uow.connect()) for it"
                )
            yield open_unit
            return
        if self._blocks or self._asyncio or _SERVER_BLOCKS:
            self._refuse_foreign_block(write)
        taking = self._own_unit(write, self.retry.waits())
        try:
            with taking as unit:
                if not write:
                    yield unit
                    return
                self._open_block(unit)
                try:
                    yield unit
                except BaseException as error:
                    self._refuse_foreign_exit(unit, error)
                    _refuse_misnested(unit, error)
                    raise
                else:
                    self._refuse_foreign_exit(unit, None)
                    _refuse_misnested(unit, None)
                finally:
                    with self._blocks_lock:
                        self._blocks.discard(unit)
                    _SERVER_BLOCKS.pop(unit, None)
                    unit.closed = True
                    unit.frames = ()
        except BaseException:
            taking.release()  # an interrupt as the unit was given or its with ended
            raise

    # -- who may use an open block -----------------------------------------------------------

    def _open_block(self, unit: Unit) -> None:
        """Register a write block with the generators and coroutines it is opened in."""
        frames: list[FrameType] = []
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_flags & _RESUMABLE and frame.f_code.co_filename != __file__:
                frames.append(frame)
            frame = frame.f_back
        unit.frames = tuple(frames)
        unit.opener = threading.current_thread()
        with self._blocks_lock:
            self._blocks.add(unit)
        if not self.is_sqlite:
            if self._asyncio:  # asked now, in SQLAlchemy's greenlet: a sync caller cannot
                self.tables()
            unit.task = _running_task()
            _SERVER_BLOCKS[unit] = self

    def _refuse_foreign_block(self, write: bool) -> None:
        """Refuse, before it waits, a call that could only wait forever: one made inside a
        block opened in another thread or context (a generator that opened it, resumed
        elsewhere), a write while a block opened by a thread that has ended is still open, or a
        write from the thread that runs an open block's body (another asyncio task's sync
        block, an ``AsyncSessionDB`` block of this loop): on SQLite it holds the writer, on
        PostgreSQL the rows it changed."""
        if self._asyncio:
            _refuse_outside_greenlet()
        with self._blocks_lock:
            # A block whose unit ended is gone: one an interrupt (Ctrl-C) cut short before
            # its body's ``try`` stays registered, its unit closed.
            self._blocks.difference_update([block for block in self._blocks if block.closed])
            blocks = list(self._blocks)
        if write and _SERVER_BLOCKS:
            self._refuse_other_store()
        if not blocks:
            return
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_flags & _RESUMABLE:
                for block in blocks:
                    if frame in block.frames:
                        raise TransactionMisuseError(
                            "this code runs inside a transaction() block opened in another "
                            f"thread or context ({frame.f_code.co_name}() opened it, then was "
                            "resumed here): a transaction belongs to the thread that opened it. "
                            "Open and end the block in the same thread (or give this code its "
                            "own block)"
                        )
            frame = frame.f_back
        if not write:
            return
        for block in blocks:
            if block.opener is not None and not block.opener.is_alive():
                raise TransactionMisuseError(
                    f"a transaction() block opened by thread {block.opener.name!r}, which "
                    "has ended, is still open (a generator holding it, kept unfinished): it "
                    "holds the database's write lock (SQLite) or its rows' locks (PostgreSQL), "
                    "so this write could wait for it forever. Close that generator (its "
                    "close() rolls the block back) or let it go"
                )
        # An AsyncSessionDB's calls on PostgreSQL run on the loop's thread, the one its
        # blocks' bodies run on, but they await in SQLAlchemy's greenlet: a wait for another
        # task's block never stops that block, which goes on and commits.
        me = threading.get_ident()
        if not self._asyncio and any(block.body_thread == me for block in blocks):
            raise TransactionMisuseError(
                "a write from a thread whose own open transaction() block (in another asyncio "
                "task or context, or AsyncSessionDB's async with adb.transaction()) holds the "
                "database's write lock (SQLite) or its rows' locks (PostgreSQL): it could wait "
                "for itself forever. Make the call inside that block (await adb.<method>() in "
                "an async block), or after it"
            )

    def _refuse_other_store(self) -> None:
        """Refuse, before it waits, a write through this store that could only wait for
        another store's open block on the same PostgreSQL tables (a second ``SessionDB`` or an
        ``AsyncSessionDB``): from the thread that runs that block (the write would hold the
        thread the block needs), or awaited in the task that opened it. It cannot join that
        block (another engine, another connection), and a row the block changed keeps it
        waiting for the block, which waits for it. On SQLite the stores of a file share one
        Unit of Work, so such a write joins the block. An ``AsyncSessionDB`` write awaited in
        another task waits without blocking the loop: the block's task goes on and commits."""
        if self.is_sqlite:
            return
        others = []
        for block in list(_SERVER_BLOCKS):
            if block.closed:  # one an interrupt cut short before its body: never unregistered
                _SERVER_BLOCKS.pop(block, None)
            elif block not in self._blocks:
                others.append(block)
        if not others:
            return
        if self._asyncio:
            task = _running_task()
            others = [block for block in others if task is not None and block.task is task]
        else:
            me = threading.get_ident()
            others = [
                block
                for block in others  # an ended opener's ident may be another thread's by now
                if me in (block.owner, block.body_thread)
                and (block.opener is None or block.opener.is_alive())
            ]
        if not others:
            return
        mine = self.tables()
        owners = [_SERVER_BLOCKS.get(block) for block in others]
        if any(owner is not None and owner.tables() == mine for owner in owners):
            raise TransactionMisuseError(
                "a write through a second store on the same PostgreSQL database, from the "
                "thread or task that runs an open transaction() block of another store: it "
                "cannot join that block, and could wait forever for a row the block changed. "
                "Make the call through the store that opened the block, or after the block"
            )

    def tables(self) -> tuple[object, ...]:
        """PostgreSQL: which tables this Unit of Work writes (:func:`_tables_of`), asked once
        on a connection of its own (never inside a unit: a block's first statement may have
        to be its first, as ``SET TRANSACTION`` must)."""
        tables = self._tables
        if tables is None:
            with mapped_errors(), self.engine.connect() as conn:
                tables = self._tables = _tables_of(conn)
        return tables

    def _refuse_foreign_exit(self, unit: Unit, error: BaseException | None) -> None:
        """A block ended by another thread or context (a generator closed elsewhere) is
        rolled back and refused, never committed from there."""
        if unit.owner == threading.get_ident() and self._current.get() is unit:
            return
        if isinstance(error, (TransactionMisuseError, GeneratorExit)):
            return
        raise TransactionMisuseError(
            "a transaction() block was ended in another thread or context than the one that "
            "opened it (a generator resumed elsewhere): a transaction belongs to the thread "
            "that opened it; the block was rolled back"
        ) from error

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A read connection that others do not join: the open unit's if there is one, else
        a read unit of its own (for generators, which yield to code that may open units)."""
        open_unit = self._joinable()
        if open_unit is not None:
            with mapped_errors():
                yield open_unit.conn
            return
        if self._blocks or self._asyncio or _SERVER_BLOCKS:
            self._refuse_foreign_block(False)
        yield from self._connection_of(self._own_unit(False, self.retry.waits(), publish=False))

    @holding
    def _own_unit(
        self, write: bool, waits: Iterator[float], *, publish: bool = True
    ) -> Iterator[Unit]:
        backend = self.backend
        stage = _Stage()
        taking = backend.turn() if write else NOTHING_HELD
        try:
            with (
                taking as turn,
                mapped_errors(write=write),
                _write_outcome(stage) if write and not backend.serialises_writers else NOTHING_HELD,
            ):
                yield from self._begun(backend, write, waits, turn, stage, publish)
        except BaseException:
            taking.release()  # an interrupt as the turn was given or its with ended
            raise
        self.counters.count(write)

    def _begun(
        self,
        backend: SqliteBackend | PostgresBackend,
        write: bool,
        waits: Iterator[float],
        turn: writequeue.Turn | None,
        stage: _Stage,
        publish: bool,
    ) -> Iterator[Unit]:
        """:meth:`_own_unit`'s unit in its turn: begun, yielded, then committed, or rolled back
        on anything raised once the BEGIN returned (an interrupt too)."""
        current = self._current  # a forked child gets a new variable: reset this one
        forks = fork.generation
        inherited = False
        conn: Connection | None = None
        unit: Unit | None = None
        try:
            conn = backend.begin(write, waits, turn)
            unit = Unit(conn, write)
            if publish:
                current.set(unit)
            yield unit
            if forks != fork.generation:
                inherited = True
                raise fork.left_in_child(write)
            if unit.nested or unit.misnested:  # a run(fn) left a block open: never committed
                _refuse_misnested(unit, None)
            stage.committing = True
            conn.commit()
        except BaseException as error:
            if conn is None:
                raise  # the begin failed: it left nothing begun
            if inherited or forks != fork.generation:
                # The parent's transaction: never committed, rolled back or closed here.
                inherited = True
                fork.keep_forever(conn)
                if isinstance(error, ForkedProcessError) or not isinstance(error, Exception):
                    raise
                raise fork.left_in_child(write) from error
            try:
                backend.abort(conn)
            except BaseException as failed:
                if not isinstance(failed, sa_exc.DBAPIError):  # cut short before it rolled
                    backend.discard(conn)  # back: closed (SQLite then frees its lock)
                raise
            if not write and _is_readonly_refusal(error):
                raise ReadOnlyUnitError(
                    f"a write inside a read-only unit (uow.connect(write=False)): {error}"
                ) from error
            reraise(error)  # SQLAlchemy's commit, interrupted midway: the interrupt
        finally:
            if unit is not None:
                # First, and without a call (an interrupt lands only at one): a unit left
                # current by an interrupt in what follows is closed, so never joined.
                unit.closed = True
                # Set back by value, not with set()'s token: an interrupt can land between
                # set() and storing its token. Never from another context: refused there.
                if current.get() is unit:
                    current.set(None)
            if conn is not None and not inherited:
                backend.put_back(conn)
        if write:
            backend.acknowledge(conn)

    def run(
        self, fn: Callable[[Connection], T], *, write: bool = True, driver_only: bool = False
    ) -> T:
        """Run ``fn`` in one unit; on a lock error, run it again on a fresh connection.

        Inside an open unit ``fn`` joins it and runs once (a lock error then ends the whole
        unit: see :meth:`transaction`); its errors are named as they are outside a block, so
        code inside the block can catch them by the package's names. ``driver_only``: ``fn``
        runs its statements on the connection's DB-API cursor only (the SQLite hot path), so
        on SQLite the unit is begun
        and committed on the driver, through the same begin function as the engine's hook,
        without SQLAlchemy's transaction bookkeeping.
        """
        if self._current.get() is not None:
            with self.unit(write=write) as unit, mapped_errors(write=write):
                return fn(unit.conn)
        if self._blocks or self._asyncio or _SERVER_BLOCKS:
            self._refuse_foreign_block(write)
        if driver_only and write:
            return self.backend.hot_write(self, fn)
        return self.run_own(fn, write=write)

    def run_own(self, fn: Callable[[Connection], T], *, write: bool) -> T:
        """:meth:`run` past its checks (no unit open in this thread, no block refusing the
        call): ``fn`` in a unit of its own, run again on a fresh connection after a lock
        error. For a caller that made the checks itself (a backend's read)."""
        waits = self.retry.waits()
        while True:
            taking = self._own_unit(write, waits)
            try:
                with taking as unit:
                    return fn(unit.conn)
            except sa_exc.DBAPIError as error:
                if not is_retryable(error):
                    raise
                retry.pause(self.retry, waits, error, self.counters)
            except BaseException:
                taking.release()  # an interrupt as the unit was given or its with ended
                raise

    def run_on_driver(self, fn: Callable[[Any], T]) -> T:
        """:meth:`run` with ``driver_only``, ``fn`` given the unit's DB-API connection itself
        (the SQLite hot path's units): a write that goes straight in hands it over as it is,
        with no Connection to look it up from. ``fn`` wraps the driver errors it lets out as
        SQLAlchemy wraps them (:meth:`driver_error`), or lets them out raw."""
        if self._current.get() is None and not self._blocks and not self._asyncio:
            straight = self._straight
            if straight is not None:  # the backend's hot_driver_write, one frame less
                result = straight[0](fn, True)
                if not isinstance(result, uncontended.Missed):
                    return result  # type: ignore[no-any-return]
                return straight[1](fn)  # type: ignore[no-any-return]
            if not _SERVER_BLOCKS:  # PostgreSQL: no block open that a second store could meet
                return self.backend.hot_driver_write(self, fn)
        return self.run(on_driver(fn), driver_only=True)

    @property
    def dbapi_error(self) -> type[Exception]:
        """The base class of the driver's errors (for units given the DB-API connection, as
        ``except uow.dbapi_error``: looked up only when something was raised)."""
        dbapi_error: type[Exception] = self._dialect.loaded_dbapi.Error
        return dbapi_error

    def driver_error(self, sql: str, error: Exception) -> sa_exc.StatementError:
        """A driver error (:attr:`dbapi_error`) raised while running ``sql`` on the DB-API
        connection, wrapped as SQLAlchemy wraps it, so retries and the error mapping see it."""
        return wrap_driver_error(error, self._dialect, sql)

    def run_driver(self, fn: Callable[[Any], T]) -> T:
        """:meth:`run` with ``fn`` given the unit's DB-API cursor (statements compiled once);
        driver errors are wrapped as SQLAlchemy wraps them, so retries see them."""
        dbapi_error: type[Exception] = self.engine.dialect.loaded_dbapi.Error

        def unit(conn: Connection) -> T:
            try:
                return fn(driver_cursor(conn))
            except dbapi_error as orig:
                raise wrap_driver_error(orig, self._dialect) from orig

        return self.run(unit, driver_only=True)

    def connect(self, *, write: bool = True) -> AbstractContextManager[Connection]:
        """A connection inside one unit: commit on a clean exit, rollback otherwise.

        Waiting for the lock is retried; the block itself runs once (use :meth:`run` to
        re-run a whole unit that may meet a lock midway, as on PostgreSQL). Inside an open
        unit it joins that unit.
        """
        return Holding(self._connection_of(self.unit(write=write)))

    def _connection_of(self, units: Holding[Unit]) -> Generator[Connection, None, None]:
        """The connection of the unit ``units`` gives, let go of if an interrupt lands as it
        is given or as its ``with`` ends (a generator: callers wrap it or ``yield from``)."""
        try:
            with units as unit:
                yield unit.conn
        except BaseException:
            units.release()  # an interrupt as the unit was given or its with ended
            raise

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One write unit that every call inside the block (this thread or task) joins.

        ``BEGIN IMMEDIATE`` (retried while another writer holds the lock: nothing ran yet),
        commit at the end, rollback of everything on an exception. The block runs once: a lock
        error inside it (a PostgreSQL deadlock, say) rolls it back and raises
        :class:`DatabaseLockedError`. A nested block is a ``SAVEPOINT`` in the outer one: an
        exception leaving it rolls back that block's writes only (then propagates); the outer
        commit commits the rest. Blocks end innermost first: one that ends while a block opened
        inside it is still open (generators or context managers exited out of order) raises
        :class:`TransactionMisuseError`, and the whole unit is rolled back (see
        :func:`_savepoint`).
        """
        joined = self._current.get() is not None
        taking = self.unit(write=True)
        try:
            with taking as unit:
                if joined:
                    with _savepoint(unit):
                        yield unit.conn
                else:
                    yield unit.conn
        except sa_exc.DBAPIError as error:
            if joined or not is_retryable(error):
                raise
            raise DatabaseLockedError(
                f"the database was locked inside a transaction() block, which was rolled back "
                f"(it runs once; run it again to retry): {error.orig}"
            ) from error
        except BaseException:
            taking.release()  # an interrupt as the unit was given or its with ended
            raise
        if not joined:
            self.counters.record_transaction()

    @contextmanager
    def session(self, *, write: bool = True) -> Iterator[Session]:
        """An ORM session on one connection; flushed and committed when the block succeeds.
        The ORM loads here, for the applications that ask: the store runs Core only."""
        from sqlalchemy.orm import Session

        with self.connect(write=write) as conn, Session(bind=conn, expire_on_commit=False) as s:
            yield s
            s.flush()

    # -- one statement -------------------------------------------------------------------------

    def run_statement(
        self,
        fn: Callable[[Connection], T],
        *,
        idempotent: bool,
        grouped: pggroup.Grouped[T] | None = None,
    ) -> T:
        """Run ``fn``, which issues ONE write statement, as its own transaction.

        PostgreSQL outside a ``transaction()`` block: on the autocommit pool, so the statement
        is the whole round trip (no BEGIN, no COMMIT). A lost connection is retried only when
        the statement provably never reached the server (connecting failed, or the driver
        failed to send it) or when ``idempotent`` (running it twice equals running it once);
        otherwise :class:`DatabaseUnavailableError` says the write may or may not have landed.
        Inside an open unit, and on SQLite, it runs as :meth:`run` runs it.

        ``grouped``: the same write as a prebuilt statement; while another write of this
        process is in flight it waits and shares the next one's transaction
        (:mod:`hermes_store.uow.pggroup`).
        """
        if self._current.get() is not None:
            return self.run(fn)
        if self._blocks or self._asyncio or _SERVER_BLOCKS:
            self._refuse_foreign_block(True)
        return self.backend.statement(self, fn, idempotent=idempotent, grouped=grouped)

    def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn``, a read of one statement (or of statements that need no common snapshot).

        PostgreSQL outside an open unit: on the autocommit pool (the one of
        :meth:`run_statement`), one round trip per statement; a lost connection is retried (a
        read is idempotent). Inside an open unit: on its connection. SQLite: a read unit.
        """
        if self._current.get() is not None:
            with self.unit(write=False) as unit, mapped_errors():
                return fn(unit.conn)
        if self._blocks or self._asyncio or _SERVER_BLOCKS:
            self._refuse_foreign_block(False)
        return self.backend.read(self, fn)

    # -- reads -------------------------------------------------------------------------------

    def read_rows(
        self,
        statement: ClauseElement,
        params: Mapping[str, Any] | None = None,
        *,
        expanding: Sequence[str] = (),
    ) -> list[dict[str, Any]]:
        """The rows of one prebuilt read statement, as dicts.

        Inside an open unit: on its connection (it sees the unit's writes). Otherwise on
        SQLite: on this thread's own read connection, without pool checkout or SQLAlchemy's
        per-execution work; one statement is one implicit read transaction (one snapshot).
        """
        open_unit = self._current.get()
        if open_unit is not None and not open_unit.closed:
            with mapped_errors():
                return fastpath.rows(open_unit.conn, statement, params, expanding=expanding)
        return self.backend.rows(self, statement, params, expanding)

    def read_scalar(self, statement: ClauseElement, params: Mapping[str, Any] | None = None) -> Any:
        """The first column of the first row of a prebuilt read statement (None: no row); as
        :meth:`read_rows`, without building a dict (the cheapest read there is)."""
        if self._current.get() is not None:
            found = self.read_rows(statement, params)
            return next(iter(found[0].values())) if found else None
        return self.backend.scalar(self, statement, params)

    # -- lifecycle ---------------------------------------------------------------------------

    def release(self) -> None:
        """Give every held connection back to the pool, for good (the last
        ``SessionDB.close``): work that goes on through it afterwards (an iterator, a call
        that looked it up before) opens no connection again, it raises StoreMisuseError."""
        if self._joinable() is not None:
            raise StoreMisuseError(
                "close() inside an open unit (db.transaction(), uow.connect()): leave the "
                "block first"
            )
        self.closed = True
        self.backend.release()

    def in_block(self) -> bool:
        """A write block (``transaction()``, ``connect()``, ``session()``) is open on it, in
        any thread."""
        with self._blocks_lock:
            return any(not block.closed for block in self._blocks)

    def release_driver(self) -> None:
        """Kept for callers of the first release: :meth:`release`."""
        self.release()

    def checkpoint(self) -> bool:
        """A PASSIVE WAL checkpoint: merges what no reader still needs, never waits. Never
        in a process refused the file, nor once the WAL was deleted under its writer (and
        never on PostgreSQL: False)."""
        return self.backend.checkpoint()

    # -- fork (called by hermes_store.uow.fork's hooks) ------------------------------------------

    def before_fork(self, deadline: float) -> None:
        """In the forking thread: close every connection on the file, or note why not."""
        self._fork_busy = self.backend.before_fork(
            deadline, unit_open=self._current.get() is not None
        )

    def fork_failed(self, why: str) -> None:
        self._fork_busy = why
        log.warning("before fork: %s", why)

    def after_fork_in_parent(self) -> None:
        """The fork happened: let this process's threads go on (connections reopen lazily)."""
        self.backend.after_fork_in_parent()

    def after_fork_in_child(self) -> None:
        """Forget the parent's connections, locks and open unit without touching them; when
        one of them was in use at the fork, refuse the file in this process."""
        self.backend.after_fork_in_child(self._fork_busy)
        self._fork_busy = None
        self.engine.dispose(close=False)  # the child opens its own connections
        self._fresh_process_state()


class _Stage:
    """How far a write unit got: whether its COMMIT was handed to the driver."""

    __slots__ = ("committing",)

    def __init__(self) -> None:
        self.committing = False


@contextmanager
def _write_outcome(stage: _Stage) -> Iterator[None]:
    """A write unit whose server connection broke says what became of it: before its COMMIT
    was sent the server could only roll the transaction back (:class:`WriteNotLandedError`);
    once the COMMIT was on its way it may have run (:class:`WriteOutcomeUnknownError`)."""
    try:
        yield
    except (sa_exc.DBAPIError, DatabaseUnavailableError) as error:
        if isinstance(error, WriteNotLandedError | WriteOutcomeUnknownError):
            raise
        if isinstance(error, sa_exc.DBAPIError) and not server_connection_lost(error):
            raise
        detail = getattr(error, "orig", None) or error
        if stage.committing:
            raise WriteOutcomeUnknownError(
                "lost the database connection while the transaction's COMMIT was in flight: "
                f"it may have landed (not retried, so it is never applied twice): {detail}"
            ) from error
        raise WriteNotLandedError(
            "lost the database connection before the transaction's COMMIT was sent: the "
            f"server rolled it back, so nothing of it landed: {detail}"
        ) from error


def _refuse_outside_greenlet() -> None:
    """An asyncio engine's store called directly (``adb.sync.append_message()``): it could
    only fail with SQLAlchemy's MissingGreenlet, so say what works instead."""
    from sqlalchemy.util.concurrency import in_greenlet

    if not in_greenlet():
        raise StoreMisuseError(
            "AsyncSessionDB.sync on PostgreSQL runs on asyncio's driver: its methods work only "
            "inside await adb.run_sync(fn). Await the coroutine instead (await "
            "adb.append_message(...)), or open a SessionDB on the same URL for synchronous code"
        )


_MISNESTED = (
    "blocks must end innermost first (a generator or context manager holding the inner "
    "block was left suspended, or exited out of order)"
)
_NESTED_LEFT_OPEN = (
    "a nested transaction() block ended while a block opened inside it was still open: "
    f"{_MISNESTED}; both were rolled back, and the whole transaction will be at its end "
    "(nothing of it commits)"
)


@contextmanager
def _savepoint(unit: Unit) -> Iterator[None]:
    """A nested ``transaction()`` block: rolled back to its SAVEPOINT when an exception
    leaves it (the exception goes on), released otherwise.

    Ending a block while one opened inside it is still open is a misuse: the inner blocks
    and this one are rolled back to this one's savepoint, it raises TransactionMisuseError
    (chained to its own exception, if any), and the unit is rolled back whole at its end
    (:func:`_refuse_misnested`): the code is broken and nothing of it was acknowledged. The
    inner block, ended later, never touches the connection again: a clean exit raises
    TransactionMisuseError (the writes it meant to keep are gone); an exception leaving it
    goes on unchanged (what it asked for, its writes undone, happened)."""
    savepoint = unit.conn.begin_nested()
    block = _Nested(savepoint)  # an interrupt before the try: an empty savepoint, harmless
    try:
        unit.nested.append(block)
        yield
    except BaseException as error:
        if block.orphaned or unit.closed:
            raise  # rolled back with the block it was opened in
        misnested = _end_nested(unit, block)
        if savepoint.is_active:
            savepoint.rollback()
        if (
            misnested
            and isinstance(error, Exception)
            and not isinstance(error, TransactionMisuseError)
        ):
            raise TransactionMisuseError(_NESTED_LEFT_OPEN) from error
        raise
    if block.orphaned or unit.closed:
        raise TransactionMisuseError(
            f"a nested transaction() block ended after the block it was opened in: {_MISNESTED}"
            "; its writes were rolled back with that block, nothing of them committed"
        )
    if _end_nested(unit, block):
        savepoint.rollback()
        raise TransactionMisuseError(_NESTED_LEFT_OPEN)
    savepoint.commit()


def _end_nested(unit: Unit, block: _Nested) -> bool:
    """Take ``block`` off the unit's open nested blocks. True when blocks opened inside it are
    still open: those are orphaned and rolled back (innermost first, as SQLAlchemy keeps
    them), and the unit marked never to commit."""
    nested = unit.nested
    if nested and nested[-1] is block:
        nested.pop()
        return False
    if block not in nested:
        return False  # an interrupt before it was recorded
    at = nested.index(block)
    inside = nested[at + 1 :]
    del nested[at:]
    unit.misnested = True
    for left in inside:
        left.orphaned = True
    for left in reversed(inside):
        if left.savepoint.is_active:
            left.savepoint.rollback()
    return True


def _refuse_misnested(unit: Unit, error: BaseException | None) -> None:
    """A write unit ending with a nested block still open, or after one of its blocks ended
    out of order, is rolled back whole (never committed) and raises TransactionMisuseError;
    an interrupt or a closed generator goes on unchanged (the unit rolls back all the same)."""
    if unit.nested:
        for left in unit.nested:
            left.orphaned = True
        unit.nested.clear()
        unit.misnested = True
        why = (
            "a transaction ended while a nested transaction() block opened inside it was still "
            f"open: {_MISNESTED}; the whole transaction was rolled back, nothing of it committed"
        )
    elif unit.misnested:
        why = (
            "a nested transaction() block in this transaction ended while a block opened "
            f"inside it was still open: {_MISNESTED}; the whole transaction was rolled back, "
            "nothing of it committed"
        )
    else:
        return
    if error is None or (
        isinstance(error, Exception) and not isinstance(error, TransactionMisuseError)
    ):
        raise TransactionMisuseError(why) from error


def _is_readonly_refusal(error: BaseException) -> bool:
    cause = error.__cause__ if not isinstance(error, sa_exc.DBAPIError) else error
    orig = getattr(cause, "orig", None)
    code = getattr(orig, "sqlite_errorcode", None)
    return (code is not None and int(code) & 0xFF == SQLITE_READONLY) or (
        getattr(orig, "sqlstate", None) == "25006"
    )
