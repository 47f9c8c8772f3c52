"""h9: idempotency keys (``write_keys``), so a write whose outcome was unknown can be re-sent.

A caller that passes ``idempotency_key=`` to ``append_message`` or to an incrementing
``update_token_counts`` gets one row here in the same transaction as the write: a re-sent call
with the same key finds it, writes nothing and returns the first call's message id. A separate
table with no foreign key: the original store's tables and ``schema_version`` (6) are untouched,
so that store keeps reading and writing the file; a session it deletes leaves its keys behind,
which only stop a re-send (the store deletes them with sessions it deletes, and retention
expires old ones).

Revision ID: h9_write_keys
Revises: h8_pg_bigint_counters
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "h9_write_keys"
down_revision: str | None = "h8_pg_bigint_counters"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REAL: sa.types.TypeEngine[float] = sa.REAL().with_variant(
    postgresql.DOUBLE_PRECISION(), "postgresql"
)
MESSAGE_ID = sa.Integer().with_variant(sa.BigInteger(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "write_keys",
        sa.Column("key", sa.Text(), primary_key=True),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("message_id", MESSAGE_ID),
        sa.Column("created_at", REAL, nullable=False),
    )
    op.create_index("ix_write_keys_session_id", "write_keys", ["session_id"])
    op.create_index("ix_write_keys_created_at", "write_keys", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_write_keys_created_at", table_name="write_keys")
    op.drop_index("ix_write_keys_session_id", table_name="write_keys")
    op.drop_table("write_keys")
