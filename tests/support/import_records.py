"""Import records written in a line each and imported in-process, and the parent links they
leave: shared by the tests of parent links on import and of an import run again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from hermes_store import SessionDB, transfer
from hermes_store.tables import sessions_table as S


def session(sid: str, parent: str | None = None, started: float = 1.0) -> dict[str, Any]:
    """An export record of a session with no messages."""
    return {"id": sid, "source": "cli", "started_at": started, "parent_session_id": parent}


def import_lines(
    store: SessionDB, records: list[dict[str, Any]], **options: Any
) -> transfer.ImportReport:
    """``records`` imported as the lines of a file (numbered from 1)."""
    return transfer.import_sessions(store, enumerate(records, 1), **options)


def parents(store: SessionDB) -> dict[str, str | None]:
    """Every session's stored parent."""
    rows = store.uow.run(
        lambda conn: conn.execute(sa.select(S.c.id, S.c.parent_session_id)).all(), write=False
    )
    return dict(rows)  # type: ignore[arg-type]
