"""v1: the base tables, the four plain indexes and the full-text objects.

Revision ID: v1_base
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from hermes_store.schema import steps as schema_ops

revision: str = "v1_base"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REAL: sa.types.TypeEngine[float] = sa.REAL().with_variant(
    postgresql.DOUBLE_PRECISION(), "postgresql"
)
MESSAGE_ID = sa.Integer().with_variant(sa.BigInteger(), "postgresql")
ZERO = sa.text("0")

# SQLite: the original store's external-content FTS5 table and the three triggers that keep it
# in step with messages (the original store looks for these exact names).
SQLITE_FTS_TABLE = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(\n"
    "    content,\n    content=messages,\n    content_rowid=id\n)"
)
SQLITE_FTS_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END""",
    """CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content)
        VALUES('delete', old.id, old.content);
END""",
    """CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content)
        VALUES('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END""",
)
# PostgreSQL: a stored 'simple' tsvector of the first 200,000 characters (a tsvector cannot
# exceed 1 MB) with a GIN index, and an optional pg_trgm index for substring (CJK) search.
PG_TSVECTOR_COLUMN = (
    "ALTER TABLE messages ADD COLUMN IF NOT EXISTS content_tsv tsvector GENERATED ALWAYS AS "
    "(to_tsvector('simple'::regconfig, left(COALESCE(content, ''), 200000))) STORED"
)
PG_TSVECTOR_INDEX = (
    "CREATE INDEX IF NOT EXISTS ix_messages_content_fts ON messages USING gin (content_tsv)"
)
PG_TRIGRAM_INDEX = (
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    "CREATE INDEX IF NOT EXISTS ix_messages_content_trgm ON messages "
    "USING gin (content gin_trgm_ops)",
)


def upgrade() -> None:
    op.create_table("schema_version", sa.Column("version", sa.Integer(), nullable=False))
    op.create_table(
        "sessions",
        sa.Column("id", sa.Text(), primary_key=True, nullable=True),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("user_id", sa.Text()),
        sa.Column("model", sa.Text()),
        sa.Column("model_config", sa.Text()),
        sa.Column("system_prompt", sa.Text()),
        sa.Column("parent_session_id", sa.Text(), sa.ForeignKey("sessions.id")),
        sa.Column("started_at", REAL, nullable=False),
        sa.Column("ended_at", REAL),
        sa.Column("end_reason", sa.Text()),
        sa.Column("message_count", sa.Integer(), server_default=ZERO),
        sa.Column("tool_call_count", sa.Integer(), server_default=ZERO),
        sa.Column("input_tokens", sa.Integer(), server_default=ZERO),
        sa.Column("output_tokens", sa.Integer(), server_default=ZERO),
    )
    op.create_table(
        "messages",
        sa.Column("id", MESSAGE_ID, primary_key=True, nullable=True),
        sa.Column("session_id", sa.Text(), sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("content", sa.Text()),
        sa.Column("tool_call_id", sa.Text()),
        sa.Column("tool_calls", sa.Text()),
        sa.Column("tool_name", sa.Text()),
        sa.Column("timestamp", REAL, nullable=False),
        sa.Column("token_count", sa.Integer()),
        sqlite_autoincrement=True,
    )
    op.create_index("idx_sessions_source", "sessions", ["source"])
    op.create_index("idx_sessions_parent", "sessions", ["parent_session_id"])
    op.create_index("idx_sessions_started", "sessions", [sa.desc(sa.column("started_at"))])
    op.create_index("idx_messages_session", "messages", ["session_id", "timestamp"])
    if schema_ops.dialect_name() == "sqlite":
        for statement in (SQLITE_FTS_TABLE, *SQLITE_FTS_TRIGGERS):
            op.execute(sa.text(statement))
    else:
        op.execute(sa.text(PG_TSVECTOR_COLUMN))
        op.execute(sa.text(PG_TSVECTOR_INDEX))
        schema_ops.create_optional("the pg_trgm substring index", *PG_TRIGRAM_INDEX)
    schema_ops.set_schema_version(1)


def downgrade() -> None:
    if schema_ops.dialect_name() == "sqlite":
        for name in ("messages_fts_insert", "messages_fts_delete", "messages_fts_update"):
            op.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}"))
        op.execute(sa.text("DROP TABLE IF EXISTS messages_fts"))
    else:
        op.execute(sa.text("DROP INDEX IF EXISTS ix_messages_content_trgm"))
        op.execute(sa.text("DROP INDEX IF EXISTS ix_messages_content_fts"))
        op.execute(sa.text("ALTER TABLE messages DROP COLUMN IF EXISTS content_tsv"))
    op.drop_table("messages")
    op.drop_table("sessions")
    op.drop_table("schema_version")
