"""SQLite's writes: the hot ones as statements compiled once per process, run on the unit's own
DB-API cursor (``uow.run(..., driver_only=True)``: the unit is begun and committed on the
driver too, and joins the file's group commit), so a write pays for its SQL, not for
SQLAlchemy's per-execution work. The statements are the Core ones of
:mod:`hermes_store.repo.statements`, compiled for SQLite: one source of truth."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import Insert

from hermes_store.engine import fastpath
from hermes_store.repo.statements import (
    BUMP_COUNTERS,
    KEY_LOOKUP,
    Statements,
    WriteKey,
    bump_params,
    known_message,
    missing_session,
    token_statement,
)
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.tables import write_keys_table as K
from hermes_store.uow.unit import UnitOfWork


@functools.cache
def driver_sql(name: str) -> tuple[str, tuple[str, ...]]:
    """SQL text and positional parameter names of a hot write (``bump``, ``insert``,
    ``tokens``, ``tokens_absolute``, ``key_lookup``, ``key_insert``), compiled for SQLite once
    per process."""
    statements: dict[str, tuple[sa.ClauseElement, list[str] | None]] = {
        "bump": (BUMP_COUNTERS, None),
        "insert": (M.insert(), [c.name for c in M.columns if c.name != "id"]),
        "tokens": (token_statement(False), None),
        "tokens_absolute": (token_statement(True), None),
        "key_lookup": (KEY_LOOKUP, None),
        "key_insert": (K.insert(), [c.name for c in K.columns]),
    }
    statement, column_keys = statements[name]
    compiled = statement.compile(dialect=sqlite.dialect(), column_keys=column_keys)
    assert isinstance(compiled, SQLCompiler)
    return compiled.string, tuple(compiled.positiontup or ())


def _bound(name: str, params: Mapping[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """A hot write's SQL and its values in positional order."""
    sql, keys = driver_sql(name)
    return sql, tuple(params[key] for key in keys)


def _bump(conn: Connection, session_id: str, bump: tuple[str, tuple[Any, ...]]) -> None:
    """Count messages and tool calls on the session (``bump``: :func:`_bound`'s); a missing
    session raises."""
    if fastpath.driver_execute(conn, *bump).rowcount != 1:
        raise missing_session(session_id)


class SqliteStatements(Statements):
    holds_nul = True
    insert_session: ClassVar[Insert] = sqlite.insert(S).on_conflict_do_nothing(
        index_elements=["id"]
    )

    def update_token_counts(
        self,
        uow: UnitOfWork,
        session_id: str,
        params: dict[str, Any],
        absolute: bool,
        key: WriteKey | None = None,
    ) -> None:
        sql, values = _bound("tokens_absolute" if absolute else "tokens", params)
        if key is None or absolute:
            uow.run(
                lambda conn: int(fastpath.driver_execute(conn, sql, values).rowcount),
                driver_only=True,
            )
            return
        lookup = _bound("key_lookup", {"key": key.key})
        record = _bound("key_insert", key.row(None))

        def unit(conn: Connection) -> None:
            # One write unit: no other writer runs between the look-up and the insert.
            if fastpath.driver_execute(conn, *lookup).fetchone() is not None:
                return
            if fastpath.driver_execute(conn, sql, values).rowcount:
                fastpath.driver_execute(conn, *record)

        uow.run(unit, driver_only=True)

    def append_message(
        self,
        uow: UnitOfWork,
        values: dict[str, Any],
        tool_calls: int,
        key: WriteKey | None = None,
    ) -> int:
        session_id = values["session_id"]
        bump = _bound("bump", bump_params(session_id, 1, tool_calls))
        sql, row = _bound("insert", values)
        if key is None:

            def unit(conn: Connection) -> int:
                _bump(conn, session_id, bump)
                return int(fastpath.driver_execute(conn, sql, row).lastrowid)

            return uow.run(unit, driver_only=True)
        lookup = _bound("key_lookup", {"key": key.key})
        record_sql, record_keys = driver_sql("key_insert")

        def keyed(conn: Connection) -> int:
            # One write unit: no other writer runs between the look-up and the insert.
            known = fastpath.driver_execute(conn, *lookup).fetchone()
            if known is not None:
                return known_message(key, known[0], known[1])
            _bump(conn, session_id, bump)
            message_id = int(fastpath.driver_execute(conn, sql, row).lastrowid)
            record = key.row(message_id)
            fastpath.driver_execute(conn, record_sql, tuple(record[k] for k in record_keys))
            return message_id

        return uow.run(keyed, driver_only=True)

    def append_messages(
        self, uow: UnitOfWork, session_id: str, rows: list[dict[str, Any]], tool_calls: int
    ) -> list[int]:
        sql, keys = driver_sql("insert")
        insert_rows = [tuple(row[key] for key in keys) for row in rows]
        bump = _bound("bump", bump_params(session_id, len(rows), tool_calls))

        def unit(conn: Connection) -> list[int]:
            _bump(conn, session_id, bump)
            cursor = fastpath.driver_execute(conn, sql, insert_rows, many=True)
            last = int(cursor.execute("SELECT last_insert_rowid()").fetchone()[0])
            # One transaction holding the write lock: AUTOINCREMENT ids are consecutive.
            return list(range(last - len(insert_rows) + 1, last + 1))

        return uow.run(unit, driver_only=True)
