"""Group commit on PostgreSQL: a process's concurrent one-statement writes share one
transaction.

Why: every ``append_message`` and ``update_token_counts`` of a session updates its row, and
PostgreSQL holds a row's lock until the transaction's commit record is flushed, so writers of
a busy session go one WAL flush at a time however cheap their round trips are. Here, while one
write of this process is in flight, the others queue; the next leader sends them all as one
transaction: one round trip, one flush and one hold of each row's lock for the whole group.

How: a caller queues its statement; when no leader runs in this process it leads, takes every
queued statement (up to 32, its own among them) and sends them on an autocommit connection in
ONE pipeline (psycopg's pipeline mode): ``BEGIN``, each statement with its parameters bound by
the server, ``COMMIT`` and a single Sync, which the server answers all at once: one round trip
for one transaction, all of it or none. No value is ever quoted into SQL text, so no client
encoding, ``standard_conforming_strings`` or ``backslash_quote`` setting can turn a value into
SQL, and a value arrives as the ordinary path sends it (``-0.0`` keeps its sign). A lone write
is a group of one: its statement alone, exactly as the ordinary path sends it (one round trip).
Statements are ordered by their lock key (the session id), so groups of different processes
take row locks in the same order and never deadlock each other. Callers get their results only
once the group's transaction committed.

When a group fails:

- the server refused a statement (a missing session's foreign key, a deadlock ...): the whole
  transaction was rolled back, nothing landed; each caller runs its statement again, alone, on
  the ordinary one-statement path (:meth:`UnitOfWork.run_statement`'s retries) and gets that
  run's result or error, so only the faulty call fails;
- the group never left this process (the driver says so), or the connection broke before
  its COMMIT was sent: nothing landed; as above;
- the connection broke while the group was on its way or running: the outcome is unknown.
  Idempotent statements run again; the others raise :class:`WriteOutcomeUnknownError` ("may
  have landed"), as a lone statement lost in flight does: an unacknowledged write is never
  applied twice.

Only the store's hot one-statement writes outside ``transaction()`` blocks are grouped, and not
under ``AsyncSessionDB`` (one thread serves all its calls). ``HERMES_STORE_GROUP_COMMIT=0``
switches this off along with SQLite's group commit.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import Compiled, SQLCompiler

from hermes_store.engine.factory import autocommit_engine, connection_key
from hermes_store.errors import (
    HermesStoreError,
    WriteOutcomeUnknownError,
    connection_lost,
    never_sent,
    wrap_driver_error,
)
from hermes_store.uow.counters import Counters
from hermes_store.uow.leaders import DONE, FAILED, QUEUED, RERUN, LeaderQueue, Queued

log = logging.getLogger(__name__)

T = TypeVar("T")


def scalar(cursor: Any) -> Any:
    """The first column of the statement's first row (``RETURNING id``)."""
    row = cursor.fetchone()
    return row[0] if row is not None else None


def rowcount(cursor: Any) -> int:
    """The rows the statement changed."""
    return int(cursor.rowcount)


#: SQLSTATEs of a statement the server stopped: its lock_timeout (lock_not_available), its
#: statement_timeout or an administrator's pg_cancel_backend (query_canceled).
_STOPPED = frozenset({"55P03", "57014"})


class Grouped(Queued, Generic[T]):
    """A one-statement write that may share a transaction with others: a prebuilt statement
    (compiled once per dialect), its parameters, the key its row lock is taken in order of, and
    how its result is read from the cursor. ``idempotent`` (running it twice equals running it
    once) is set by :meth:`UnitOfWork.run_statement` from its own argument."""

    __slots__ = ("idempotent", "key", "maybe_landed", "outlet", "params", "read", "statement")

    def __init__(
        self,
        statement: ClauseElement,
        params: Mapping[str, Any],
        key: str,
        read: Callable[[Any], T],
    ) -> None:
        super().__init__()
        self.statement = statement
        self.params = params
        self.key = key
        self.read = read
        self.idempotent = False
        #: Its group was lost in flight and it runs again alone: it may have landed already.
        self.maybe_landed = False
        self.outlet: Outlet | None = None  # the caller's: a group it leads runs through it


SchemaMap = tuple[tuple[str | None, str | None], ...]
_compiled: dict[tuple[int, str, SchemaMap], tuple[ClauseElement, Compiled]] = {}
_compiled_lock = threading.Lock()


def schema_map(engine: Engine) -> SchemaMap:
    """The engine's ``schema_translate_map`` (a store in a schema of its own), hashable."""
    given = engine.get_execution_options().get("schema_translate_map") or {}
    return tuple(sorted(given.items(), key=repr))


def _bound(
    statement: ClauseElement, params: Mapping[str, Any], dialect: Dialect, schemas: SchemaMap
) -> tuple[str, dict[str, Any]]:
    """The driver's SQL and parameters for a prebuilt statement, compiled once per dialect and
    schema, with the store's schema written into the SQL as SQLAlchemy would translate it
    (the statement is kept in the cache, so its id stays unique)."""
    key = (id(statement), dialect.name, schemas)
    hit = _compiled.get(key)
    if hit is None or hit[0] is not statement:
        compiled = statement.compile(
            dialect=dialect,
            schema_translate_map=dict(schemas) or None,
            render_schema_translate=bool(schemas),
        )
        if isinstance(compiled, SQLCompiler) and compiled._bind_processors:
            raise TypeError("a grouped statement's parameters must need no bind processing")
        hit = (statement, compiled)
        with _compiled_lock:
            _compiled[key] = hit
    compiled = hit[1]
    return compiled.string, dict(compiled.construct_params(dict(params)) or {})


class _Stage(enum.Enum):
    """How far a group got when it failed: what a lost connection may have committed."""

    LONE = "lone"  # one autocommit statement: committed as soon as the server ran it
    STATEMENTS = "statements"  # the pipeline's BEGIN and statements: nothing can commit yet
    COMMIT = "commit"  # its COMMIT being handed to the driver
    SYNC = "sync"  # the COMMIT was sent: the server may have run it


@dataclass(frozen=True)
class Outlet:
    """What a group runs on and is counted in: its leader's engine (the group is sent on its
    autocommit twin; its dialect compiles the statements) and its leader's counters."""

    engine: Engine
    counters: Counters

    @property
    def autocommit(self) -> Engine:
        return autocommit_engine(self.engine)


class StatementGroups(LeaderQueue[Grouped[Any]]):
    """The group-commit queue of one PostgreSQL database and schema in this process (get it
    with :func:`for_database`): every store on them, whatever its engine, queues here."""

    def __init__(self, schemas: SchemaMap) -> None:
        super().__init__()
        self.schemas = schemas  # the schema translation its statements are compiled with

    def run(self, unit: Grouped[T], alone: Callable[[], T], outlet: Outlet) -> T:
        """``unit``'s result, committed in a group, or ``alone()``'s: the ordinary path, when
        its group failed (see the module's docstring). A group led by this caller runs
        through ``outlet``."""
        unit.outlet = outlet
        done, result = self._settled(unit)
        if done:
            return result  # type: ignore[no-any-return]
        outlet.counters.record_rerun()  # its group did not commit: run it again, alone
        return alone()

    def _lead(self, own: Grouped[Any]) -> None:
        assert own.outlet is not None
        self._commit(self._take(), own.outlet)

    def _commit(self, batch: list[Grouped[Any]], outlet: Outlet) -> None:
        """One group, sent and settled: every unit ends up done, failed (outcome unknown, not
        idempotent) or to be run again alone; the waiting callers are woken."""
        try:
            self._send(batch, outlet)
        except BaseException as error:  # never leave a taken unit waiting
            self._settle(batch, RERUN)
            if not isinstance(error, Exception):
                raise
            log.warning("a PostgreSQL write group was not sent (%s); its writes run alone", error)
        finally:
            with self._lock:  # entered in C (see LeaderQueue)
                self._group = []  # settled: the units (and their stores' engines) go
                self._cond.notify_all()

    def _send(self, batch: list[Grouped[Any]], outlet: Outlet) -> None:
        dialect = outlet.engine.dialect
        dbapi_error: type[Exception] = dialect.loaded_dbapi.Error
        ordered = sorted(batch, key=lambda unit: unit.key)
        try:
            conn = outlet.autocommit.connect()
        except sa_exc.DBAPIError as error:  # nothing sent: the ordinary path retries it
            log.info("no connection for a PostgreSQL write group (%s); writes run alone", error)
            self._settle(batch, RERUN)
            return
        try:
            driver: Any = conn.connection.driver_connection
            bound = [_bound(unit.statement, unit.params, dialect, self.schemas) for unit in ordered]
            cursors = [driver.cursor() for _ in ordered]
            dispatch = conn.dispatch  # the cursor events fire, as for any statement
            stage = _Stage.STATEMENTS if len(ordered) > 1 else _Stage.LONE
            try:
                if dispatch.before_cursor_execute:
                    for cursor, (sql, params) in zip(cursors, bound, strict=True):
                        dispatch.before_cursor_execute(conn, cursor, sql, params, None, False)
                if stage is _Stage.LONE:  # a lone write: sent as the ordinary path sends it
                    cursors[0].execute(*bound[0])
                else:
                    # BEGIN and COMMIT inside the pipeline: a statement that fails, or one that
                    # never leaves (a value the driver cannot send), leaves the transaction
                    # open at the pipeline's Sync instead of committing the ones before it.
                    control = driver.cursor()
                    with driver.pipeline():
                        control.execute("BEGIN", prepare=False)
                        for cursor, (sql, params) in zip(cursors, bound, strict=True):
                            cursor.execute(sql, params)
                        stage = _Stage.COMMIT
                        control.execute("COMMIT", prepare=False)
                        stage = _Stage.SYNC
                if dispatch.after_cursor_execute:
                    for cursor, (sql, params) in zip(cursors, bound, strict=True):
                        dispatch.after_cursor_execute(conn, cursor, sql, params, None, False)
            except dbapi_error as orig:
                self._failed(outlet, conn, batch, orig, stage)
                return
            except BaseException:  # interrupted in flight: the outcome is unknown
                conn.invalidate()
                self._unknown(batch, "the write's group was interrupted in flight")
                raise
            try:
                self._settle_committed(outlet, ordered, cursors)
            except BaseException:  # an interrupt: committed all the same, never run again
                self._unread(batch)
                raise
        finally:
            conn.close()

    def _settle_committed(
        self, outlet: Outlet, ordered: list[Grouped[Any]], cursors: list[Any]
    ) -> None:
        """The group committed: hand each caller its result (never a re-run)."""
        with self._lock:  # entered in C (see LeaderQueue)
            for unit, cursor in zip(ordered, cursors, strict=True):
                try:
                    unit.state, unit.result = DONE, unit.read(cursor)
                except Exception as error:  # committed all the same: say so, never re-run it
                    unit.state = FAILED
                    unit.error = HermesStoreError(
                        f"the write committed (in a group) but its result was unreadable: {error}"
                    )
        outlet.counters.record_group(len(ordered), lost=False)
        outlet.counters.count_writes(len(ordered))

    def _unread(self, batch: list[Grouped[Any]]) -> None:
        """The group committed but an interrupt (Ctrl-C) stopped its leader reading the
        results: the callers still waiting are told so; none runs its write again."""
        error = HermesStoreError(
            "the write committed (in a group), but an interrupt stopped its result being read"
        )
        with self._lock:  # entered in C (see LeaderQueue)
            for unit in batch:
                if unit.state == QUEUED:
                    unit.state, unit.error = FAILED, error

    def _failed(
        self,
        outlet: Outlet,
        conn: Connection,
        batch: list[Grouped[Any]],
        orig: Exception,
        stage: _Stage,
    ) -> None:
        """The group failed: refused by the server, or lost before its COMMIT could have run
        (nothing landed: run each again alone), else lost in flight (unknown)."""
        error = wrap_driver_error(orig, outlet.engine.dialect)
        outlet.counters.record_group(len(batch), lost=True)
        driver: Any = conn.connection.driver_connection
        if not connection_lost(error) and not driver.closed:
            # Refused (or stopped before its COMMIT): nothing of the group committed.
            if not _rolled_back(conn, driver):
                conn.invalidate()  # the server drops the open transaction with the connection
            if stage is _Stage.LONE and getattr(orig, "sqlstate", None) in _STOPPED:
                # Sent as the ordinary path sends it: run again, it would wait again for the
                # row the server stopped it waiting for (a timeout, an administrator's cancel).
                self._fail(batch, error)
                return
            log.debug("a PostgreSQL write group was rolled back (%s); its writes run alone", orig)
            self._settle(batch, RERUN)
            return
        conn.invalidate()
        # Before its COMMIT was handed to the driver, a lost group's transaction could only end
        # in a rollback; while the COMMIT is handed over, the driver says whether it left.
        if stage is _Stage.STATEMENTS or (stage is not _Stage.SYNC and never_sent(error)):
            self._settle(batch, RERUN)
            return
        self._unknown(
            batch,
            "lost the database connection while the write's group was in flight: it may have "
            f"landed (not retried, so it is never applied twice): {orig}",
            cause=error,
        )

    def _unknown(
        self, batch: list[Grouped[Any]], message: str, cause: BaseException | None = None
    ) -> None:
        """The group may or may not have committed: idempotent units run again, the others
        fail with :class:`WriteOutcomeUnknownError`."""
        unknown = WriteOutcomeUnknownError(message)
        unknown.__cause__ = cause
        with self._lock:  # entered in C (see LeaderQueue)
            for unit in batch:
                if unit.state != QUEUED:
                    continue
                if unit.idempotent:
                    unit.state, unit.maybe_landed = RERUN, True
                else:
                    unit.state, unit.error = FAILED, unknown

    def _fail(self, batch: list[Grouped[Any]], error: BaseException) -> None:
        """The units of ``batch`` still undecided raise ``error`` (named as the package
        names it where each caller waits)."""
        with self._lock:  # entered in C (see LeaderQueue)
            for unit in batch:
                if unit.state == QUEUED:
                    unit.state, unit.error = FAILED, error

    def _settle(self, batch: list[Grouped[Any]], state: int) -> None:
        """Set the units of ``batch`` that are still undecided to ``state``."""
        with self._lock:  # entered in C (see LeaderQueue)
            for unit in batch:
                if unit.state == QUEUED:
                    unit.state = state


def _rolled_back(conn: Connection, driver: Any) -> bool:
    """End the transaction a failed group left open (its pipeline's BEGIN): True once the
    connection is idle again (no round trip when it already is)."""
    dbapi = conn.dialect.loaded_dbapi
    if driver.info.transaction_status == dbapi.pq.TransactionStatus.IDLE:
        return True
    try:
        driver.rollback()
    except dbapi.Error as error:
        log.info("could not roll back a failed PostgreSQL write group (%s)", error)
        return False
    return True


#: The queues of the engines this package made: by process, database and schema.
_registry: dict[tuple[object, ...], StatementGroups] = {}
#: A caller's engine's queues, by process and schema: they go with the engine.
_by_engine: weakref.WeakKeyDictionary[Engine, dict[tuple[object, ...], StatementGroups]] = (
    weakref.WeakKeyDictionary()
)
_registry_lock = threading.Lock()


def for_database(engine: Engine) -> StatementGroups:
    """This process's group-commit queue for ``engine``'s database and schema (keyed by the
    process, so a forked child never waits on its parent's queue; by the schema, so a group
    is written into one schema). Stores on engines this package made from one URL share it;
    a caller's engine has its own, kept with the engine."""
    schemas = schema_map(engine)
    where = connection_key(engine)
    key: tuple[object, ...]
    with _registry_lock:
        if where is None:
            queues, key = _by_engine.setdefault(engine, {}), (os.getpid(), schemas)
        else:
            queues, key = _registry, (os.getpid(), where, schemas)
        groups = queues.get(key)
        if groups is None:
            groups = queues[key] = StatementGroups(schemas)
    return groups


class PgGroupCommit:
    """One Unit of Work's group commit on PostgreSQL: the statement groups of its database and
    schema in this process (``groups``, shared by every store on them) and its own ``outlet``,
    which a group its caller leads runs on and is counted in."""

    def __init__(self, groups: StatementGroups, outlet: Outlet) -> None:
        self.groups = groups
        self.outlet = outlet

    def run(self, unit: Grouped[T], alone: Callable[[], T]) -> T:
        """``unit``'s result, committed in a group, or ``alone()``'s (see
        :meth:`StatementGroups.run`)."""
        return self.groups.run(unit, alone, self.outlet)

    def queued(self) -> int:
        return self.groups.queued()

    def wait_for_queued(self, count: int, timeout: float) -> bool:
        return self.groups.wait_for_queued(count, timeout)
