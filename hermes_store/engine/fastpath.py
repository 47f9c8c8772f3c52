"""Driver-level reads for SQLite hot paths: a Core statement compiled once, run on the unit's own
DB-API connection (inside its transaction), rows returned as plain dicts.

For a query that returns a few rows, or very many narrow ones, SQLAlchemy's per-execution work
(cache keys, expanding parameters, result processing, Row objects) costs more than the SQL. These
helpers keep the Core statement as the single source of truth and skip only that work; errors
are wrapped exactly as SQLAlchemy wraps them, so callers' ``except`` clauses and the package's
error mapping see the same exceptions. Other backends simply go through the Connection.

Only statements built once (module-level or cached) belong here: the compiled form is cached
by statement identity. Column types must not need result processing (true of this schema's
TEXT/INTEGER/REAL columns on SQLite).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.sql import ClauseElement, Executable
from sqlalchemy.sql.compiler import Compiled, SQLCompiler

from hermes_store.errors import wrap_driver_error


@dataclass(frozen=True)
class _Compiled:
    sql: str
    #: Per positional slot: (parameter name, index into an expanded list or None).
    slots: tuple[tuple[str, int | None], ...]
    defaults: dict[str, Any]


_cache: dict[tuple[int, str, tuple[tuple[str, int], ...]], tuple[ClauseElement, _Compiled]] = {}
_cache_lock = threading.Lock()


def _sql_compiler(compiled: Compiled) -> SQLCompiler:
    assert isinstance(compiled, SQLCompiler)
    return compiled


def _bucket(size: int) -> int:
    """Expanded lists are padded to a power of two (few compiled variants) by repeating their
    last element: a repeat changes neither ``IN`` nor ``NOT IN``, where a NULL pad would make
    ``NOT IN`` never true."""
    bucket = 1
    while bucket < size:
        bucket *= 2
    return bucket


def _compile(
    statement: ClauseElement, dialect: Dialect, expand: tuple[tuple[str, int], ...]
) -> _Compiled:
    key = (id(statement), dialect.name, expand)
    hit = _cache.get(key)
    if hit is not None and hit[0] is statement:
        return hit[1]
    target = statement
    if expand:
        # Rendering the expanded lists needs a value for every parameter: placeholders here
        # (the real values are bound per execution, by position).
        sizes = dict(expand)
        binds = _sql_compiler(statement.compile(dialect=dialect)).binds
        target = statement.params(
            {
                name: [None] * sizes[name] if name in sizes else None
                for name, bind in binds.items()
                if name in sizes or bind.required
            }
        )
    compiled = _sql_compiler(
        target.compile(dialect=dialect, compile_kwargs={"render_postcompile": True})
    )
    expanded = {f"{name}_{i + 1}": (name, i) for name, size in expand for i in range(size)}
    slots = tuple(expanded.get(name, (name, None)) for name in compiled.positiontup or ())
    defaults = {
        name: bind.effective_value for name, bind in compiled.binds.items() if name not in expanded
    }
    result = _Compiled(compiled.string, slots, defaults)
    with _cache_lock:
        _cache[key] = (statement, result)  # the statement is kept, so its id stays unique
    return result


@dataclass
class Plan:
    """A statement without list parameters, ready for the driver: its SQL, the names of its
    positional parameters, their defaults, and (once seen) its result column names."""

    sql: str
    names: tuple[str, ...]
    defaults: dict[str, Any]
    columns: list[str] | None = None

    def bind(self, params: Mapping[str, Any] | None) -> tuple[Any, ...]:
        names = self.names
        if not names:
            return ()
        if len(names) == 1 and params is not None and names[0] in params:
            return (params[names[0]],)
        if params is None:
            params = {}
        defaults = self.defaults
        return tuple([params[n] if n in params else defaults.get(n) for n in self.names])


_plans: dict[int, tuple[ClauseElement, Plan]] = {}


def plan(statement: ClauseElement, dialect: Dialect) -> Plan:
    """The SQLite :class:`Plan` of a prebuilt statement (cached by statement identity)."""
    hit = _plans.get(id(statement))
    if hit is not None and hit[0] is statement:
        return hit[1]
    compiled = _compile(statement, dialect, ())
    found = Plan(compiled.sql, tuple(name for name, _ in compiled.slots), compiled.defaults)
    with _cache_lock:
        _plans[id(statement)] = (statement, found)
    return found


def rows(
    conn: Connection,
    statement: ClauseElement,
    params: Mapping[str, Any] | None = None,
    *,
    expanding: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """All rows of ``statement`` as dicts keyed by column label.

    ``expanding`` names list parameters (``bindparam(..., expanding=True)``); on SQLite their
    lists are padded up to a power of two by repeating their last element, which neither
    ``IN (...)`` nor ``NOT IN (...)`` notices. An empty list has nothing to repeat (and
    ``NOT IN ()`` is true for every row): SQLAlchemy renders that case itself.
    """
    if conn.dialect.name != "sqlite" or any(not (params or {})[name] for name in expanding):
        return [
            dict(row._mapping)
            for row in conn.execute(cast(Executable, statement), dict(params or {}))
        ]
    return driver_rows(
        conn.connection.driver_connection,
        conn.dialect,
        statement,
        params,
        expanding=expanding,
        events=conn,
    )


def driver_rows(
    driver: Any,
    dialect: Dialect,
    statement: ClauseElement,
    params: Mapping[str, Any] | None = None,
    *,
    expanding: Sequence[str] = (),
    events: Connection | None = None,
) -> list[dict[str, Any]]:
    """:func:`rows` on a SQLite DB-API connection (a unit's, or a thread's held reader);
    ``events``, when given, is the Connection whose cursor events fire. Expanded lists must not
    be empty (:func:`rows` hands those to SQLAlchemy)."""
    params = params or {}
    if any(not params[name] for name in expanding):
        raise ValueError("driver_rows cannot expand an empty list: use rows()")
    expand = tuple((name, _bucket(len(params[name]))) for name in expanding) if expanding else ()
    compiled = _compile(statement, dialect, expand)
    bound = []
    for name, index in compiled.slots:
        if index is None:
            bound.append(params[name] if name in params else compiled.defaults.get(name))
        else:
            given = params[name]
            bound.append(given[index] if index < len(given) else given[-1])
    values = tuple(bound)  # a tuple, as SQLAlchemy hands positional parameters to events
    dbapi_error: type[Exception] = dialect.loaded_dbapi.Error
    cursor = driver.cursor()
    dispatch = events.dispatch if events is not None else None
    try:
        if dispatch is not None and dispatch.before_cursor_execute:
            dispatch.before_cursor_execute(events, cursor, compiled.sql, values, None, False)
        cursor.execute(compiled.sql, values)
        names = [column[0] for column in cursor.description]
        found = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        if dispatch is not None and dispatch.after_cursor_execute:
            dispatch.after_cursor_execute(events, cursor, compiled.sql, values, None, False)
        return found
    except dbapi_error as orig:
        raise sa.exc.DBAPIError.instance(
            compiled.sql, values, orig, dbapi_error, dialect=dialect
        ) from orig
    finally:
        cursor.close()


def driver_execute(conn: Connection, sql: str, values: Any, *, many: bool = False) -> Any:
    """Run SQL compiled once (positional parameters) on the unit's own DB-API cursor; driver
    errors are wrapped as SQLAlchemy wraps them, so retries and error mapping see them."""
    dbapi_error: type[Exception] = conn.dialect.loaded_dbapi.Error
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        if many:
            cursor.executemany(sql, values)
        else:
            cursor.execute(sql, values)
    except dbapi_error as orig:
        raise sa.exc.DBAPIError.instance(
            sql, None, orig, dbapi_error, dialect=conn.dialect
        ) from orig
    return cursor


def driver_errors(conn: Connection) -> type[Exception]:
    """The base class of the errors the unit's DB-API connection raises: for units that run
    their statements on the driver in one ``try`` (the SQLite hot writes), as
    ``except fastpath.driver_errors(conn)``, which Python evaluates only when something was
    raised."""
    dbapi_error: type[Exception] = conn.dialect.loaded_dbapi.Error
    return dbapi_error


def driver_error(conn: Connection, sql: str, error: Exception) -> sa.exc.StatementError:
    """``error`` (of :func:`driver_errors`), raised while running ``sql``, wrapped as
    :func:`driver_execute` wraps it, so retries and the error mapping see it."""
    return wrap_driver_error(error, conn.dialect, sql)
