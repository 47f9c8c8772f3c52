"""v4: the partial unique index on sessions.title (NULL titles exempt).

Revision ID: v4_title_unique_index
Revises: v3_session_title
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from hermes_store.schema import steps as schema_ops

revision: str = "v4_title_unique_index"
down_revision: str | None = "v3_session_title"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "idx_sessions_title_unique",
        "sessions",
        ["title"],
        unique=True,
        sqlite_where=sa.text("title IS NOT NULL"),
        postgresql_where=sa.text("title IS NOT NULL"),
        if_not_exists=True,
    )
    schema_ops.set_schema_version(4)


def downgrade() -> None:
    op.drop_index("idx_sessions_title_unique", table_name="sessions")
    schema_ops.set_schema_version(3)
