"""The Unit of Work: one connection, one transaction, commit on success, rollback on error.

Write units take the lock up front (``BEGIN IMMEDIATE`` on SQLite, via the engine's begin hook)
and are re-run from scratch, on a fresh connection, when the database is busy or locked: up to
15 attempts with ``random.uniform(0.020, 0.150)`` s between them, the seed's policy that keeps
competing processes from retrying in lockstep (7.5.2). Every other error propagates at once.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import PoolProxiedConnection

from hermes_store import writequeue
from hermes_store.engine import BUSY_TIMEOUTS_KEY, WRITE_OPTION, begin_on_driver, sqlite_file
from hermes_store.errors import DatabaseLockedError, is_retryable, mapped_errors

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a unit that found the database locked."""

    attempts: int = 15
    min_wait: float = 0.020
    max_wait: float = 0.150

    def waits(self) -> Iterator[float]:
        """One random pause before each retry (so ``attempts - 1`` of them)."""
        for _ in range(self.attempts - 1):
            yield random.uniform(self.min_wait, self.max_wait)


_ENGINE_BUSY_KEY = "hermes_engine_busy_timeouts"


def _head_busy_timeout(info: dict[Any, Any], head: bool) -> float:
    """A queue head polls SQLite's lock with a short busy timeout: only foreign writers hold it,
    and on BUSY the head leaves its turn for the jittered retry instead of holding up the line.
    Everyone else keeps the engine's writer timeout (read back by ``begin_on_driver``).
    Returns the share of the engine's timeout that one attempt waits (1.0 off the head)."""
    engine_ms, reader_ms = info.setdefault(_ENGINE_BUSY_KEY, info[BUSY_TIMEOUTS_KEY])
    writer_ms = engine_ms
    if head:
        writer_ms = min(engine_ms, int(writequeue.HEAD_BUSY_TIMEOUT_S * 1000))
    info[BUSY_TIMEOUTS_KEY] = (writer_ms, reader_ms)
    return writer_ms / engine_ms if engine_ms > 0 else 1.0


class UnitOfWork:
    """Runs read and write units against one engine; thread-safe, shared by a whole process.

    ``with uow.session() as s:`` yields an ORM session bound to one connection and commits
    when the block ends cleanly; ``uow.run(fn)`` re-runs ``fn(connection)`` whole on lock errors.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        retry: RetryPolicy | None = None,
        checkpoint_every: int = 50,
        write_queue: bool = True,
    ) -> None:
        self.engine = engine
        self.retry = retry or RetryPolicy()
        self.checkpoint_every = checkpoint_every
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._writer = engine.execution_options(**{WRITE_OPTION: True})
        self._reader = engine.execution_options(**{WRITE_OPTION: False})
        # In-process writers queue on this lock; other processes meet SQLite's write lock.
        self._write_lock = threading.Lock() if self.is_sqlite else None
        # Across processes and threads, writers to a SQLite file line up in the fair writer
        # queue (off with write_queue=False or HERMES_STORE_WRITE_QUEUE=0: benchmarks).
        path = sqlite_file(engine.url) if self.is_sqlite and write_queue else None
        self._queue_path = path
        self._count_lock = threading.Lock()
        self.writes = 0
        self.checkpoints = 0
        self._driver_connection: PoolProxiedConnection | None = None  # run_driver's writer
        self._head_share = 1.0  # of the engine's busy timeout, waited by the last hot-path begin

    # -- the units ---------------------------------------------------------------------------

    def run(self, fn: Callable[[Connection], T], *, write: bool = True) -> T:
        """Run ``fn`` in one transaction; on a lock error, run it again on a fresh connection."""
        waits = self.retry.waits()
        while True:
            try:
                with self._unit(write, waits) as conn:
                    return fn(conn)
            except sa_exc.DBAPIError as error:
                if not is_retryable(error):
                    raise
                self._pause(waits, error)

    def run_driver(self, fn: Callable[[Any], T]) -> T:
        """A SQLite write unit on the driver's own cursor: the hot path (``append_message``).

        The same in-process lock, ``BEGIN IMMEDIATE``, retry policy, error mapping and
        checkpoint cadence as :meth:`run`, but on one writer connection kept for the purpose
        (writes are serialised by the lock anyway, as in the seed) and without a SQLAlchemy
        Connection around each statement: ``fn`` gets a DB-API cursor and runs statements
        compiled once from Core. SQLite only; other backends use :meth:`run`.
        """
        if self._write_lock is None:
            raise RuntimeError("run_driver is the SQLite hot path; use run() on this backend")
        waits = self.retry.waits()
        # A queue head waits with a shorter busy timeout than the engine's: its rounds spend
        # the retry budget pro rata, so a write is as patient with a foreign writer as before.
        spent = 0.0
        while True:
            try:
                with self._write_turn() as head, mapped_errors():
                    result = self._driver_attempt(fn, head=head)
            except sa_exc.DBAPIError as error:
                if not is_retryable(error):
                    raise
                if head:
                    spent += self._head_share
                    if spent < 1.0:
                        log.debug("database busy (%s) at the head of the writer queue", error)
                        time.sleep(random.uniform(self.retry.min_wait, self.retry.max_wait))
                        continue
                    spent -= 1.0
                self._pause(waits, error)
                continue
            self._count_write()
            return result

    def _driver_attempt(self, fn: Callable[[Any], T], *, head: bool = False) -> T:
        dbapi_error: type[Exception] = self.engine.dialect.loaded_dbapi.Error
        try:
            held = self._driver_connection
            if held is None:
                held = self._driver_connection = self.engine.raw_connection()
            driver = held.driver_connection
            assert driver is not None
            try:
                self._head_share = _head_busy_timeout(held.info, head)
                begin_on_driver(driver, held.info, write=True)
                result = fn(driver.cursor())
                driver.commit()
            except BaseException:
                try:
                    driver.rollback()
                except dbapi_error:
                    self._drop_driver(invalidate=True)  # state unknown: never reuse it
                    raise
                self._drop_driver(invalidate=False)  # a retry starts on a fresh connection
                raise
        except dbapi_error as orig:  # the same wrapped errors as the Connection path
            raise sa_exc.DBAPIError.instance(
                None, None, orig, dbapi_error, dialect=self.engine.dialect
            ) from orig
        return result

    def release_driver(self) -> None:
        """Give the hot path's writer connection back to the pool (``SessionDB.close``)."""
        with self._write_lock or nullcontext():  # never while a unit is using it
            self._drop_driver(invalidate=False)

    def _drop_driver(self, *, invalidate: bool) -> None:
        held, self._driver_connection = self._driver_connection, None
        if held is None:
            return
        if invalidate:
            held.invalidate()
        else:
            _head_busy_timeout(held.info, False)  # back in the pool with the engine's timeouts
            held.close()

    def connect(self, *, write: bool = True) -> AbstractContextManager[Connection]:
        """A connection inside one transaction: commit on a clean exit, rollback otherwise.

        Waiting for the lock is retried; the block itself runs once (use :meth:`run` to
        re-run a whole unit that may meet a lock midway, as on PostgreSQL).
        """
        return self._unit(write, self.retry.waits())

    @contextmanager
    def _unit(self, write: bool, waits: Iterator[float]) -> Iterator[Connection]:
        with self._write_turn() if write else nullcontext(), mapped_errors():
            conn = self._begin(write, waits)
            with conn:  # closing an uncommitted connection rolls it back
                yield conn
                conn.commit()
        if write:
            self._count_write()

    @property
    def write_queue(self) -> writequeue.WriteQueue | None:
        """This process's fair writer queue for the database file (None: not a file, or off)."""
        if self._queue_path is None:
            return None
        return writequeue.for_database(self._queue_path)

    @contextmanager
    def _write_turn(self) -> Iterator[bool]:
        """One writer at a time: the fair queue's turn (SQLite files), then the in-process lock.

        Yields True when this writer holds a queue turn (it is the head of the line, so only
        foreign writers compete with it in SQLite), False when it runs on the busy handler.
        """
        queue = self.write_queue
        if queue is None:
            with self._write_lock or nullcontext():  # PostgreSQL: the server orders writers
                yield False
            return
        assert self._write_lock is not None
        with queue.turn() as turn, self._write_lock:
            yield turn.queued

    def _begin(self, write: bool, waits: Iterator[float]) -> Connection:
        engine = self._writer if write else self._reader
        while True:
            conn = engine.connect()
            try:
                conn.begin()
            except sa_exc.DBAPIError as error:
                conn.close()
                if not is_retryable(error):
                    raise
                self._pause(waits, error)
                continue
            return conn

    @contextmanager
    def session(self, *, write: bool = True) -> Iterator[Session]:
        """An ORM session on one connection; flushed and committed when the block succeeds."""
        with self.connect(write=write) as conn, Session(bind=conn, expire_on_commit=False) as s:
            yield s
            s.flush()

    # -- maintenance -------------------------------------------------------------------------

    def checkpoint(self) -> bool:
        """A PASSIVE WAL checkpoint: merges what no reader still needs, never waits."""
        if not self.is_sqlite:
            return False
        try:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
        except sa_exc.DBAPIError as error:
            log.warning("WAL checkpoint failed (harmless, retried later): %s", error.orig)
            return False
        self.checkpoints += 1
        return True

    def _count_write(self) -> None:
        with self._count_lock:
            self.writes += 1
            due = self.checkpoint_every > 0 and self.writes % self.checkpoint_every == 0
        if due:
            self.checkpoint()

    def _pause(self, waits: Iterator[float], error: BaseException | None) -> None:
        try:
            delay = next(waits)
        except StopIteration:
            raise DatabaseLockedError(
                f"the database stayed locked through {self.retry.attempts} attempts: {error}"
            ) from error
        log.debug("database busy (%s); retrying in %.0f ms", error, delay * 1000)
        time.sleep(delay)
