"""v4: the partial unique index on sessions.title (NULL titles exempt).

Revision ID: v4_title_unique_index
Revises: v3_session_title
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from hermes_store.engine.factory import display_url
from hermes_store.errors import UnrecognizedSchemaError
from hermes_store.schema import steps as schema_ops

revision: str = "v4_title_unique_index"
down_revision: str | None = "v3_session_title"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


#: Titles shared by several sessions, the most shared first (the index forbids them).
DUPLICATE_TITLES = (
    "SELECT title, count(*) AS n FROM sessions WHERE title IS NOT NULL "
    "GROUP BY title HAVING count(*) > 1 ORDER BY n DESC, title"
)
#: Shared titles a refusal names (and how many more there are).
SHOWN = 5


def refuse_duplicate_titles() -> None:
    """Refuse, before the index fails on them, sessions that share a title (the original store
    of version 3 let them): which title each keeps is the user's choice, so none is changed."""
    if schema_ops.offline():
        return
    bind = op.get_bind()
    shared = bind.exec_driver_sql(DUPLICATE_TITLES).all()
    if not shared:
        return
    shown = ", ".join(f"{title!r} ({n} sessions)" for title, n in shared[:SHOWN])
    more = f" and {len(shared) - SHOWN} more" if len(shared) > SHOWN else ""
    raise UnrecognizedSchemaError(
        f"{display_url(bind.engine.url)}: {len(shared)} title(s) are held by several "
        f"sessions each ({shown}{more}), which schema version 4 forbids (a title is unique); "
        "nothing was changed. Give those sessions distinct titles (the original store's "
        "set_session_title, or SQL: UPDATE sessions SET title = ... WHERE id = ...; NULL "
        "clears a title), then open the file again"
    )


def upgrade() -> None:
    refuse_duplicate_titles()
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
