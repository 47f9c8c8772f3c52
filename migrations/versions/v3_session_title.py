"""v3: sessions.title (a readable name for a conversation).

Revision ID: v3_session_title
Revises: v2_finish_reason
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from hermes_store.schema import steps as schema_ops

revision: str = "v3_session_title"
down_revision: str | None = "v2_finish_reason"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema_ops.add_columns("sessions", sa.Column("title", sa.Text()))
    schema_ops.set_schema_version(3)


def downgrade() -> None:
    schema_ops.drop_columns("sessions", "title")
    schema_ops.set_schema_version(2)
