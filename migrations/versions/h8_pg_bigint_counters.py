"""h8: 64-bit counters on PostgreSQL (token counts, message and tool-call counts).

SQLite's INTEGER already holds 64 bits, so the file format is unchanged there (this revision
only moves the Alembic version). On PostgreSQL ``integer`` stops at 2,147,483,647: a long-lived
session with cache reads passes it, and every later ``update_token_counts`` failed. Each
``ALTER TABLE`` rewrites its table and rebuilds its indexes under an ACCESS EXCLUSIVE lock
(measured: 27 s for 1M messages in 50k sessions, 457 MB, on 2 cores; writers wait meanwhile),
so the revision sets a ``lock_timeout``: when another transaction holds the table longer than
that, the upgrade fails cleanly and can be re-run, instead of queueing every gateway behind
it. Run it once, before rolling out, with ``hermes-store db upgrade``.

Revision ID: h8_pg_bigint_counters
Revises: h7_cjk_index
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from hermes_store.schema import steps as schema_ops

revision: str = "h8_pg_bigint_counters"
down_revision: str | None = "h7_cjk_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Every counter the store adds to, per table: one ALTER TABLE each, so each table is
#: rewritten once.
COUNTERS = {
    "sessions": (
        "message_count",
        "tool_call_count",
        "input_tokens",
        "output_tokens",
        "cache_read_tokens",
        "cache_write_tokens",
        "reasoning_tokens",
    ),
    "messages": ("token_count",),
}
LOCK_TIMEOUT = "SET LOCAL lock_timeout = '30s'"


def _retype(sql_type: str) -> None:
    if schema_ops.dialect_name() != "postgresql":
        return
    op.execute(sa.text(LOCK_TIMEOUT))
    for table, columns in COUNTERS.items():
        changes = ", ".join(f"ALTER COLUMN {column} TYPE {sql_type}" for column in columns)
        op.execute(sa.text(f"ALTER TABLE {table} {changes}"))


def upgrade() -> None:
    _retype("BIGINT")


def downgrade() -> None:
    # Fails (integer out of range) when a counter already passed 2^31 - 1: nothing is changed.
    _retype("INTEGER")
