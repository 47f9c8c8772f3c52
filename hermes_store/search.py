"""Full-text search (being written)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection


def sanitize_fts5_query(query: str) -> str:
    raise NotImplementedError


def contains_cjk(text: str) -> bool:
    raise NotImplementedError


def search_messages(
    conn: Connection,
    query: str,
    *,
    source_filter: Sequence[str] | None,
    exclude_sources: Sequence[str] | None,
    role_filter: Sequence[str] | None,
    limit: int,
    offset: int,
) -> list[dict[str, Any]]:
    raise NotImplementedError
