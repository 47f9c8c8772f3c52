"""Read-only SQL for people: ``hermes-store query "SELECT ..."``, as sqlite-utils and
datasette users expect, on SQLite and PostgreSQL.

The database refuses writes itself, so no parsing of the SQL decides what is safe: SQLite
opens the file ``mode=ro`` with ``PRAGMA query_only``, PostgreSQL runs the statement in a
``READ ONLY`` transaction that is rolled back. Neither stops SQLite from opening *other*
files: ``ATTACH`` creates a missing one, and ``VACUUM INTO`` creates its target before
``query_only`` refuses the copy. So SQLite's authorizer refuses ``ATTACH``, ``DETACH`` and
every ``VACUUM`` while the statement is prepared, before any file is opened. One statement
per call: sqlite3 refuses several, and on PostgreSQL the statement is sent in psycopg's
pipeline mode (the extended protocol, one statement) since with no parameters psycopg sends
the simple protocol, where ``COMMIT; DELETE ...`` ended the read-only transaction first.
Ctrl-C interrupts a long query, and every query stops after ``timeout`` seconds (one minute
unless told otherwise): on PostgreSQL a query holds its snapshot, and whatever it locks (a
``DO`` block may ``LOCK TABLE`` in any mode even in a read-only transaction) it holds from the
fleet's writers until it ends.

A read-only transaction does not bind every PostgreSQL role: a superuser, or a member of
``pg_write_server_files``, ``pg_read_server_files`` or ``pg_execute_server_program``, can
``COPY ... TO`` a server file or ``TO PROGRAM`` in one, and a ``DO`` block undoes any
``SET ROLE`` that would narrow it. So a query connected as such a role is refused before its
statement is sent: analysts connect as a role that may only read.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store.echo import echoed
from hermes_store.engine import files
from hermes_store.engine.factory import create_engine, sqlite_file, to_url, unreadable_in_wal
from hermes_store.errors import (
    InvalidInputError,
    NotADatabaseError,
    StoreConfigError,
    mapped_errors,
    sqlite_interrupted,
    wrap_driver_error,
)
from hermes_store.validate import INT64_MAX, INT64_MIN

__all__ = ["DEFAULT_QUERY_TIMEOUT_S", "QueryResult", "read_only_query"]

#: SQLite virtual-machine steps between two chances for Ctrl-C (or the timeout) to stop a query.
_INTERRUPT_EVERY = 100_000
#: How long a query may run unless its caller says otherwise (None: no limit).
DEFAULT_QUERY_TIMEOUT_S = 60.0
#: SQLite's authorizer action for a function call, and the function it refuses: with one
#: argument it returns a tokenizer's address in memory, with two it replaces the tokenizer.
_FUNCTION = sqlite3.SQLITE_FUNCTION
_REFUSED_FUNCTIONS = frozenset({"fts3_tokenizer"})
#: Authorizer actions that open or let go of another database file. ``VACUUM`` reports an
#: ``ATTACH`` of its target (``INTO``) or of its temporary copy, so it is refused with them.
_OTHER_FILES = frozenset({sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH})
_OTHER_FILES_REFUSED = (
    "ATTACH, DETACH and VACUUM are refused: a query only reads this database and opens or "
    "creates no other file"
)
#: Whether the connected PostgreSQL role reaches past the database (a superuser has every
#: role's privileges): its SQL could write or read the server's files or run programs.
#: Asked with the query's timeout set (``:ms``, 0: none), in the one round trip before it.
_SERVER_REACH = sa.text(
    "SELECT current_user, pg_has_role('pg_write_server_files', 'USAGE') "
    "OR pg_has_role('pg_read_server_files', 'USAGE') "
    "OR pg_has_role('pg_execute_server_program', 'USAGE'), "
    "set_config('statement_timeout', :ms, true)"
)
#: SQLSTATE classes of a statement that never ran or broke the connection, not the query's
#: fault: connection exceptions, operator intervention, insufficient resources, system and
#: internal errors. A protocol violation (``SELECT $1``: a parameter with no value) is the
#: query's.
_NOT_THE_QUERYS = ("08", "57P", "53", "58", "XX")
_PROTOCOL_VIOLATION = "08P01"
_QUERY_CANCELED = "57014"


@dataclass(frozen=True)
class QueryResult:
    """The column names and the rows (each a tuple, in column order) of one statement."""

    columns: list[str]
    rows: list[tuple[Any, ...]]
    #: True when ``max_rows`` cut the result.
    truncated: bool = False


def read_only_query(
    target: str | URL,
    sql: str,
    params: Mapping[str, Any] | None = None,
    *,
    max_rows: int | None = None,
    timeout: float | None = DEFAULT_QUERY_TIMEOUT_S,
) -> QueryResult:
    """Run one statement that may only read, with ``:name`` parameters bound by the driver,
    stopped after ``timeout`` seconds (None: no limit)."""
    if not isinstance(sql, str):
        raise InvalidInputError(f"the query must be a string, not {type(sql).__name__}")
    if not sql.strip():
        raise InvalidInputError("the query is empty")
    _check_text("the query", sql)
    if max_rows is not None and (
        not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1
    ):
        raise InvalidInputError("max_rows must be a whole number >= 1")
    if timeout is not None and (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not 0 < timeout < _TIMEOUT_MAX_S
    ):
        raise InvalidInputError(
            f"timeout must be a number of seconds above 0 (None: no limit), not {echoed(timeout)}"
        )
    bound = _checked_params(params)
    url = to_url(target)
    path = sqlite_file(url)
    if path is not None:
        return _on_sqlite(path, sql, bound, max_rows, timeout)
    return _on_server(url, sql, bound, max_rows, timeout)


#: The longest timeout PostgreSQL's statement_timeout holds (milliseconds in an int).
_TIMEOUT_MAX_S = 2_147_483.0


def _timed_out(timeout: float) -> InvalidInputError:
    return InvalidInputError(
        f"the query ran past its timeout of {timeout:g} s and was stopped; nothing was "
        "changed (give a longer timeout, or none)"
    )


def _check_text(what: str, text: str) -> None:
    """Text no driver can send as UTF-8 (a lone surrogate: a command-line argument's byte
    that is not UTF-8) is the argument's fault, said before anything runs."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidInputError(f"{what} is not valid Unicode text: {error.reason}") from None


def _checked_params(params: object) -> dict[str, Any]:
    """The parameters as a dict, refused here (not as the driver's TypeError, OverflowError
    or UnicodeEncodeError) when they are no mapping of names, when a text value cannot be
    sent as UTF-8, or when an integer is beyond the 64-bit range SQLite binds."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise InvalidInputError(
            f"the parameters must be a mapping of names to values, not {type(params).__name__}"
        )
    bound: dict[str, Any] = {}
    for name, value in params.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"parameter names must be strings, not {echoed(name)}")
        _check_text(f"the parameter name {echoed(name)}", name)
        if isinstance(value, str):
            _check_text(f"parameter {echoed(name)}", value)
        elif isinstance(value, int) and not INT64_MIN <= int.__index__(value) <= INT64_MAX:
            raise InvalidInputError(
                f"parameter {echoed(name)} must be within the 64-bit range ({INT64_MIN} to "
                f"{INT64_MAX}), not {echoed(value)}"
            )
        bound[name] = value
    return bound


def _refused(error: sqlite3.Error | sa.exc.DBAPIError) -> InvalidInputError | None:
    """A statement the database refused because it writes, or that is malformed: the input's
    fault, said in words."""
    text = str(getattr(error, "orig", error))
    if "readonly" in text.replace(" ", "").lower() or "read-only" in text.lower():
        return InvalidInputError(f"the query tried to write; queries only read: {text}")
    return None


class _FileGuard:
    """SQLite authorizer that denies :data:`_OTHER_FILES` and :data:`_REFUSED_FUNCTIONS` and
    remembers what it denied, so the refusal is said in words rather than as SQLite's "not
    authorized"."""

    def __init__(self) -> None:
        self.denied: str | None = None

    def __call__(self, action: int, _table: str | None, name: str | None, *_: str | None) -> int:
        if action in _OTHER_FILES:
            self.denied = _OTHER_FILES_REFUSED
            return sqlite3.SQLITE_DENY
        if action == _FUNCTION and name is not None and name.lower() in _REFUSED_FUNCTIONS:
            self.denied = f"the function {name} is refused: it reads or changes SQLite's memory"
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK


class _Deadline:
    """SQLite's progress handler: it lets Ctrl-C through (Python checks signals as it runs)
    and stops the query once ``timeout`` seconds have passed, remembering it did."""

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout
        self.passed = False

    def __call__(self) -> int:
        if self.at is not None and time.monotonic() > self.at:
            self.passed = True
            return 1
        return 0


def _on_sqlite(
    path: Path, sql: str, params: dict[str, Any], max_rows: int | None, timeout: float | None
) -> QueryResult:
    if not path.exists():
        raise NotADatabaseError(f"there is no database at {path}")
    connection = files.connect_sqlite(path, read_only=True, immutable=unreadable_in_wal(path))
    with contextlib.closing(connection):
        connection.execute("PRAGMA query_only = ON")
        deadline = _Deadline(timeout)
        connection.set_progress_handler(deadline, _INTERRUPT_EVERY)
        guard = _FileGuard()
        connection.set_authorizer(guard)
        try:
            cursor = connection.execute(sql, params)
            return _collect([d[0] for d in cursor.description or ()], cursor.fetchmany, max_rows)
        except sqlite3.ProgrammingError as error:  # several statements, a missing parameter
            raise InvalidInputError(f"the query cannot run: {error}") from None
        except sqlite3.Error as error:
            if sqlite_interrupted(error):
                if deadline.passed and timeout is not None:
                    raise _timed_out(timeout) from None
                raise KeyboardInterrupt from None  # Ctrl-C, raised in the progress handler
            if guard.denied is not None:
                raise InvalidInputError(guard.denied) from None
            refused = _refused(error)
            if refused is not None:
                raise refused from None
            raise InvalidInputError(f"the database refused the query: {error}") from None


def _on_server(
    url: URL, sql: str, params: dict[str, Any], max_rows: int | None, timeout: float | None
) -> QueryResult:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with mapped_errors(), engine.connect() as conn:
            conn = conn.execution_options(postgresql_readonly=True)
            with conn.begin() as transaction:
                _prepare_server_query(conn, timeout)
                try:
                    return _one_statement(conn, sql, params, max_rows)
                except sa.exc.DBAPIError as error:
                    raise _server_refusal(error, timeout) from None
                finally:
                    transaction.rollback()
    finally:
        engine.dispose()


def _server_refusal(error: sa.exc.DBAPIError, timeout: float | None) -> Exception:
    """What the caller hears of the server's refusal of the query: the query's own fault
    (a write, a syntax error, a statement a transaction cannot run ...) in words; a lost
    connection or a server in trouble as the package names it elsewhere."""
    refused = _refused(error)
    if refused is not None:
        return refused
    sqlstate = getattr(error.orig, "sqlstate", None) or ""
    if sqlstate == _QUERY_CANCELED and timeout is not None:
        return _timed_out(timeout)
    if "multiple commands" in str(error) or (
        sqlstate and (sqlstate == _PROTOCOL_VIOLATION or not sqlstate.startswith(_NOT_THE_QUERYS))
    ):
        return InvalidInputError(f"the database refused the query: {error.orig}")
    return error


def _prepare_server_query(conn: sa.Connection, timeout: float | None) -> None:
    """Refuse a role whose SQL a read-only transaction does not confine (see the module), and
    set the query's timeout for this transaction only: one round trip."""
    ms = "0" if timeout is None else str(max(1, round(timeout * 1000)))
    role, reaches, _ = conn.execute(_SERVER_REACH, {"ms": ms}).one()
    if reaches:
        raise StoreConfigError(
            f"queries are refused to the PostgreSQL role {echoed(role)}: it may write or read the "
            "server's files or run programs there (a superuser, or a member of "
            "pg_write_server_files, pg_read_server_files or pg_execute_server_program), which "
            "a read-only transaction does not stop; connect as a role that may only read "
            "(granted only reads of the store's tables)"
        )


def _one_statement(
    conn: sa.Connection, sql: str, params: dict[str, Any], max_rows: int | None
) -> QueryResult:
    """The statement through psycopg's pipeline mode, which always uses the extended query
    protocol, and that takes exactly one statement. With no parameters psycopg would send it
    with the simple protocol, which runs several: ``COMMIT; DELETE FROM messages`` ended the
    ``READ ONLY`` transaction and deleted in autocommit."""
    statement = sa.text(sql).compile(dialect=conn.dialect)
    try:
        bound = statement.construct_params(params)
    except sa.exc.InvalidRequestError as error:  # a :name without a value
        raise InvalidInputError(
            f"the query cannot run: {error.args[0]} (a colon before a name that is no "
            "parameter is written \\:)"
        ) from None
    driver: Any = conn.connection.driver_connection
    try:
        with contextlib.closing(driver.cursor()) as cursor:
            with driver.pipeline() as pipeline:
                cursor.execute(statement.string, bound)
                pipeline.sync()
            if cursor.description is None:  # a command that returns no rows (SET, ...)
                return QueryResult([], [])
            columns = [column.name for column in cursor.description]
            return _collect(columns, cursor.fetchmany, max_rows)
    except conn.dialect.loaded_dbapi.Error as orig:
        raise wrap_driver_error(orig, conn.dialect, statement.string) from orig


def _none(size: int) -> list[tuple[Any, ...]]:
    return []


def _collect(columns: list[str], fetch: Callable[[int], Any], max_rows: int | None) -> QueryResult:
    rows: list[tuple[Any, ...]] = []
    while True:
        batch = fetch(1000)
        if not batch:
            return QueryResult(columns, rows)
        rows.extend(tuple(row) for row in batch)
        if max_rows is not None and len(rows) > max_rows:
            return QueryResult(columns, rows[:max_rows], truncated=True)
