"""Held readers: each thread that reads a SQLite file keeps a read connection of its own.

The hot reads (``get_session``, counts, titles) are one statement each: on the thread's own
connection they cost no pool checkout, no Connection and no per-execution SQLAlchemy work, and
one statement is one implicit read transaction (one snapshot). Up to :data:`MAX_HELD_READERS`
threads hold one; the others check one out per read. A held connection goes back to the pool
when its thread ends, at ``SessionDB.close``, and before a fork (closed, only between two
reads: each read holds its connection's ``busy`` lock).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Literal, overload

from sqlalchemy.engine import Engine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql import ClauseElement

from hermes_store.engine import fastpath
from hermes_store.engine.factory import SqliteSettings, prepare_driver
from hermes_store.errors import InvalidInputError, map_driver_error, mapped_errors
from hermes_store.uow import fork
from hermes_store.uow.counters import Counters

#: Threads that keep a read connection of their own (the rest check one out per read).
MAX_HELD_READERS = 16


class Reader:
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
    """Lives in one thread's thread-local: its death tells the readers the thread ended."""


_reader_keys = itertools.count()


class HeldReaders:
    """The read connections threads hold on one SQLite file (one set per Unit of Work)."""

    def __init__(self, engine: Engine, settings: SqliteSettings, counters: Counters) -> None:
        self.engine = engine
        self.settings = settings
        self.counters = counters
        self._dialect = engine.dialect
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self._lock = threading.Lock()
        self.held: dict[int, tuple[Reader, weakref.finalize[Any, Any]]] = {}
        self.local = threading.local()

    def scalar(self, statement: ClauseElement, params: Mapping[str, Any] | None) -> Any:
        """The first column of the first row (None: no row), on this thread's connection:
        the cheapest read there is."""
        reader: Reader | None = self.local.__dict__.get("reader")
        if reader is None or not reader.ready:
            return self.fetch(statement, params, one=True)
        plan = fastpath.plan(statement, self._dialect)
        values = plan.bind(params)
        busy = reader.busy
        busy.acquire()
        if reader.closed:  # closed by a fork meanwhile
            busy.release()
            return self.fetch(statement, params, one=True)
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
        self.counters.stats.read_units += 1  # a diagnostic count: not worth a lock here
        return None if row is None else row[0]

    @overload
    def fetch(
        self, statement: ClauseElement, params: Mapping[str, Any] | None
    ) -> tuple[list[str], list[Any]]: ...

    @overload
    def fetch(
        self, statement: ClauseElement, params: Mapping[str, Any] | None, *, one: Literal[True]
    ) -> Any: ...

    def fetch(
        self, statement: ClauseElement, params: Mapping[str, Any] | None, *, one: bool = False
    ) -> Any:
        """Run a prebuilt read statement on this thread's read connection: its column names
        and rows, or (``one``) its first row's first column."""
        reader = self._locked_reader()
        dialect = self._dialect
        plan = fastpath.plan(statement, dialect)
        values = plan.bind(params)
        driver = reader.driver
        try:
            if not reader.ready:  # the connection's state, set once (it only ever reads)
                prepare_driver(driver, reader.info, self.settings, write=False)
                reader.ready = True
            cursor = driver.execute(plan.sql, values)
            if one:
                row = cursor.fetchone()
                return None if row is None else row[0]
            found = cursor.fetchall()
            names = plan.columns
            if names is None:
                names = plan.columns = [column[0] for column in cursor.description]
        except self._dbapi_error as orig:
            raise map_driver_error(plan.sql, values, orig, dialect) from orig
        except UnicodeEncodeError as error:  # a lone surrogate reached the driver's encoder
            raise InvalidInputError(
                f"a text argument is not valid Unicode: {error.reason}"
            ) from None
        finally:
            reader.busy.release()
            if not reader.held:
                reader.pooled.close()
            self.counters.stats.read_units += 1  # a diagnostic count: not worth a lock here
        return names, found

    def _take(self) -> Reader:
        """This thread's held read connection, else (past the cap) one checked out for a read."""
        with mapped_errors():  # connecting runs the connect hook's PRAGMAs (a full disk fails)
            pooled = self.engine.raw_connection()
        key = next(_reader_keys)
        with self._lock:
            if len(self.held) >= MAX_HELD_READERS:
                return Reader(pooled, held=False)
            # Given back to the pool when the thread ends (its thread-local dies with it).
            marker = _ThreadMarker()
            self.local.marker = marker
            reader = self.local.reader = Reader(pooled, held=True)
            finalizer = weakref.finalize(marker, self._release, key)
            self.held[key] = (reader, finalizer)
        return reader

    def _locked_reader(self) -> Reader:
        """This thread's read connection, locked while it reads: a fork in another thread
        closes it only between two reads (the thread then takes a new one)."""
        while True:
            reader: Reader | None = self.local.__dict__.get("reader")
            if reader is None:
                reader = self._take()
            reader.busy.acquire()
            if not reader.closed:
                return reader
            reader.busy.release()
            if self.local.__dict__.get("reader") is reader:
                del self.local.reader

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self.held.pop(key, None)
        if entry is not None:
            entry[0].pooled.close()

    def release(self) -> None:
        """Give every held connection back to the pool (the last ``SessionDB.close``)."""
        with self._lock:
            readers, self.held = self.held, {}
        for reader, finalizer in readers.values():
            finalizer.detach()
            reader.pooled.close()
        self.local = threading.local()

    def close_for_fork(self, deadline: float, locked: list[Any]) -> str | None:
        """Close every held connection before a fork, each once its thread is between two
        reads (its ``busy`` lock is appended to ``locked``, released after the fork); or why
        one could not be closed by ``deadline``."""
        with self._lock:
            readers = list(self.held.items())
        for key, (reader, finalizer) in readers:
            if not reader.busy.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return f"another thread's read did not end within {fork.FORK_WAIT_S} s"
            locked.append(reader.busy)
            with self._lock:
                mine = self.held.pop(key, None) is not None
            if mine:
                finalizer.detach()
                reader.closed = True
                reader.pooled.close()
        return None

    def forget_in_child(self) -> tuple[object, ...]:
        """In a forked child: what the parent's readers were (never closed here, so returned
        to be kept); their finalizers will not run."""
        for _reader, finalizer in self.held.values():
            finalizer.detach()
        return (self.held, self.local)
