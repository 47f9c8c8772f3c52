"""The Unit of Work: one connection, one transaction, commit on success, rollback on error.

Every unit, read or write, hot path included, begins through ``engine.begin_on_driver`` (the
engine's begin hook; SQLite: ``BEGIN IMMEDIATE`` for writes, a deferred ``BEGIN`` for reads).
Repositories take the unit's connection and never begin or commit. Units compose: the open
unit of a thread (or asyncio task) is kept in a :class:`~contextvars.ContextVar`, and any unit
asked for meanwhile joins it.

Retries: a unit that meets a lock before it ran anything (waiting for ``BEGIN IMMEDIATE``) is
retried up to 15 times, ``random.uniform(0.020, 0.150)`` s apart, the original store's policy
that keeps competing processes from retrying in lockstep. ``run(fn)`` also re-runs ``fn`` whole
on a lock met midway; a ``transaction()`` block runs once, so a lock met inside it rolls the
block back and raises :class:`DatabaseLockedError`.

SQLite write units wait for their turn as the file's writer in :meth:`UnitOfWork._write_turn`
(the fair writer queue across processes, then an in-process lock shared by every store on the
file), then begin on the one writer connection the process keeps for that file. The head of
the queue begins with a short busy timeout (:data:`QUEUE_HEAD_BUSY_TIMEOUT_S`) and keeps its
place while a foreign writer holds SQLite's lock. The hot single-call writes are grouped:
see :mod:`hermes_store.uow.groupcommit`.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal, TypeVar, overload

from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool, PoolProxiedConnection, QueuePool
from sqlalchemy.sql import ClauseElement
from sqlalchemy.util import queue as sa_queue

from hermes_store.engine import fastpath
from hermes_store.engine.factory import (
    BUSY_OPTION,
    WRITE_OPTION,
    SqliteSettings,
    autocommit_engine,
    begin_on_driver,
    install_sqlite_hooks,
    prepare_driver,
    sqlite_file,
    sqlite_settings,
)
from hermes_store.errors import (
    SQLITE_READONLY,
    DatabaseLockedError,
    DatabaseUnavailableError,
    ForkedProcessError,
    HermesStoreError,
    InvalidInputError,
    ReadOnlyUnitError,
    StoreMisuseError,
    TransactionMisuseError,
    WalDeletedError,
    connection_lost,
    is_retryable,
    map_driver_error,
    mapped_errors,
    never_sent,
    wrap_driver_error,
)
from hermes_store.uow import groupcommit, pggroup, writequeue

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Threads that keep a read connection of their own (the rest check one out per read).
MAX_HELD_READERS = 16
#: How long a call waits for an unreachable server before DatabaseUnavailableError.
DEFAULT_UNAVAILABLE_TIMEOUT_S = 30.0
#: The pauses while waiting for it: from this, doubling (jittered) up to the next one.
UNAVAILABLE_FIRST_WAIT_S = 0.05
UNAVAILABLE_MAX_WAIT_S = 1.0
#: A call still waiting for the server says so this often (WARNING).
UNAVAILABLE_LOG_EVERY_S = 5.0
#: The queue's head asks SQLite for the lock with this busy timeout, then pauses (jittered)
#: and asks again, keeping its place: short, so it polls often while a foreign writer (the
#: original store, a sqlite3 shell) holds the lock, and its heartbeat keeps the line waiting.
QUEUE_HEAD_BUSY_TIMEOUT_S = 0.2
#: How long ``os.fork()`` waits for other threads' units on a SQLite file to end, so the file's
#: connections can be closed before the fork (else the child is refused the file).
FORK_WAIT_S = 2.0
#: How often (seconds) a writer's commits check that its WAL is still the file's.
WAL_CHECK_EVERY_S = 0.1


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a unit that found the database locked; and, separately,
    how long a call waits for a PostgreSQL server it cannot reach (``unavailable_timeout``
    seconds: a restart or failover takes seconds, far longer than a lock retry's budget)."""

    attempts: int = 15
    min_wait: float = 0.020
    max_wait: float = 0.150
    unavailable_timeout: float = DEFAULT_UNAVAILABLE_TIMEOUT_S

    def waits(self) -> Iterator[float]:
        """One random pause before each retry (so ``attempts - 1`` of them)."""
        for _ in range(self.attempts - 1):
            yield random.uniform(self.min_wait, self.max_wait)


@dataclass
class StoreStats:
    """Counters of one Unit of Work (shared by every store on a file in this process)."""

    write_units: int = 0  #: committed write units (joined calls are not counted twice)
    read_units: int = 0  #: read units and single-statement reads
    transactions: int = 0  #: committed ``transaction()`` blocks
    rollbacks: int = 0  #: units rolled back by an exception
    lock_waits: int = 0  #: write units that found another thread of this process writing
    lock_wait_seconds: float = 0.0  #: time spent in those waits
    retries: int = 0  #: pauses after a busy/locked database (before a retry)
    checkpoints: int = 0  #: successful PASSIVE WAL checkpoints
    groups: int = 0  #: committed group-commit transactions (see hermes_store.uow.groupcommit)
    grouped_units: int = 0  #: units in those groups (grouped_units / groups: mean group size)
    max_group: int = 0  #: most units in one group
    lost_groups: int = 0  #: groups whose transaction was lost (their units re-ran alone)
    group_reruns: int = 0  #: units re-run alone after their group was lost


class Unit:
    """An open unit: its connection, whether it may write, and who owns it.

    ``owner``: the thread that opened it (and whose context holds it); ``body_thread``: the
    thread that runs the block's code, which must never wait for this unit's writer (the owner,
    except for ``AsyncSessionDB``'s blocks: the event loop's thread); ``frames``: the
    generators and coroutines the block was opened in (resumed in another thread, they run
    inside a block that thread cannot join); ``closed``: ended, perhaps by another thread.
    """

    __slots__ = ("body_thread", "closed", "conn", "frames", "owner", "write")

    def __init__(self, conn: Connection, write: bool) -> None:
        self.conn = conn
        self.write = write
        self.owner = self.body_thread = threading.get_ident()
        self.frames: tuple[FrameType, ...] = ()
        self.closed = False


def driver_cursor(conn: Connection) -> Any:
    """A DB-API cursor on the unit's own connection (the SQLite hot path's statements)."""
    return conn.connection.driver_connection.cursor()  # type: ignore[union-attr]


class UnitOfWork:
    """Runs read and write units against one engine; thread-safe, shared by a whole process.

    ``with uow.transaction():`` (or ``uow.connect()`` / ``uow.session()``) opens a unit that
    every unit asked for in the same thread or task joins; ``uow.run(fn)`` re-runs
    ``fn(connection)`` whole on lock errors when it opens the unit itself.
    """

    #: Seconds between two checks that the writer's WAL is still the file's (see _acknowledge).
    wal_check_every: float = WAL_CHECK_EVERY_S

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
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        #: An asyncio engine's sync side (AsyncSessionDB on PostgreSQL): usable only in the
        #: greenlet SQLAlchemy runs it in.
        self._asyncio = engine.dialect.is_async
        self.settings: SqliteSettings | None = None
        if self.is_sqlite:
            self.settings = sqlite_settings(engine) or install_sqlite_hooks(engine)
        self._writer = engine.execution_options(**{WRITE_OPTION: True})
        # A PostgreSQL read unit is READ ONLY on the server too (psycopg's BEGIN READ ONLY).
        reader_options: dict[str, Any] = {WRITE_OPTION: False}
        if engine.dialect.name == "postgresql":
            reader_options["postgresql_readonly"] = True
        self._reader = engine.execution_options(**reader_options)
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
        self._fork_busy: str | None = None  # why the last fork could not close the file
        self._fresh_process_state()
        if self._file_key is not None:
            owner = weakref.ref(self)

            def gate_connect(*_args: Any) -> None:
                uow = owner()
                if uow is not None:
                    uow._gate_connect()

            event.listen(engine, "do_connect", gate_connect)
        _LIVE.add(self)

    def _fresh_process_state(self) -> None:
        """Locks, held connections and the open-unit variable of this process (after a fork
        the child gets new ones and never touches its parent's)."""
        self._pid = os.getpid()
        self._current: ContextVar[Unit | None] = ContextVar(f"hermes_unit_{id(self)}", default=None)
        self._blocks: set[Unit] = set()  # open write blocks (transaction(), connect(), session())
        # In-process writers queue here; other processes meet SQLite's write lock.
        self._write_lock = threading.Lock() if self.is_sqlite else None
        self._count_lock = threading.Lock()
        self._turn_changed = threading.Condition(self._count_lock)
        self._waiting = 0  # threads of this process waiting for their write turn
        self._writer_conn: Connection | None = None  # the file's writer connection (SQLite)
        self._readers_lock = threading.Lock()
        self._readers: dict[int, tuple[_Reader, weakref.finalize[Any, Any]]] = {}
        self._local = threading.local()
        # Fork: while a fork closes this file's connections no new one is opened (the gate);
        # a forked child refused the file, or a writer whose WAL was deleted, refuses it here.
        self._gate = threading.Condition(threading.Lock())
        self._forking = False
        self._gate_waiters = 0
        self._fork_locks: list[Any] = []
        self._refused: HermesStoreError | None = (
            _REFUSED.get(self._file_key) if self._file_key is not None else None
        )
        self._wal_id: tuple[int, int] | None = None  # the WAL the writer connection writes into
        self._wal_check_due = 0.0  # when the next commit stats the WAL (see _acknowledge)
        self.stats = StoreStats()
        grouped = self._group_commit
        self.group: groupcommit.GroupCommit | None = (
            groupcommit.GroupCommit(self) if grouped and self.is_sqlite else None
        )
        # Not under AsyncSessionDB: its calls share one thread (greenlets), so a caller waiting
        # for another's group would block the very thread that must finish it.
        dialect = self.engine.dialect
        self.statement_groups: pggroup.StatementGroups | None = (
            pggroup.for_database(self.engine)
            if grouped and dialect.name == "postgresql" and not dialect.is_async
            else None
        )

    @property
    def writes(self) -> int:
        """Committed write units (kept for callers of the first release)."""
        return self.stats.write_units

    @property
    def checkpoints(self) -> int:
        return self.stats.checkpoints

    # -- the seam for the cross-process writer queue -----------------------------------------

    @contextmanager
    def _write_turn(self, *, queued: bool = True) -> Iterator[writequeue.Turn | None]:
        """Wait for this unit's turn as the file's writer; held from before BEGIN IMMEDIATE
        until after COMMIT/ROLLBACK. SQLite files: first a place in the fair writer queue
        across processes and threads (:mod:`hermes_store.uow.writequeue`; ``queued=False`` skips
        it), then the in-process lock. PostgreSQL: no wait here (the server orders writers)."""
        lock = self._write_lock
        if lock is None:
            yield None
            return
        queue = self.write_queue if queued else None
        with queue.turn() if queue is not None else nullcontext() as turn:
            waiting = lock.locked()  # another thread of this process writes: a wait, counted
            started = time.monotonic() if waiting else 0.0
            if waiting:
                with self._turn_changed:
                    self.stats.lock_waits += 1
                    self._waiting += 1
                    self._turn_changed.notify_all()
            try:
                with lock:  # entered in C: an interrupt (Ctrl-C) never leaves it held
                    if waiting:
                        waiting = False
                        self._waited(started)
                    yield turn
            finally:
                if waiting:  # interrupted while it waited
                    self._waited(started)

    def _waited(self, started: float) -> None:
        with self._turn_changed:
            self._waiting -= 1
            self.stats.lock_wait_seconds += time.monotonic() - started

    @property
    def write_queue(self) -> writequeue.WriteQueue | None:
        """This process's fair writer queue for the database file (None: not a file, or off)."""
        if self._queue_path is None:
            return None
        return writequeue.for_database(self._queue_path)

    def wait_for_waiting_writers(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` threads wait for their write turn (False: timed out);
        lets callers and tests know a writer is queued without polling."""
        with self._turn_changed:
            return self._turn_changed.wait_for(lambda: self._waiting >= count, timeout)

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

    @contextmanager
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
        if self._blocks or self._asyncio:
            self._refuse_foreign_block(write)
        with self._own_unit(write, self.retry.waits()) as unit:
            if not write:
                yield unit
                return
            self._open_block(unit)
            try:
                yield unit
            except BaseException as error:
                self._refuse_foreign_exit(unit, error)
                raise
            else:
                self._refuse_foreign_exit(unit, None)
            finally:
                with self._count_lock:
                    self._blocks.discard(unit)
                unit.closed = True
                unit.frames = ()

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
        with self._count_lock:
            self._blocks.add(unit)

    def _refuse_foreign_block(self, write: bool) -> None:
        """Refuse, before it waits, a call that could only wait forever: one made inside a
        block opened in another thread or context (a generator that opened it, resumed
        elsewhere), or, on SQLite, a write from the thread that runs an open block's body
        (another asyncio task's sync block, an ``AsyncSessionDB`` block of this loop)."""
        if self._asyncio:
            _refuse_outside_greenlet()
        with self._count_lock:
            blocks = list(self._blocks)
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
        if write and self._write_lock is not None:
            me = threading.get_ident()
            if any(block.body_thread == me for block in blocks):
                raise TransactionMisuseError(
                    "a write from a thread whose own open transaction() block (in another "
                    "asyncio task or context, or AsyncSessionDB's async with adb.transaction()) "
                    "holds the file's writer: it would wait for itself forever. Make the call "
                    "inside that block (await adb.<method>() in an async block), or after it"
                )

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
            yield open_unit.conn
            return
        if self._blocks or self._asyncio:
            self._refuse_foreign_block(False)
        with self._own_unit(False, self.retry.waits(), publish=False) as unit:
            yield unit.conn

    @contextmanager
    def _own_unit(
        self, write: bool, waits: Iterator[float], *, publish: bool = True
    ) -> Iterator[Unit]:
        with self._write_turn() if write else nullcontext() as turn, mapped_errors():
            conn = self._begin(write, waits, turn)
            unit = Unit(conn, write)
            current = self._current  # a forked child gets a new variable: reset this one
            token = current.set(unit) if publish else None
            forks = _forks
            inherited = False
            try:
                yield unit
                if forks != _forks:
                    inherited = True
                    raise _left_in_child(write)
                conn.commit()
            except BaseException as error:
                if inherited or forks != _forks:
                    # The parent's transaction: never committed, rolled back or closed here.
                    inherited = True
                    _keep_forever(conn)
                    if isinstance(error, ForkedProcessError) or not isinstance(error, Exception):
                        raise
                    raise _left_in_child(write) from error
                self._abort(conn, write)
                if not write and _is_readonly_refusal(error):
                    raise ReadOnlyUnitError(
                        f"a write inside a read-only unit (uow.connect(write=False)): {error}"
                    ) from error
                raise
            finally:
                if token is not None and current.get() is unit:
                    current.reset(token)  # not from another context: refused there
                if not (inherited or (write and conn is self._writer_conn)):
                    conn.close()
            if write and conn is self._writer_conn:
                self._acknowledge()
        self._count(write)

    def _begin(
        self, write: bool, waits: Iterator[float], turn: writequeue.Turn | None = None
    ) -> Connection:
        head = turn is not None and turn.queued
        left: float | None = None  # the head's attempts
        patience: _Patience | None = None
        while True:
            try:
                conn = self._connection(write)
            except sa_exc.DBAPIError as error:
                # A server not reachable (restarting): nothing was sent, wait for it.
                if self.is_sqlite or not connection_lost(error):
                    raise
                patience = patience or _Patience(self)
                patience.pause(error, write=False)
                continue
            if conn is self._writer_conn:
                conn.execution_options(**{BUSY_OPTION: self._head_busy_ms if head else None})
            try:
                conn.begin()
            except sa_exc.DBAPIError as error:
                if conn is self._writer_conn:
                    if not is_retryable(error):
                        self._drop_writer(invalidate=False)
                else:
                    conn.close()
                if not is_retryable(error):
                    raise
                if head:
                    assert turn is not None
                    left = self._head_pause(turn, left, error)
                else:
                    self._pause(waits, error)
                continue
            return conn

    @property
    def _head_busy_ms(self) -> int:
        """The head's busy timeout: short, and never longer than the writer's own."""
        head_ms = int(QUEUE_HEAD_BUSY_TIMEOUT_S * 1000)
        return head_ms if self.settings is None else min(head_ms, self.settings.writer_ms)

    def _head_pause(self, turn: writequeue.Turn, left: float | None, error: BaseException) -> float:
        """The queue's head met a foreign writer: pause (jittered) and keep its place, telling
        the line it is alive. Its budget is the fallback path's busy waiting, in short
        attempts: ``attempts`` x (writer's busy timeout / head's), so a foreign writer costs
        it no more waiting than before. Returns the attempts left."""
        if left is None:
            settings = self.settings
            writer_ms = settings.writer_ms if settings is not None else 1000
            left = float(self.retry.attempts * -(-writer_ms // max(1, self._head_busy_ms)))
        left -= 1
        if left <= 0:
            raise DatabaseLockedError(
                f"the database stayed locked through {self.retry.attempts} attempts' worth of "
                f"waiting at the head of the writer queue: {error}"
            ) from error
        turn.still_trying()
        delay = random.uniform(self.retry.min_wait, self.retry.max_wait)
        with self._count_lock:
            self.stats.retries += 1
        log.debug("database busy at the queue's head (%s); retrying in %.0f ms", error,
                  delay * 1000)  # fmt: skip
        _sleep(delay)
        turn.still_trying()
        return left

    def _connection(self, write: bool) -> Connection:
        if self._refused is not None and (write or isinstance(self._refused, ForkedProcessError)):
            raise _again(self._refused)
        if write and self.is_sqlite:
            # Writes are serialised by the turn anyway: one connection serves them all.
            if self._writer_conn is None:
                self._writer_conn = self._writer.connect()
            return self._writer_conn
        return (self._writer if write else self._reader).connect()

    def _abort(self, conn: Connection, write: bool) -> None:
        with self._count_lock:
            self.stats.rollbacks += 1
        try:
            conn.rollback()
        except sa_exc.DBAPIError:
            if conn is self._writer_conn:
                self._drop_writer(invalidate=True)  # state unknown: never reuse it
            else:
                conn.invalidate()
            raise
        if conn is self._writer_conn:
            self._drop_writer(invalidate=False)  # a retry starts on a fresh connection

    def _drop_writer(self, *, invalidate: bool) -> None:
        held, self._writer_conn = self._writer_conn, None
        self._wal_id = None
        if held is None:
            return
        if invalidate:
            held.invalidate()
        held.close()

    def run(
        self, fn: Callable[[Connection], T], *, write: bool = True, driver_only: bool = False
    ) -> T:
        """Run ``fn`` in one unit; on a lock error, run it again on a fresh connection.

        Inside an open unit ``fn`` joins it and runs once (a lock error then ends the whole
        unit: see :meth:`transaction`). ``driver_only``: ``fn`` runs its statements on the
        connection's DB-API cursor only (the SQLite hot path), so on SQLite the unit is begun
        and committed on the driver, through the same begin function as the engine's hook,
        without SQLAlchemy's transaction bookkeeping.
        """
        if self._current.get() is not None:
            with self.unit(write=write) as unit:
                return fn(unit.conn)
        if self._blocks or self._asyncio:
            self._refuse_foreign_block(write)
        lean = driver_only and write and self.is_sqlite
        if lean and self.group is not None:
            done, result = self.group.run(fn)
            if done:
                return result  # type: ignore[return-value]
            self._record_rerun()  # its group's transaction was lost: run it again, alone
        waits = self.retry.waits()
        while True:
            try:
                if lean:
                    return self._driver_unit(fn, waits)
                with self._own_unit(write, waits) as unit:
                    return fn(unit.conn)
            except sa_exc.DBAPIError as error:
                if not is_retryable(error):
                    raise
                self._pause(waits, error)

    def _driver_unit(self, fn: Callable[[Connection], T], waits: Iterator[float]) -> T:
        """One attempt of a SQLite write unit begun and committed on the writer's driver
        connection: the same turn, begin function (``begin_on_driver``), error mapping and
        checkpoint cadence as every unit. ``fn`` gets the writer Connection, which stays idle
        in SQLAlchemy's eyes: it only ever uses its DB-API cursor."""
        settings = self.settings
        assert settings is not None
        dbapi_error = self._dbapi_error
        with self._write_turn() as turn, mapped_errors():
            conn = self._begin_driver(turn)
            driver: Any = conn.connection.driver_connection
            try:
                result = fn(conn)
                driver.commit()
            except BaseException as error:
                with self._count_lock:
                    self.stats.rollbacks += 1
                try:
                    driver.rollback()
                except dbapi_error as orig:
                    self._drop_writer(invalidate=True)  # state unknown: never reuse it
                    raise wrap_driver_error(orig, self._dialect) from orig
                self._drop_writer(invalidate=False)  # a retry starts on a fresh connection
                if isinstance(error, dbapi_error):
                    raise wrap_driver_error(error, self._dialect) from error
                raise
            self._acknowledge()
        self._count(True)
        return result

    def _begin_driver(self, turn: writequeue.Turn | None) -> Connection:
        """``BEGIN IMMEDIATE`` on the writer's driver connection, inside the writer's turn.
        The queue's head retries here, keeping its place; a fallback turn raises the busy
        error for the caller's retry (today's path: a new turn after a jittered pause)."""
        settings = self.settings
        assert settings is not None
        head = turn is not None and turn.queued
        left: float | None = None  # the head's attempts
        while True:
            conn = self._connection(True)
            pooled = conn.connection
            try:
                begin_on_driver(
                    pooled.driver_connection,  # type: ignore[arg-type]
                    pooled.info,
                    settings,
                    write=True,
                    busy_ms=self._head_busy_ms if head else None,
                )
            except self._dbapi_error as orig:
                error = wrap_driver_error(orig, self._dialect)
                if not is_retryable(error):
                    self._drop_writer(invalidate=False)
                    raise error from orig
                if not head:
                    raise error from orig
                assert turn is not None
                left = self._head_pause(turn, left, error)
                continue
            return conn

    def _begin_is_retryable(self, error: BaseException) -> bool:
        return isinstance(error, sa_exc.DBAPIError) and is_retryable(error)

    def _end_group(self, conn: Connection, size: int, lost: BaseException) -> None:
        """Roll back a group whose transaction was lost (``lost``: why). Called inside the
        writer's turn by :mod:`hermes_store.uow.groupcommit`, which commits a group itself."""
        driver: Any = conn.connection.driver_connection
        try:
            driver.rollback()
        except self._dbapi_error:
            self._drop_writer(invalidate=True)  # state unknown: never reuse it
        else:
            self._drop_writer(invalidate=False)
        log.warning("a group of %d writes lost its transaction (%s); each runs again alone",
                    size, lost)  # fmt: skip
        self._record_group(size, lost=True)

    def _record_group(self, size: int, *, lost: bool) -> None:
        """Count a group of ``size`` units that committed or was lost (both group commits)."""
        with self._count_lock:
            if lost:
                self.stats.lost_groups += 1
            else:
                self.stats.groups += 1
                self.stats.grouped_units += size
                self.stats.max_group = max(self.stats.max_group, size)

    def _record_rerun(self) -> None:
        """Count a unit that runs again alone because its group did not commit (both group
        commits)."""
        with self._count_lock:
            self.stats.group_reruns += 1

    def queued_units(self) -> int:
        """Hot writes of this process waiting for a group (0 without group commit)."""
        groups = self.group or self.statement_groups
        return groups.queued() if groups is not None else 0

    def wait_for_queued_units(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` hot writes wait for a group (False: timed out, or no
        group commit); lets tests and callers know writes are queued without polling."""
        groups = self.group or self.statement_groups
        return groups.wait_for_queued(count, timeout) if groups is not None else False

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
        return self._connection_of(self.unit(write=write))

    @contextmanager
    def _connection_of(self, units: AbstractContextManager[Unit]) -> Iterator[Connection]:
        with units as unit:
            yield unit.conn

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One write unit that every call inside the block (this thread or task) joins.

        ``BEGIN IMMEDIATE`` (retried while another writer holds the lock: nothing ran yet),
        commit at the end, rollback of everything on an exception. The block runs once: a lock
        error inside it (a PostgreSQL deadlock, say) rolls it back and raises
        :class:`DatabaseLockedError`. A nested block is a ``SAVEPOINT`` in the outer one: an
        exception leaving it rolls back that block's writes only (then propagates); the outer
        commit commits the rest.
        """
        joined = self._current.get() is not None
        try:
            with self.unit(write=True) as unit:
                if joined:
                    with _savepoint(unit.conn):
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
        if not joined:
            with self._count_lock:
                self.stats.transactions += 1

    @contextmanager
    def session(self, *, write: bool = True) -> Iterator[Session]:
        """An ORM session on one connection; flushed and committed when the block succeeds."""
        with self.connect(write=write) as conn, Session(bind=conn, expire_on_commit=False) as s:
            yield s
            s.flush()

    # -- one statement, one round trip (PostgreSQL) ------------------------------------------

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
        if self.is_sqlite or self._current.get() is not None:
            return self.run(fn)
        if self._blocks or self._asyncio:
            self._refuse_foreign_block(True)
        groups = self.statement_groups
        if grouped is not None and groups is not None:
            grouped.idempotent = idempotent
            return groups.run(
                grouped, lambda: self._autocommit(fn, write=True, idempotent=idempotent), self
            )
        return self._autocommit(fn, write=True, idempotent=idempotent)

    def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn``, a read of one statement (or of statements that need no common snapshot).

        PostgreSQL outside an open unit: on the autocommit pool (the one of
        :meth:`run_statement`), one round trip per statement; a lost connection is retried (a
        read is idempotent). Inside an open unit: on its connection. SQLite: a read unit.
        """
        if self._current.get() is not None or self.is_sqlite:
            with self.unit(write=False) as unit:
                return fn(unit.conn)
        if self._blocks or self._asyncio:
            self._refuse_foreign_block(False)
        return self._autocommit(fn, write=False, idempotent=True)

    @property
    def autocommit_engine(self) -> Engine:
        """The autocommit twin of a PostgreSQL engine (see :func:`engine.autocommit_engine`)."""
        return autocommit_engine(self.engine)

    def _autocommit(self, fn: Callable[[Connection], T], *, write: bool, idempotent: bool) -> T:
        with mapped_errors():
            return self._autocommit_attempts(fn, write=write, idempotent=idempotent)

    def _autocommit_attempts(
        self, fn: Callable[[Connection], T], *, write: bool, idempotent: bool
    ) -> T:
        engine = self.autocommit_engine
        waits = self.retry.waits()
        patience = _Patience(self)
        while True:
            try:
                conn = engine.connect()
            except sa_exc.DBAPIError as error:
                # Nothing was sent: retrying cannot apply anything twice.
                if not (is_retryable(error) or connection_lost(error)):
                    raise
                patience.pause(error, write=False)
                continue
            try:
                result = fn(conn)
            except sa_exc.DBAPIError as error:
                _close_quietly(conn)
                # A deadlock or serialization failure rolled the statement back on the server.
                if is_retryable(error):
                    self._pause(waits, error)
                    continue
                if not connection_lost(error):
                    raise
                if idempotent or never_sent(error):
                    patience.pause(error, write=write)
                    continue
                raise DatabaseUnavailableError(
                    "lost the database connection while the write was in flight: it may or may "
                    f"not have landed (not retried, so it is never applied twice): {error.orig}"
                ) from error
            except BaseException:
                _close_quietly(conn)
                raise
            conn.close()
            self._count(write)
            return result

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
            return fastpath.rows(open_unit.conn, statement, params, expanding=expanding)
        if not self.is_sqlite:
            return self.read(
                lambda conn: fastpath.rows(conn, statement, params, expanding=expanding)
            )
        if expanding:
            with self.reading() as conn:
                return fastpath.rows(conn, statement, params, expanding=expanding)
        names, found = self._fetch(statement, params)
        return [dict(zip(names, row, strict=True)) for row in found]

    def read_scalar(self, statement: ClauseElement, params: Mapping[str, Any] | None = None) -> Any:
        """The first column of the first row of a prebuilt read statement (None: no row); as
        :meth:`read_rows`, without building a dict (the cheapest read there is)."""
        if self._current.get() is not None or not self.is_sqlite:
            found = self.read_rows(statement, params)
            return next(iter(found[0].values())) if found else None
        reader: _Reader | None = self._local.__dict__.get("reader")
        if reader is None or not reader.ready:
            return self._fetch(statement, params, one=True)
        plan = fastpath.plan(statement, self._dialect)
        values = plan.bind(params)
        busy = reader.busy
        busy.acquire()
        if reader.closed:  # closed by a fork meanwhile
            busy.release()
            return self._fetch(statement, params, one=True)
        try:
            row = reader.driver.execute(plan.sql, values).fetchone()
        except self._dbapi_error as orig:
            raise map_driver_error(plan.sql, values, orig, self._dialect) from orig
        except UnicodeEncodeError as error:  # a lone surrogate reached the driver's encoder
            raise InvalidInputError(
                f"a text argument is not valid Unicode: {error.reason}"
            ) from None
        finally:
            busy.release()
        self.stats.read_units += 1
        return None if row is None else row[0]

    @overload
    def _fetch(
        self, statement: ClauseElement, params: Mapping[str, Any] | None
    ) -> tuple[list[str], list[Any]]: ...

    @overload
    def _fetch(
        self, statement: ClauseElement, params: Mapping[str, Any] | None, *, one: Literal[True]
    ) -> Any: ...

    def _fetch(
        self, statement: ClauseElement, params: Mapping[str, Any] | None, *, one: bool = False
    ) -> Any:
        """The hot reads on SQLite: this thread's own read connection, no pool checkout, no
        Connection, no per-execution SQLAlchemy work."""
        reader = self._locked_reader()
        dialect = self._dialect
        plan = fastpath.plan(statement, dialect)
        values = plan.bind(params)
        dbapi_error = self._dbapi_error
        driver = reader.driver
        try:
            if not reader.ready:  # the connection's state, set once (it only ever reads)
                settings: SqliteSettings | None = self.settings
                assert settings is not None
                prepare_driver(driver, reader.info, settings, write=False)
                reader.ready = True
            cursor = driver.execute(plan.sql, values)
            if one:
                row = cursor.fetchone()
                return None if row is None else row[0]
            found = cursor.fetchall()
            names = plan.columns
            if names is None:
                names = plan.columns = [column[0] for column in cursor.description]
        except dbapi_error as orig:
            raise map_driver_error(plan.sql, values, orig, dialect) from orig
        except UnicodeEncodeError as error:  # a lone surrogate reached the driver's encoder
            raise InvalidInputError(
                f"a text argument is not valid Unicode: {error.reason}"
            ) from None
        finally:
            reader.busy.release()
            if not reader.held:
                reader.pooled.close()
            self.stats.read_units += 1  # a diagnostic count: not worth a lock on a hot read
        return names, found

    def _take_reader(self) -> _Reader:
        """This thread's held read connection, else (past the cap) one checked out for a read."""
        with mapped_errors():  # connecting runs the connect hook's PRAGMAs (a full disk fails)
            pooled = self.engine.raw_connection()
        key = next(_reader_keys)
        with self._readers_lock:
            if len(self._readers) >= MAX_HELD_READERS:
                return _Reader(pooled, held=False)
            # Given back to the pool when the thread ends (its thread-local dies with it).
            marker = _ThreadMarker()
            self._local.marker = marker
            reader = self._local.reader = _Reader(pooled, held=True)
            finalizer = weakref.finalize(marker, self._release_reader, key)
            self._readers[key] = (reader, finalizer)
        return reader

    def _locked_reader(self) -> _Reader:
        """This thread's read connection, locked while it reads: a fork in another thread
        closes it only between two reads (the thread then takes a new one)."""
        while True:
            reader: _Reader | None = self._local.__dict__.get("reader")
            if reader is None:
                reader = self._take_reader()
            reader.busy.acquire()
            if not reader.closed:
                return reader
            reader.busy.release()
            if self._local.__dict__.get("reader") is reader:
                del self._local.reader

    def _release_reader(self, key: int) -> None:
        with self._readers_lock:
            entry = self._readers.pop(key, None)
        if entry is not None:
            entry[0].pooled.close()

    # -- lifecycle ---------------------------------------------------------------------------

    def release(self) -> None:
        """Give every held connection back to the pool (the last ``SessionDB.close``)."""
        if self._joinable() is not None:
            raise HermesStoreError(
                "close() inside an open unit (db.transaction(), uow.connect()): leave the "
                "block first"
            )
        with self._write_turn(queued=False):  # never while a unit is using the writer
            self._drop_writer(invalidate=False)
        with self._readers_lock:
            readers, self._readers = self._readers, {}
        for reader, finalizer in readers.values():
            finalizer.detach()
            reader.pooled.close()
        self._local = threading.local()

    def release_driver(self) -> None:
        """Kept for callers of the first release: :meth:`release`."""
        self.release()

    # -- fork ----------------------------------------------------------------------------------
    #
    # SQLite keeps one record per database file and process with the process's lock state; a
    # forked child inherits the record but not the locks (POSIX locks belong to a process).
    # A connection the child opens finds the record, believes the locks held and takes none;
    # its parent's last close then checkpoints and deletes the WAL the child writes into. So
    # before a fork every connection on the file is closed (the parent reopens them lazily)
    # and the child starts with no record; a connection in use at the fork cannot be closed,
    # and then the child is refused the file.

    def _gate_connect(self) -> None:
        """Before each new connection: refused in a process refused the file; waits while
        a fork in another thread closes the file's connections."""
        refused = self._refused
        if isinstance(refused, ForkedProcessError):
            raise _again(refused)
        gate = self._gate
        with gate:
            if self._forking:
                self._gate_waiters += 1
                try:
                    gate.wait_for(lambda: not self._forking)
                finally:
                    self._gate_waiters -= 1

    def _before_fork(self, deadline: float) -> None:
        """In the forking thread: close every connection on the file, or say why not."""
        self._fork_busy = None
        if self._file_key is None:
            return
        if self._refused is not None:  # its connections are kept open: so is the child refused
            self._fork_busy = f"this process was refused the file: {self._refused}"
            return
        with self._gate:
            self._forking = True
        if self._current.get() is not None:
            self._fork_busy = "a unit (db.transaction(), uow.connect()) was open in its thread"
            return
        assert self._write_lock is not None
        if not self._write_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._fork_busy = f"another thread's write unit did not end within {FORK_WAIT_S} s"
            return
        self._fork_locks.append(self._write_lock)
        self._drop_writer(invalidate=False)
        pool = self.engine.pool
        while True:
            with self._readers_lock:
                readers = list(self._readers.items())
            for key, (reader, finalizer) in readers:
                if not reader.busy.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    self._fork_busy = f"another thread's read did not end within {FORK_WAIT_S} s"
                    return
                self._fork_locks.append(reader.busy)
                with self._readers_lock:
                    mine = self._readers.pop(key, None) is not None
                if mine:
                    finalizer.detach()
                    reader.closed = True
                    reader.pooled.close()
            if isinstance(pool, NullPool):
                return  # keeps nothing idle; units close their connections
            if not isinstance(pool, QueuePool):
                self._fork_busy = f"its engine's pool ({type(pool).__name__}) cannot be emptied"
                return
            _close_idle(pool)
            with self._gate:
                in_use = pool.checkedout() - self._gate_waiters
            if in_use <= 0:
                _close_idle(pool)  # returned meanwhile (none can be checked out now)
                return
            if time.monotonic() >= deadline:
                self._fork_busy = (
                    f"{in_use} connection(s) stayed in use by other threads (read units, "
                    f"streams, engine.connect()) for {FORK_WAIT_S} s"
                )
                return
            time.sleep(0.001)  # the fork path only: wait for other threads' units to end

    def _after_fork_in_parent(self) -> None:
        """The fork happened: let this process's threads go on (connections reopen lazily)."""
        locks, self._fork_locks = self._fork_locks, []
        for lock in locks:
            lock.release()
        with self._gate:
            self._forking = False
            self._gate.notify_all()

    def _after_fork_in_child(self) -> None:
        """Forget the parent's connections, locks and open unit without touching them; when
        one of them was in use at the fork, refuse the file in this process."""
        inherited = (self._writer_conn, self._readers, self._local, self.engine.pool)
        for _reader, finalizer in self._readers.values():
            finalizer.detach()
        if self._fork_busy is not None and self._file_key is not None:
            _REFUSED[self._file_key] = ForkedProcessError(
                f"this process was forked while {self._queue_path or self.engine.url.database} "
                f"was in use by its parent ({self._fork_busy}): it inherited SQLite's lock "
                "records without the locks, so it must not use that file (its writes could be "
                "lost or corrupt it). Fork outside db.transaction() blocks and while other "
                "threads are idle, or start the process with 'spawn' or 'forkserver'"
            )
            _keep_forever(inherited)  # never closed or rolled back here, even at exit
        else:
            _INHERITED.append(inherited)
        self._fork_busy = None
        self._fork_locks = []
        self.engine.dispose(close=False)  # the child opens its own connections
        self._fresh_process_state()

    # -- the WAL under the writer ----------------------------------------------------------

    def _acknowledge(self) -> None:
        """After a COMMIT on the writer: the WAL it wrote into must still be the file's (one
        ``stat``). A WAL deleted or replaced meanwhile means this process lost its locks and
        another process checkpointed and deleted it: the commit is invisible to everyone else
        and lost at exit, so it is reported, not acknowledged.

        At most once per :attr:`wal_check_every` seconds (and at the writer's first commit): a
        ``stat`` of the WAL right after its fsync slowed the next commit by 70-80 µs on ext4
        (a fifth of a lone writer's whole write), so a writer going back to back checks ten
        times a second. The fork handling keeps the WAL from being deleted in the first place;
        this check bounds how long a process that lost its locks anyway goes unnoticed."""
        path = self._wal_path
        if path is None:
            return
        now = time.monotonic()
        if self._wal_id is not None and now < self._wal_check_due:
            return
        self._wal_check_due = now + self.wal_check_every
        try:
            st = os.stat(path)
        except FileNotFoundError:
            seen = None
        else:
            seen = (st.st_dev, st.st_ino)
        known = self._wal_id
        if known is None:
            # The writer's first commit: note the WAL it uses (none: not in WAL mode).
            self._wal_id = seen if seen is not None else _NO_WAL
        elif seen != known and known != _NO_WAL:
            raise self._lose_wal()

    def _wal_replaced(self) -> bool:
        """The WAL the writer committed into is no longer the file's (one ``stat``)."""
        known, path = self._wal_id, self._wal_path
        if known is None or known == _NO_WAL or path is None:
            return False
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != known

    def _lose_wal(self) -> WalDeletedError:
        """Refuse further writes to the file in this process; the writer connection is kept
        open, never closed (closing it could checkpoint the deleted WAL over newer pages)."""
        error = WalDeletedError(
            f"the WAL of {self._queue_path or self.engine.url.database} was deleted while this "
            f"process (pid {os.getpid()}) was writing into it: this process had lost its "
            "locks on the database (a fork that inherited an open connection, or a file "
            "handle on the database closed), and another process checkpointed and deleted the "
            "WAL. This write and any since the deletion are NOT in the database; this process "
            "refuses further writes to the file (`hermes-store doctor` names such processes)"
        )
        self._refused = error
        if self._file_key is not None:
            _REFUSED.setdefault(self._file_key, error)
        held, self._writer_conn = self._writer_conn, None
        if held is not None:
            _keep_forever(held)
        log.error("%s", error)
        return error

    # -- maintenance -------------------------------------------------------------------------

    def checkpoint(self) -> bool:
        """A PASSIVE WAL checkpoint: merges what no reader still needs, never waits. Never
        in a process refused the file, nor once the WAL was deleted under its writer."""
        if not self.is_sqlite:
            return False
        if self._refused is not None:
            log.debug("no WAL checkpoint: %s", self._refused)
            return False
        if self._wal_replaced():
            log.error("WAL checkpoint skipped: %s", self._lose_wal())
            return False
        try:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
        except sa_exc.DBAPIError as error:
            if self._wal_replaced() or _holds_deleted_wal(self._wal_path):
                log.error("WAL checkpoint failed (%s): %s", error.orig, self._lose_wal())
            else:
                log.warning("WAL checkpoint failed (harmless, retried later): %s", error.orig)
            return False
        with self._count_lock:
            self.stats.checkpoints += 1
        return True

    def _count_writes(self, units: int) -> None:
        """Count ``units`` committed write units at once (a group); checkpoint when due."""
        if units <= 0:
            return
        with self._count_lock:
            before = self.stats.write_units
            self.stats.write_units = after = before + units
            every = self.checkpoint_every
            due = every > 0 and after // every > before // every
        if due:
            self.checkpoint()

    def _count(self, write: bool) -> None:
        due = False
        with self._count_lock:
            if write:
                self.stats.write_units += 1
                writes = self.stats.write_units
                due = self.checkpoint_every > 0 and writes % self.checkpoint_every == 0
            else:
                self.stats.read_units += 1
        if due:
            self.checkpoint()

    def _pause(self, waits: Iterator[float], error: BaseException | None) -> None:
        try:
            delay = next(waits)
        except StopIteration:
            raise DatabaseLockedError(
                f"the database stayed locked through {self.retry.attempts} attempts: {error}"
            ) from error
        with self._count_lock:
            self.stats.retries += 1
        log.debug("database busy (%s); retrying in %.0f ms", error, delay * 1000)
        _sleep(delay)


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


@contextmanager
def _savepoint(conn: Connection) -> Iterator[None]:
    """A nested ``transaction()`` block: rolled back to its SAVEPOINT when an exception
    leaves it (the exception goes on), released otherwise."""
    savepoint = conn.begin_nested()
    try:
        yield
    except BaseException:
        if savepoint.is_active:
            savepoint.rollback()
        raise
    savepoint.commit()


def _sleep(delay: float) -> None:
    """``time.sleep``, except inside SQLAlchemy's asyncio greenlet (``AsyncSessionDB`` on
    PostgreSQL), where the pause awaits: the event loop keeps serving other tasks."""
    if "greenlet" in sys.modules:
        from sqlalchemy.util.concurrency import await_only, in_greenlet

        if in_greenlet():
            await_only(asyncio.sleep(delay))
            return
    time.sleep(delay)


class _Patience:
    """One call's wait for a server it cannot reach: a deadline counted from the first failure
    (the policy's ``unavailable_timeout``), jittered pauses growing from 50 ms to 1 s (a
    fleet does not reconnect in lockstep), progress logged. The pauses go through
    :func:`_sleep`, so an asyncio store's loop keeps running."""

    __slots__ = ("logged", "started", "tries", "uow", "wait")

    def __init__(self, uow: UnitOfWork) -> None:
        self.uow = uow
        self.started: float | None = None
        self.logged = 0.0
        self.tries = 0
        self.wait = UNAVAILABLE_FIRST_WAIT_S

    def pause(self, error: sa_exc.DBAPIError, *, write: bool) -> None:
        """Wait before the next attempt; past the deadline, report the server unreachable
        (with nothing written: the call never got through)."""
        now = time.monotonic()
        if self.started is None:
            self.started = self.logged = now
        waited = now - self.started
        timeout = self.uow.retry.unavailable_timeout
        if waited >= timeout:
            raise DatabaseUnavailableError(
                f"the database stayed unreachable for {waited:.1f} s ({self.tries} retries)"
                f"{' (the write did not land)' if write else ''}: {error.orig}"
            ) from error
        delay = min(random.uniform(0.5, 1.0) * self.wait, timeout - waited)
        self.wait = min(self.wait * 2, UNAVAILABLE_MAX_WAIT_S)
        with self.uow._count_lock:
            self.uow.stats.retries += 1
        if self.tries == 0:
            log.info("database unreachable (%s); retrying for up to %.0f s", error.orig, timeout)
        elif now - self.logged >= UNAVAILABLE_LOG_EVERY_S:
            self.logged = now
            log.warning(
                "the database has been unreachable for %.1f s (%s); still retrying, for up to "
                "%.0f s",
                waited,
                error.orig,
                timeout,
            )
        self.tries += 1
        _sleep(delay)


class _Reader:
    """A read connection: the pooled one, its driver connection and its pool-record info."""

    __slots__ = ("busy", "closed", "driver", "held", "info", "pooled", "ready")

    def __init__(self, pooled: PoolProxiedConnection, *, held: bool) -> None:
        self.pooled = pooled
        self.driver: Any = pooled.driver_connection
        self.info = pooled.info
        self.held = held
        self.ready = False
        self.busy = threading.Lock()  #: held while it reads (a fork closes it only when idle)
        self.closed = False  #: closed before a fork: its thread takes a new one


class _ThreadMarker:
    """Lives in one thread's thread-local: its death tells the Unit of Work the thread ended."""


def _close_quietly(conn: Connection) -> None:
    """Give back a connection after a failed statement (a broken one is discarded)."""
    try:
        conn.close()
    except sa_exc.DBAPIError as error:
        log.info("discarding a broken connection: %s", error.orig)
        conn.invalidate()


def _is_readonly_refusal(error: BaseException) -> bool:
    cause = error.__cause__ if not isinstance(error, sa_exc.DBAPIError) else error
    orig = getattr(cause, "orig", None)
    code = getattr(orig, "sqlite_errorcode", None)
    return (code is not None and int(code) & 0xFF == SQLITE_READONLY) or (
        getattr(orig, "sqlstate", None) == "25006"
    )


_reader_keys = itertools.count()
#: Frames that can be suspended and resumed in another thread: generators and coroutines.
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
#: Every live Unit of Work, so a forked child can reset them all.
_LIVE: weakref.WeakSet[UnitOfWork] = weakref.WeakSet()
#: What a forked child inherited from its parent: kept referenced, never used or closed.
_INHERITED: list[object] = []
#: Files (device, inode) this process must not use, and why (inherited by its children).
_REFUSED: dict[tuple[int, int], HermesStoreError] = {}
#: ``_wal_id`` of a writer that found no WAL at its first commit (not in WAL mode).
_NO_WAL = (-1, -1)
#: Forks this process has gone through (as a child): a unit open across one sees it change.
_forks = 0


def _again(error: HermesStoreError) -> HermesStoreError:
    """A fresh exception like ``error`` (one instance is never raised twice)."""
    return type(error)(*error.args)


def _left_in_child(write: bool) -> ForkedProcessError:
    kind = "transaction" if write else "read unit"
    return ForkedProcessError(
        f"this {kind} was opened by the parent process before it forked: the child cannot "
        "commit or roll it back (it belongs to the parent, whose transaction is untouched), "
        "so nothing in it was saved here"
    )


def _keep_forever(thing: object) -> None:
    """Keep something inherited from the parent alive for the life of this process, never
    finalized, not even at interpreter exit: closing or rolling back a parent's SQLite
    connection here would act on the parent's locks and shared memory."""
    import ctypes

    _INHERITED.append(thing)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thing))


def _close_idle(pool: QueuePool) -> None:
    """Close the connections idle in ``pool``, keeping its count of checked-out ones right."""
    while True:
        try:
            record = pool._pool.get(False)
        except sa_queue.Empty:
            return
        record.close()
        pool._dec_overflow()


def _holds_deleted_wal(wal_path: str | None) -> bool:
    """This process has the WAL open although it was deleted (Linux: ``/proc/self/fd``)."""
    if wal_path is None:
        return False
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return False
    target = f"{wal_path} (deleted)"
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                return True
        except OSError:
            continue
    return False


def _before_fork() -> None:
    deadline = time.monotonic() + FORK_WAIT_S
    for uow in list(_LIVE):
        try:
            uow._before_fork(deadline)
        except Exception as error:  # never let a fork fail here: refuse the child instead
            uow._fork_busy = f"its connections could not be closed: {error!r}"
            log.warning("before fork: %s", uow._fork_busy)


def _after_fork_in_parent() -> None:
    for uow in list(_LIVE):
        uow._after_fork_in_parent()


def _after_fork_in_child() -> None:
    global _forks
    _forks += 1
    for uow in list(_LIVE):
        uow._after_fork_in_child()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
