"""Words anywhere in a long message. SQLite's FTS5 indexes every character; PostgreSQL's
tsvector holds the first 200,000 characters of a message (``ddl.PG_INDEXED_CHARS``: a tsvector
cannot exceed 1 MB), and a word past them is found by the substring path, which runs when the
full-text search finds nothing (the README's bound)."""

from __future__ import annotations

import pytest

from hermes_store import SessionDB
from hermes_store.schema import ddl

WORD = "zebracorn"


def _long_message(store: SessionDB) -> int:
    filler = "filler words " * (ddl.PG_INDEXED_CHARS // 13 + 1000)
    assert len(filler) > ddl.PG_INDEXED_CHARS
    store.create_session("long", "cli")
    return int(store.append_message("long", "tool", f"{filler} {WORD} tail"))


def _hits(store: SessionDB, query: str) -> set[int]:
    return {hit["id"] for hit in store.search_messages(query, limit=50)}


def test_a_word_past_the_indexed_bound_is_found_when_nothing_else_holds_it(
    store: SessionDB,
) -> None:
    long_id = _long_message(store)
    assert _hits(store, WORD) == {long_id}
    assert _hits(store, "filler") == {long_id}
    assert _hits(store, f"{WORD} OR absent") == {long_id}


def test_a_word_past_the_indexed_bound_is_found_beside_other_matches(
    store: SessionDB, request: pytest.FixtureRequest
) -> None:
    if not store.is_sqlite:
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="PostgreSQL indexes a message's first 200,000 characters; the substring "
                "path covers the rest only when the full-text search finds nothing",
            )
        )
    long_id = _long_message(store)
    store.create_session("short", "cli")
    short_id = int(store.append_message("short", "user", f"a short {WORD} message"))
    assert _hits(store, WORD) == {long_id, short_id}
