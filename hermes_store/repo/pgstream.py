"""Export and import at streaming speed on PostgreSQL (psycopg 3).

The generic paths cost a round trip per session (export) and per row batch (import): ~5x the
SQLite floor at 100k messages. Here an export is two server-side cursors read in one
REPEATABLE READ, read-only snapshot (sessions newest first, and every message in that same
session order), merged as they stream; an import writes each batch's rows with
``COPY ... FROM STDIN`` inside the batch's own transaction. Both work behind PgBouncer in
transaction pooling mode: cursors and COPY live inside one transaction. The records are those
of ``SessionDB.iter_export``, key for key and value for value.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine

from hermes_store.errors import mapped_driver_errors, mapped_errors
from hermes_store.repo.messages import decode_tool_calls
from hermes_store.rows import ExportRecord
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S

#: Rows fetched per round trip from each server-side cursor.
FETCH_ROWS = 2_000


def supported(conn_or_dialect: Connection | sa.Dialect) -> bool:
    """Whether the streaming paths apply: PostgreSQL through psycopg 3's blocking API (an
    asyncio engine takes the paged path)."""
    dialect = (
        conn_or_dialect.dialect if isinstance(conn_or_dialect, Connection) else conn_or_dialect
    )
    return dialect.name == "postgresql" and dialect.driver == "psycopg" and not dialect.is_async


def _export_statements(dialect: sa.Dialect, by_source: bool) -> tuple[str, str]:
    """Sessions newest first, and their messages in the same session order, each session's by
    ``(timestamp, id)`` as ``get_messages`` returns them."""
    order = (S.c.started_at.desc(), S.c.id.desc())
    sessions = select(*S.c).order_by(*order)
    messages = (
        select(*M.c)
        .select_from(M.join(S, S.c.id == M.c.session_id))
        .order_by(*order, M.c.timestamp, M.c.id)
    )
    if by_source:
        sessions = sessions.where(S.c.source == sa.bindparam("source"))
        messages = messages.where(S.c.source == sa.bindparam("source"))
    return str(sessions.compile(dialect=dialect)), str(messages.compile(dialect=dialect))


def iter_export(engine: Engine, source: str | None = None) -> Iterator[ExportRecord]:
    """Every session (or ``source``'s), newest first, each with its messages, from one
    snapshot. One connection of ``engine`` is held until the generator finishes or is
    closed."""
    params = {"source": source} if source is not None else {}
    session_keys = [c.name for c in S.c]
    message_keys = [c.name for c in M.c]
    owner = message_keys.index("session_id")
    with mapped_errors(), engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        raw: Any = conn.connection.driver_connection
        session_sql, message_sql = _export_statements(conn.dialect, source is not None)
        with mapped_driver_errors(conn.dialect), conn.begin():
            sessions = raw.cursor(name="hermes_export_sessions", binary=True)
            messages = raw.cursor(name="hermes_export_messages", binary=True)
            sessions.itersize = messages.itersize = FETCH_ROWS
            try:
                sessions.execute(session_sql, params)
                messages.execute(message_sql, params)
                pending = iter(messages)
                upcoming = next(pending, None)
                for session_row in sessions:
                    session = dict(zip(session_keys, session_row, strict=True))
                    rows = []
                    while upcoming is not None and upcoming[owner] == session["id"]:
                        rows.append(dict(zip(message_keys, upcoming, strict=True)))
                        upcoming = next(pending, None)
                    session["messages"] = decode_tool_calls(rows)
                    yield cast(ExportRecord, session)
            finally:
                messages.close()
                sessions.close()


def copy_rows(conn: Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``rows`` (dicts with the same keys) with one ``COPY ... FROM STDIN`` on the unit's
    own connection and transaction. A column left out takes its default (the id sequence)."""
    if not rows:
        return
    columns = [c.name for c in table.c if c.name in rows[0]]
    quote = conn.dialect.identifier_preparer.quote
    target = f"{quote(table.name)} ({', '.join(quote(name) for name in columns)})"
    raw: Any = conn.connection.driver_connection
    with (
        mapped_driver_errors(conn.dialect),
        raw.cursor() as cursor,
        cursor.copy(f"COPY {target} FROM STDIN") as copy,
    ):
        for row in rows:
            copy.write_row([row[name] for name in columns])
