"""v2: messages.finish_reason (why the model stopped).

Revision ID: v2_finish_reason
Revises: v1_base
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from hermes_store.schema import steps as schema_ops

revision: str = "v2_finish_reason"
down_revision: str | None = "v1_base"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema_ops.add_columns("messages", sa.Column("finish_reason", sa.Text()))
    schema_ops.set_schema_version(2)


def downgrade() -> None:
    schema_ops.drop_columns("messages", "finish_reason", autoincrement=True)
    schema_ops.set_schema_version(1)
