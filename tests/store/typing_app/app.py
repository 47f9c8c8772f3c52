"""A downstream application, type-checked with ``mypy --strict`` by tests/store/test_typing.py."""

from __future__ import annotations

from hermes_store import SessionDB
from hermes_store.rows import MessageRow, SearchHit, SessionRow


def titles(db: SessionDB) -> list[str]:
    return [row["title"] or row["id"] for row in db.list_sessions_rich(limit=5)]


def last_message(db: SessionDB, session_id: str) -> str | None:
    messages: list[MessageRow] = db.get_messages(session_id)
    return messages[-1]["content"] if messages else None


def total_tokens(db: SessionDB, session_id: str) -> int:
    row: SessionRow | None = db.get_session(session_id)
    if row is None:
        return 0
    return (row["input_tokens"] or 0) + (row["output_tokens"] or 0)


def first_hit_session(db: SessionDB, query: str) -> str | None:
    hits: list[SearchHit] = db.search_messages(query)
    return hits[0]["session_id"] if hits else None
