"""v6: messages.reasoning, reasoning_details and codex_reasoning_items.

Revision ID: v6_reasoning_columns
Revises: v5_billing_columns
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from hermes_store import schema_ops

revision: str = "v6_reasoning_columns"
down_revision: str | None = "v5_billing_columns"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema_ops.add_version_columns(6)
    schema_ops.set_schema_version(6)


def downgrade() -> None:
    schema_ops.drop_version_columns(6)
    schema_ops.set_schema_version(5)
