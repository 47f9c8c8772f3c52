"""PostgreSQL's streaming export (server-side cursors, one snapshot) and COPY import give exactly
what the generic paths give, and search on PostgreSQL is one statement."""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.engine.factory import autocommit_engine
from hermes_store.repo import pgstream
from hermes_store.transfer import import_sessions, read_records, write_export

T0 = 1_767_000_000.0
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "deploy",
    "server",
    "timeout",
    "retry",
    "quokka",
    "数据库",
    "连接",
    "ünïcode",
]


def populate(db: SessionDB, *, seed: int = 3, sessions: int = 12) -> None:
    """Sessions of every shape the export carries: children, empty sessions, tool calls, NULL
    and multi-line contents, equal timestamps, large counters, costs, titles."""
    rng = random.Random(seed)
    for index in range(sessions):
        sid = f"s{index:03d}"
        parent = f"s{index - 1:03d}" if index % 4 == 3 else None
        db.create_session(sid, rng.choice(["cli", "telegram"]), model="m", parent_session_id=parent)
        messages = []
        for turn in range(rng.randint(0, 7)):
            content = None if turn == 5 else " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
            messages.append(
                {
                    "role": ["user", "assistant", "tool"][turn % 3],
                    "content": content + "\nsecond line" if content and turn == 2 else content,
                    "tool_calls": [{"id": f"c{turn}", "type": "function"}]
                    if turn % 3 == 1
                    else None,
                    "tool_name": "terminal" if turn % 3 == 2 else None,
                    # the first two share a timestamp
                    "timestamp": T0 + index + (0 if turn < 2 else turn / 7),
                }
            )
        if messages:
            db.append_messages(sid, messages)
        db.update_token_counts(
            sid, input_tokens=3_000_000_000 + index, output_tokens=7, estimated_cost_usd=0.1 / 3
        )
        if index % 3 == 0:
            db.set_session_title(sid, f"title {index}")
        if index % 2 == 0:
            db.end_session(sid, "user_exit")


def as_lines(records: Iterator[dict[str, Any]]) -> str:
    handle = io.StringIO()
    for _ in write_export(handle, records):
        pass
    return handle.getvalue()


def generic_export(db: SessionDB, source: str | None = None) -> list[dict[str, Any]]:
    """The generic path: inside an open unit, iter_export pages through it."""
    with db.transaction():
        return list(db.iter_export(source, page_size=5))


@pytest.fixture
def pg_store(pg_url: URL) -> Iterator[SessionDB]:
    db = SessionDB(pg_url.render_as_string(hide_password=False))
    yield db
    db.close()


def test_streamed_export_equals_the_generic_path_and_sqlite(
    pg_store: SessionDB, tmp_path: Path
) -> None:
    populate(pg_store)
    assert pgstream.supported(pg_store.engine.dialect)
    streamed = list(pg_store.iter_export())
    assert len(streamed) == 12
    assert streamed == generic_export(pg_store)
    assert [r["id"] for r in pg_store.iter_export("cli")] == [
        r["id"] for r in generic_export(pg_store, "cli")
    ]
    assert list(pg_store.iter_export("cli")) == generic_export(pg_store, "cli")
    # Through a SQLite file and back out: the same bytes.
    first = as_lines(pg_store.iter_export())
    sqlite_db = SessionDB(tmp_path / "state.db")
    try:
        records = read_records(io.BytesIO(first.encode()), lambda _size: None)
        import_sessions(sqlite_db, records, batch_size=4)
        assert as_lines(sqlite_db.iter_export()) == first
    finally:
        sqlite_db.close()


def test_export_reads_one_snapshot(pg_store: SessionDB) -> None:
    populate(pg_store)
    before = generic_export(pg_store)
    stream = pg_store.iter_export()
    first = next(stream)
    # Written by another connection while the export is under way: invisible to it.
    oldest = before[-1]["id"]
    pg_store.append_message(oldest, "user", "written during the export")
    pg_store.create_session("late", "cli")
    rest = list(stream)
    assert [first, *rest] == before
    assert generic_export(pg_store)[-1]["message_count"] == before[-1]["message_count"] + 1


def test_closing_an_export_early_releases_its_connection(pg_store: SessionDB) -> None:
    populate(pg_store)
    for _ in range(pg_store.engine.pool.size() + pg_store.engine.pool._max_overflow + 2):  # type: ignore[attr-defined]
        stream = pg_store.iter_export()
        next(stream)
        stream.close()
    assert pg_store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_copy_import_matches_the_sqlite_import(pg_store: SessionDB, tmp_path: Path) -> None:
    """The same file with taken ids and titles: the same report and the same rows as SQLite."""
    source = SessionDB(tmp_path / "source.db")
    try:
        populate(source)
        data = as_lines(source.iter_export()).encode()
    finally:
        source.close()
    sqlite_db = SessionDB(tmp_path / "target.db")
    try:
        reports = []
        for db in (pg_store, sqlite_db):
            db.create_session("taken", "cli")
            db.append_message("taken", "user", "holds message id 1")
            db.set_session_title("taken", "title 3")
            records = read_records(io.BytesIO(data), lambda _size: None)
            reports.append(import_sessions(db, records, batch_size=5))
        assert reports[0] == reports[1]
        assert reports[0].messages_renumbered > 0 and reports[0].titles_cleared == 1
        imported = [
            as_lines(r for r in db.iter_export() if r["id"] != "taken")
            for db in (pg_store, sqlite_db)
        ]
        assert imported[0] == imported[1]
        top = max(m["id"] for r in pg_store.iter_export() for m in r["messages"])
        assert pg_store.append_message("s000", "user", "after") > top  # the sequence moved
    finally:
        sqlite_db.close()


QUERIES = (
    ("deploy", {}),
    ("deploy server", {}),
    ("deploy OR quokka", {"sort": "newest"}),
    ("retry NOT timeout", {"sort": "oldest"}),
    ("dep*", {"role_filter": ["user"]}),
    ("gamma", {"source_filter": ["cli"]}),
    ("gamma", {"exclude_sources": ["cli"], "limit": 2, "offset": 1}),
    ('"beta gamma"', {"sort": "newest", "source_filter": ["telegram", "cli"]}),
)


def test_search_with_hits_is_one_statement_on_postgresql(pg_store: SessionDB) -> None:
    populate(pg_store, sessions=20)
    seen: list[str] = []

    def capture(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    for query, options in QUERIES:
        seen.clear()
        # Reads outside a unit run on the engine's autocommit twin.
        event.listen(autocommit_engine(pg_store.engine), "before_cursor_execute", capture)
        try:
            hits = pg_store.search_messages(query, **options)
        finally:
            event.remove(autocommit_engine(pg_store.engine), "before_cursor_execute", capture)
        assert hits, query
        assert all(len(hit["context"]) >= 1 for hit in hits)
        assert len(seen) == 1, (query, options, seen)
        plain = seen[0]
        # sessions is read for the page (and in the match only for a source filter).
        by_source = "source_filter" in options or "exclude_sources" in options
        assert plain.count("JOIN sessions") + plain.count("sessions.id =") >= 1
        assert (plain.count("FROM messages JOIN sessions") > 0) == by_source, plain


def test_a_substring_search_carries_its_context_on_postgresql(pg_store: SessionDB) -> None:
    populate(pg_store, sessions=20)
    seen: list[str] = []
    twin = autocommit_engine(pg_store.engine)
    event.listen(twin, "before_cursor_execute", lambda *a: seen.append(a[2]))
    hits = pg_store.search_messages("数据库")
    assert hits and len(seen) == 1
    for hit in hits:
        session = pg_store.get_messages(hit["session_id"])
        at = [m["id"] for m in session].index(hit["id"])
        expected = session[max(0, at - 1) : at + 2]
        assert [c["role"] for c in hit["context"]] == [m["role"] for m in expected]
        assert [c["content"] for c in hit["context"]] == [
            (m["content"] or "")[:200] for m in expected
        ]


def test_supported_only_on_psycopg() -> None:
    assert not pgstream.supported(sa.create_engine("sqlite://").dialect)
