"""Declarative ORM models of the v6 schema: the query surface for applications and notebooks.

The column list, types, NOT NULL flags and defaults are the original store's v6 schema:
``REAL`` timestamps and costs on SQLite (``double precision`` on PostgreSQL) and JSON carried as
``TEXT`` exactly as the original store writes it, so a file stays readable by that store.
The FTS objects are raw DDL in the migrations (see :mod:`hermes_store.schema.ddl`), not models.
"""

from __future__ import annotations

from typing import cast

from sqlalchemy import (
    REAL,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Float epoch seconds and dollar amounts: REAL on SQLite, double precision on PostgreSQL.
Real: Float[float] = REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")
#: Message ids: SQLite's rowid alias, a 64-bit identity on PostgreSQL.
MessageId: Integer = Integer().with_variant(BigInteger(), "postgresql")
#: Counters the store adds to: 64-bit on both backends (SQLite's INTEGER is 64-bit already).
Counter: Integer = Integer().with_variant(BigInteger(), "postgresql")

ZERO = text("0")


class Base(DeclarativeBase):
    """The one declarative base; its metadata is Alembic's autogenerate target."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class SchemaVersion(Base):
    """The original store's version marker (one row), kept in step so that store can still open
    the file."""

    __tablename__ = "schema_version"

    version: Mapped[int] = mapped_column(Integer, nullable=False)

    # The original store's table has no primary key; the mapper identifies the row by its value.
    __mapper_args__ = {"primary_key": [version]}  # noqa: RUF012


class ChatSession(Base):
    """One conversation (a row of ``sessions``); named so nobody confuses it with an ORM Session."""

    __tablename__ = "sessions"

    # nullable=True mirrors the original store's `id TEXT PRIMARY KEY` (SQLite lets such a key
    # be NULL).
    id: Mapped[str] = mapped_column(Text, primary_key=True, nullable=True)
    source: Mapped[str] = mapped_column(Text, nullable=False)
    user_id: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(Text)
    model_config: Mapped[str | None] = mapped_column(Text)
    system_prompt: Mapped[str | None] = mapped_column(Text)
    parent_session_id: Mapped[str | None] = mapped_column(Text, ForeignKey("sessions.id"))
    started_at: Mapped[float] = mapped_column(Real, nullable=False)
    ended_at: Mapped[float | None] = mapped_column(Real)
    end_reason: Mapped[str | None] = mapped_column(Text)
    message_count: Mapped[int | None] = mapped_column(Counter, server_default=ZERO)
    tool_call_count: Mapped[int | None] = mapped_column(Counter, server_default=ZERO)
    input_tokens: Mapped[int | None] = mapped_column(Counter, server_default=ZERO)
    output_tokens: Mapped[int | None] = mapped_column(Counter, server_default=ZERO)
    cache_read_tokens: Mapped[int | None] = mapped_column(Counter, server_default=ZERO)
    cache_write_tokens: Mapped[int | None] = mapped_column(Counter, server_default=ZERO)
    reasoning_tokens: Mapped[int | None] = mapped_column(Counter, server_default=ZERO)
    billing_provider: Mapped[str | None] = mapped_column(Text)
    billing_base_url: Mapped[str | None] = mapped_column(Text)
    billing_mode: Mapped[str | None] = mapped_column(Text)
    estimated_cost_usd: Mapped[float | None] = mapped_column(Real)
    actual_cost_usd: Mapped[float | None] = mapped_column(Real)
    cost_status: Mapped[str | None] = mapped_column(Text)
    cost_source: Mapped[str | None] = mapped_column(Text)
    pricing_version: Mapped[str | None] = mapped_column(Text)
    title: Mapped[str | None] = mapped_column(Text)

    messages: Mapped[list[Message]] = relationship(
        back_populates="session",
        order_by="(Message.timestamp, Message.id)",
        passive_deletes="all",
    )
    parent: Mapped[ChatSession | None] = relationship(
        back_populates="children", remote_side="ChatSession.id"
    )
    children: Mapped[list[ChatSession]] = relationship(
        back_populates="parent", order_by="ChatSession.started_at", passive_deletes="all"
    )

    __table_args__ = (
        Index("idx_sessions_source", "source"),
        Index("idx_sessions_parent", "parent_session_id"),
        Index(
            "idx_sessions_title_unique",
            "title",
            unique=True,
            sqlite_where=text("title IS NOT NULL"),
            postgresql_where=text("title IS NOT NULL"),
        ),
    )

    def __repr__(self) -> str:
        return f"ChatSession(id={self.id!r}, source={self.source!r}, title={self.title!r})"


class Message(Base):
    """One message of a conversation (a row of ``messages``)."""

    __tablename__ = "messages"
    __table_args__ = (
        Index("idx_messages_session", "session_id", "timestamp"),
        {"sqlite_autoincrement": True},
    )

    # The original store's DDL leaves NOT NULL off this rowid alias (SQLite never stores NULL in
    # it); the model says NOT NULL so bulk inserts can use it as their ordering sentinel.
    id: Mapped[int] = mapped_column(MessageId, primary_key=True)
    session_id: Mapped[str] = mapped_column(Text, ForeignKey("sessions.id"), nullable=False)
    role: Mapped[str] = mapped_column(Text, nullable=False)
    content: Mapped[str | None] = mapped_column(Text)
    tool_call_id: Mapped[str | None] = mapped_column(Text)
    tool_calls: Mapped[str | None] = mapped_column(Text)
    tool_name: Mapped[str | None] = mapped_column(Text)
    timestamp: Mapped[float] = mapped_column(Real, nullable=False)
    token_count: Mapped[int | None] = mapped_column(Counter)
    finish_reason: Mapped[str | None] = mapped_column(Text)
    reasoning: Mapped[str | None] = mapped_column(Text)
    reasoning_details: Mapped[str | None] = mapped_column(Text)
    codex_reasoning_items: Mapped[str | None] = mapped_column(Text)

    session: Mapped[ChatSession] = relationship(back_populates="messages")

    def __repr__(self) -> str:
        return f"Message(id={self.id!r}, session_id={self.session_id!r}, role={self.role!r})"


# Declared here because the column expression (DESC) needs the mapped column.
Index("idx_sessions_started", ChatSession.started_at.desc())

sessions_table = cast(Table, ChatSession.__table__)
messages_table = cast(Table, Message.__table__)
