"""Declarative ORM models of the v6 schema: the query surface for applications and notebooks.

The classes map onto the Core tables of :mod:`hermes_store.tables` (one metadata, one
definition of every column, type and index); the store itself runs Core statements on those
tables and never imports this module, so opening a database does not load the ORM. The
annotations below type the mapped columns for applications.
"""

from __future__ import annotations

from sqlalchemy.orm import DeclarativeBase, Mapped, relationship

from hermes_store.tables import (
    NAMING_CONVENTION,
    ZERO,
    Counter,
    MessageId,
    Real,
    messages_table,
    metadata,
    schema_version_table,
    sessions_table,
)

__all__ = [
    "NAMING_CONVENTION",
    "ZERO",
    "Base",
    "ChatSession",
    "Counter",
    "Message",
    "MessageId",
    "Real",
    "SchemaVersion",
    "messages_table",
    "sessions_table",
]


class Base(DeclarativeBase):
    """The one declarative base; its metadata (:data:`hermes_store.tables.metadata`) is
    Alembic's autogenerate target."""

    metadata = metadata


class SchemaVersion(Base):
    """The original store's version marker (one row), kept in step so that store can still open
    the file."""

    __table__ = schema_version_table

    version: Mapped[int]

    # The original store's table has no primary key; the mapper identifies the row by its value.
    __mapper_args__ = {"primary_key": [schema_version_table.c.version]}  # noqa: RUF012


class ChatSession(Base):
    """One conversation (a row of ``sessions``); named so nobody confuses it with an ORM Session."""

    __table__ = sessions_table

    id: Mapped[str]
    source: Mapped[str]
    user_id: Mapped[str | None]
    model: Mapped[str | None]
    model_config: Mapped[str | None]
    system_prompt: Mapped[str | None]
    parent_session_id: Mapped[str | None]
    started_at: Mapped[float]
    ended_at: Mapped[float | None]
    end_reason: Mapped[str | None]
    message_count: Mapped[int | None]
    tool_call_count: Mapped[int | None]
    input_tokens: Mapped[int | None]
    output_tokens: Mapped[int | None]
    cache_read_tokens: Mapped[int | None]
    cache_write_tokens: Mapped[int | None]
    reasoning_tokens: Mapped[int | None]
    billing_provider: Mapped[str | None]
    billing_base_url: Mapped[str | None]
    billing_mode: Mapped[str | None]
    estimated_cost_usd: Mapped[float | None]
    actual_cost_usd: Mapped[float | None]
    cost_status: Mapped[str | None]
    cost_source: Mapped[str | None]
    pricing_version: Mapped[str | None]
    title: Mapped[str | None]

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

    def __repr__(self) -> str:
        return f"ChatSession(id={self.id!r}, source={self.source!r}, title={self.title!r})"


class Message(Base):
    """One message of a conversation (a row of ``messages``)."""

    __table__ = messages_table

    id: Mapped[int]
    session_id: Mapped[str]
    role: Mapped[str]
    content: Mapped[str | None]
    tool_call_id: Mapped[str | None]
    tool_calls: Mapped[str | None]
    tool_name: Mapped[str | None]
    timestamp: Mapped[float]
    token_count: Mapped[int | None]
    finish_reason: Mapped[str | None]
    reasoning: Mapped[str | None]
    reasoning_details: Mapped[str | None]
    codex_reasoning_items: Mapped[str | None]

    session: Mapped[ChatSession] = relationship(back_populates="messages")

    def __repr__(self) -> str:
        return f"Message(id={self.id!r}, session_id={self.session_id!r}, role={self.role!r})"
