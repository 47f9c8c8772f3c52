"""v6: messages.reasoning, reasoning_details and codex_reasoning_items.

Revision ID: v6_reasoning_columns
Revises: v5_billing_columns
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from hermes_store.schema import steps as schema_ops

revision: str = "v6_reasoning_columns"
down_revision: str | None = "v5_billing_columns"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema_ops.add_columns(
        "messages",
        sa.Column("reasoning", sa.Text()),
        sa.Column("reasoning_details", sa.Text()),
        sa.Column("codex_reasoning_items", sa.Text()),
    )
    schema_ops.set_schema_version(6)


def downgrade() -> None:
    schema_ops.drop_columns(
        "messages", "reasoning", "reasoning_details", "codex_reasoning_items", autoincrement=True
    )
    schema_ops.set_schema_version(5)
