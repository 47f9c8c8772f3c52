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
Ctrl-C interrupts a long SQLite query.

A read-only transaction does not bind every PostgreSQL role: a superuser, or a member of
``pg_write_server_files``, ``pg_read_server_files`` or ``pg_execute_server_program``, can
``COPY ... TO`` a server file or ``TO PROGRAM`` in one, and a ``DO`` block undoes any
``SET ROLE`` that would narrow it. So a query connected as such a role is refused before its
statement is sent: analysts connect as a role that may only read.
"""

from __future__ import annotations

import contextlib
import sqlite3
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
    wrap_driver_error,
)
from hermes_store.validate import INT64_MAX, INT64_MIN

__all__ = ["QueryResult", "read_only_query"]

#: SQLite virtual-machine steps between two chances for Ctrl-C to stop a query.
_INTERRUPT_EVERY = 100_000
#: Authorizer actions that open or let go of another database file. ``VACUUM`` reports an
#: ``ATTACH`` of its target (``INTO``) or of its temporary copy, so it is refused with them.
_OTHER_FILES = frozenset({sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH})
_OTHER_FILES_REFUSED = (
    "ATTACH, DETACH and VACUUM are refused: a query only reads this database and opens or "
    "creates no other file"
)
#: Whether the connected PostgreSQL role reaches past the database (a superuser has every
#: role's privileges): its SQL could write or read the server's files or run programs.
_SERVER_REACH = sa.text(
    "SELECT current_user, pg_has_role('pg_write_server_files', 'USAGE') "
    "OR pg_has_role('pg_read_server_files', 'USAGE') "
    "OR pg_has_role('pg_execute_server_program', 'USAGE')"
)


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
) -> QueryResult:
    """Run one statement that may only read, with ``:name`` parameters bound by the driver."""
    if not isinstance(sql, str):
        raise InvalidInputError(f"the query must be a string, not {type(sql).__name__}")
    if not sql.strip():
        raise InvalidInputError("the query is empty")
    _check_text("the query", sql)
    if max_rows is not None and (
        not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1
    ):
        raise InvalidInputError("max_rows must be a whole number >= 1")
    bound = _checked_params(params)
    url = to_url(target)
    path = sqlite_file(url)
    if path is not None:
        return _on_sqlite(path, sql, bound, max_rows)
    return _on_server(url, sql, bound, max_rows)


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
    """SQLite authorizer that denies :data:`_OTHER_FILES` and remembers it did, so the refusal
    is said in words rather than as SQLite's "not authorized"."""

    def __init__(self) -> None:
        self.denied = False

    def __call__(self, action: int, *_: str | None) -> int:
        if action in _OTHER_FILES:
            self.denied = True
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK


def _on_sqlite(path: Path, sql: str, params: dict[str, Any], max_rows: int | None) -> QueryResult:
    if not path.exists():
        raise NotADatabaseError(f"there is no database at {path}")
    connection = files.connect_sqlite(path, read_only=True, immutable=unreadable_in_wal(path))
    with contextlib.closing(connection):
        connection.execute("PRAGMA query_only = ON")
        connection.set_progress_handler(lambda: 0, _INTERRUPT_EVERY)  # lets Ctrl-C through
        guard = _FileGuard()
        connection.set_authorizer(guard)
        try:
            cursor = connection.execute(sql, params)
            return _collect([d[0] for d in cursor.description or ()], cursor.fetchmany, max_rows)
        except sqlite3.ProgrammingError as error:  # several statements, a missing parameter
            raise InvalidInputError(f"the query cannot run: {error}") from None
        except sqlite3.Error as error:
            if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_INTERRUPT:
                # Ctrl-C, raised in the progress handler, comes back as SQLite's "interrupted"
                raise KeyboardInterrupt from None
            if guard.denied:
                raise InvalidInputError(_OTHER_FILES_REFUSED) from None
            refused = _refused(error)
            if refused is not None:
                raise refused from None
            raise InvalidInputError(f"the database refused the query: {error}") from None


def _on_server(url: URL, sql: str, params: dict[str, Any], max_rows: int | None) -> QueryResult:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with mapped_errors(), engine.connect() as conn:
            conn = conn.execution_options(postgresql_readonly=True)
            with conn.begin() as transaction:
                _refuse_server_reach(conn)
                try:
                    return _one_statement(conn, sql, params, max_rows)
                except sa.exc.DBAPIError as error:
                    refused = _refused(error)
                    if refused is not None:
                        raise refused from None
                    sqlstate = getattr(error.orig, "sqlstate", None) or ""
                    if sqlstate.startswith(("42", "22")) or "multiple commands" in str(error):
                        raise InvalidInputError(
                            f"the database refused the query: {error.orig}"
                        ) from None
                    raise
                finally:
                    transaction.rollback()
    finally:
        engine.dispose()


def _refuse_server_reach(conn: sa.Connection) -> None:
    """Refuse a role whose SQL a read-only transaction does not confine (see the module)."""
    role, reaches = conn.execute(_SERVER_REACH).one()
    if reaches:
        raise StoreConfigError(
            f"queries are refused to the PostgreSQL role {echoed(role)}: it may write or read the "
            "server's files or run programs there (a superuser, or a member of "
            "pg_write_server_files, pg_read_server_files or pg_execute_server_program), which "
            "a read-only transaction does not stop; connect as a role that may only read "
            "(GRANT SELECT ON ALL TABLES IN SCHEMA public TO it)"
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
