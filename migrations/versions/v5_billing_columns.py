"""v5: the eleven token and billing columns on sessions.

Revision ID: v5_billing_columns
Revises: v4_title_unique_index
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from hermes_store import schema_ops

revision: str = "v5_billing_columns"
down_revision: str | None = "v4_title_unique_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema_ops.add_version_columns(5)
    schema_ops.set_schema_version(5)


def downgrade() -> None:
    schema_ops.drop_version_columns(5)
    schema_ops.set_schema_version(4)
