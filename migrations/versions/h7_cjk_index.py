"""h7: a trigram index of the messages written in CJK and other unsegmented scripts (SQLite).

Not a schema version of the original store: ``schema_version`` stays 6, so the original store
keeps opening and writing the file, and its inserts keep the index in step through the
triggers (they use built-in SQL only). Created only when SQLite has the trigram tokenizer
(3.34+). PostgreSQL already serves the same queries from its ``pg_trgm`` index: nothing to do.

Revision ID: h7_cjk_index
Revises: v6_reasoning_columns
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from hermes_store import schema_ops

revision: str = "h7_cjk_index"
down_revision: str | None = "v6_reasoning_columns"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema_ops.create_cjk_index(op.get_bind())


def downgrade() -> None:
    schema_ops.drop_cjk_index(op.get_bind())
