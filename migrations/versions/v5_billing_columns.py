"""v5: the eleven token and billing columns on sessions.

Revision ID: v5_billing_columns
Revises: v4_title_unique_index
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from hermes_store.schema import steps as schema_ops

revision: str = "v5_billing_columns"
down_revision: str | None = "v4_title_unique_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REAL: sa.types.TypeEngine[float] = sa.REAL().with_variant(
    postgresql.DOUBLE_PRECISION(), "postgresql"
)
ZERO = sa.text("0")
COLUMNS = (
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
    "billing_provider",
    "billing_base_url",
    "billing_mode",
    "estimated_cost_usd",
    "actual_cost_usd",
    "cost_status",
    "cost_source",
    "pricing_version",
)


def upgrade() -> None:
    schema_ops.add_columns(
        "sessions",
        sa.Column("cache_read_tokens", sa.Integer(), server_default=ZERO),
        sa.Column("cache_write_tokens", sa.Integer(), server_default=ZERO),
        sa.Column("reasoning_tokens", sa.Integer(), server_default=ZERO),
        sa.Column("billing_provider", sa.Text()),
        sa.Column("billing_base_url", sa.Text()),
        sa.Column("billing_mode", sa.Text()),
        sa.Column("estimated_cost_usd", REAL),
        sa.Column("actual_cost_usd", REAL),
        sa.Column("cost_status", sa.Text()),
        sa.Column("cost_source", sa.Text()),
        sa.Column("pricing_version", sa.Text()),
    )
    schema_ops.set_schema_version(5)


def downgrade() -> None:
    schema_ops.drop_columns("sessions", *COLUMNS)
    schema_ops.set_schema_version(4)
