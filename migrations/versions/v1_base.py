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

from hermes_store import schema_ops

revision: str = "v1_base"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REAL = sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")
MESSAGE_ID = sa.Integer().with_variant(sa.BigInteger(), "postgresql")
ZERO = sa.text("0")


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
    schema_ops.create_full_text()
    schema_ops.set_schema_version(1)


def downgrade() -> None:
    schema_ops.drop_full_text()
    op.drop_table("messages")
    op.drop_table("sessions")
    op.drop_table("schema_version")
