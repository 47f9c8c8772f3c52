"""The v6 tables as SQLAlchemy Core ``Table`` objects: what the store's own statements use.

The column list, types, NOT NULL flags and defaults are the original store's v6 schema:
``REAL`` timestamps and costs on SQLite (``double precision`` on PostgreSQL) and JSON carried as
``TEXT`` exactly as the original store writes it, so a file stays readable by that store.
The FTS objects are raw DDL in the migrations (see :mod:`hermes_store.schema.ddl`), not here.

Core only: the store never loads the ORM (``sqlalchemy.orm`` costs a process about as much as
the rest of its open). :mod:`hermes_store.models` maps its classes onto these tables for
applications and notebooks.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    DOUBLE_PRECISION,
    REAL,
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    text,
    util,
)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Float epoch seconds and dollar amounts: REAL on SQLite, double precision on PostgreSQL.
Real: Float[float] = REAL().with_variant(DOUBLE_PRECISION(), "postgresql")
#: Message ids: SQLite's rowid alias, a 64-bit identity on PostgreSQL.
MessageId: Integer = Integer().with_variant(BigInteger(), "postgresql")
#: Counters the store adds to: 64-bit on both backends (SQLite's INTEGER is 64-bit already).
Counter: Integer = Integer().with_variant(BigInteger(), "postgresql")

ZERO = text("0")


class _PartialIndex(Index):
    """A partial index, ``WHERE`` on both backends, whose PostgreSQL option is attached when
    PostgreSQL's options are first read (a server's DDL, Alembic comparing a server): named
    outright (``postgresql_where=``), it makes SQLAlchemy import the PostgreSQL dialect to
    validate it, 16-29 ms of every SQLite process's start."""

    def __init__(self, name: str, *columns: str, where: str, **kw: Any) -> None:
        self._where = where
        super().__init__(name, *columns, sqlite_where=text(where), **kw)

    @util.memoized_property
    def dialect_options(self) -> util.PopulateDict[str, Any]:
        def options(dialect_name: str) -> Any:
            found = self._kw_reg_for_dialect_cls(dialect_name)
            if dialect_name == "postgresql":
                found["where"] = text(self._where)
            return found

        return util.PopulateDict(options)


#: The one metadata: Alembic's autogenerate target (the ORM models share it).
metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: The original store's version marker (one row), kept in step so that store can still open
#: the file. It has no primary key.
schema_version_table = Table(
    "schema_version",
    metadata,
    Column("version", Integer, nullable=False),
)

sessions_table = Table(
    "sessions",
    metadata,
    # nullable=True mirrors the original store's `id TEXT PRIMARY KEY` (SQLite lets such a key
    # be NULL).
    Column("id", Text, primary_key=True, nullable=True),
    Column("source", Text, nullable=False),
    Column("user_id", Text),
    Column("model", Text),
    Column("model_config", Text),
    Column("system_prompt", Text),
    Column("parent_session_id", Text, ForeignKey("sessions.id")),
    Column("started_at", Real, nullable=False),
    Column("ended_at", Real),
    Column("end_reason", Text),
    Column("message_count", Counter, server_default=ZERO),
    Column("tool_call_count", Counter, server_default=ZERO),
    Column("input_tokens", Counter, server_default=ZERO),
    Column("output_tokens", Counter, server_default=ZERO),
    Column("cache_read_tokens", Counter, server_default=ZERO),
    Column("cache_write_tokens", Counter, server_default=ZERO),
    Column("reasoning_tokens", Counter, server_default=ZERO),
    Column("billing_provider", Text),
    Column("billing_base_url", Text),
    Column("billing_mode", Text),
    Column("estimated_cost_usd", Real),
    Column("actual_cost_usd", Real),
    Column("cost_status", Text),
    Column("cost_source", Text),
    Column("pricing_version", Text),
    Column("title", Text),
    Index("idx_sessions_source", "source"),
    Index("idx_sessions_parent", "parent_session_id"),
    _PartialIndex("idx_sessions_title_unique", "title", unique=True, where="title IS NOT NULL"),
)
Index("idx_sessions_started", sessions_table.c.started_at.desc())

messages_table = Table(
    "messages",
    metadata,
    # The original store's DDL leaves NOT NULL off this rowid alias (SQLite never stores NULL in
    # it); the table says NOT NULL so bulk inserts can use it as their ordering sentinel.
    Column("id", MessageId, primary_key=True),
    Column("session_id", Text, ForeignKey("sessions.id"), nullable=False),
    Column("role", Text, nullable=False),
    Column("content", Text),
    Column("tool_call_id", Text),
    Column("tool_calls", Text),
    Column("tool_name", Text),
    Column("timestamp", Real, nullable=False),
    Column("token_count", Counter),
    Column("finish_reason", Text),
    Column("reasoning", Text),
    Column("reasoning_details", Text),
    Column("codex_reasoning_items", Text),
    Index("idx_messages_session", "session_id", "timestamp"),
    sqlite_autoincrement=True,
)

#: Idempotency keys (revision h9): one row per keyed write (``append_message``, an incrementing
#: ``update_token_counts``), written in the write's own transaction, so a re-sent call finds it
#: and returns ``message_id`` instead of writing again. Not one of the original store's tables
#: (no foreign key: that store deletes sessions without knowing it).
write_keys_table = Table(
    "write_keys",
    metadata,
    Column("key", Text, primary_key=True),
    Column("session_id", Text, nullable=False),
    Column("message_id", MessageId),
    Column("created_at", Real, nullable=False),
    Index("ix_write_keys_session_id", "session_id"),
    Index("ix_write_keys_created_at", "created_at"),
)
