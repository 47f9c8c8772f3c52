"""Session listing: the one-query rich list and the compression chain (seed 7.10)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from hermes_store.models import sessions_table as S

MAX_COMPRESSION_HOPS = 100


def compression_tip(conn: Connection, session_id: str) -> str | None:
    """Follow ``end_reason == 'compression'`` forward to the newest child started at or after
    the parent ended; children made earlier (subagents, branches) are never followed."""
    current = session_id
    for _ in range(MAX_COMPRESSION_HOPS):
        row = conn.execute(
            select(S.c.ended_at, S.c.end_reason).where(S.c.id == current)
        ).first()
        if row is None or row.end_reason != "compression" or row.ended_at is None:
            break
        child = conn.scalar(
            select(S.c.id)
            .where(S.c.parent_session_id == current, S.c.started_at >= row.ended_at)
            .order_by(S.c.started_at.desc(), S.c.id.desc())
            .limit(1)
        )
        if child is None:
            break
        current = child
    return current


def list_sessions_rich(
    conn: Connection,
    *,
    source: str | None,
    exclude_sources: Sequence[str] | None,
    limit: int,
    offset: int,
    include_children: bool,
    project_compression_tips: bool,
) -> list[dict[str, Any]]:
    raise NotImplementedError  # being written (search/listing issue)
