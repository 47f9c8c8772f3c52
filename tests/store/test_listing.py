"""The contract's "Listing" section: ``list_sessions_rich`` on both backends."""

from __future__ import annotations

from typing import Any

import pytest

from hermes_store import SessionDB
from hermes_store.engine import fastpath
from hermes_store.models import ChatSession
from hermes_store.repo import dialects, listing
from tests.support.backends import FLAVORS, SEARCH_BACKENDS
from tests.support.clock import FakeClock
from tests.support.query_plans import captured_selects, explain


@pytest.fixture(params=FLAVORS)
def flavor(request: pytest.FixtureRequest) -> str:
    """Through ``SessionDB`` and through ``AsyncSessionDB`` (tests/support/aio_driver.py)."""
    return str(request.param)


@pytest.fixture(params=SEARCH_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The contract runs on SQLite (with and without the CJK trigram index), PostgreSQL
    and PostgreSQL behind PgBouncer."""
    return str(request.param)


T0 = 1_700_000_000.0
TIP_FIELDS = {
    "id", "ended_at", "end_reason", "message_count", "tool_call_count", "title", "last_active",
    "preview", "model", "system_prompt",
}  # fmt: skip


def add(store: SessionDB, session_id: str, *messages: tuple[str, str | None, float]) -> None:
    """Append (role, content, timestamp) messages."""
    rows = [{"role": r, "content": c, "timestamp": t} for r, c, t in messages]
    store.append_messages(session_id, rows)


def by_id(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in rows}


def test_rows_carry_every_column_plus_preview_and_last_active(store: SessionDB) -> None:
    store.create_session("s", "cli", model="m1", system_prompt="sp")
    [row] = store.list_sessions_rich()
    assert set(row) == {c.name for c in ChatSession.__table__.columns} | {"preview", "last_active"}
    session = store.get_session("s")
    assert session is not None
    assert {k: row[k] for k in session} == session
    assert row["preview"] == "" and row["last_active"] == session["started_at"]


@pytest.mark.parametrize(
    ("messages", "preview"),
    [
        ([], ""),
        ([("assistant", "only the assistant spoke", T0)], ""),
        ([("user", None, T0), ("user", "second, with content", T0 + 1)], "second, with content"),
        ([("assistant", "hi", T0), ("user", "the user", T0 + 1)], "the user"),
        ([("user", "later", T0 + 5), ("user", "earlier by time", T0 + 1)], "earlier by time"),
        ([("user", "line one\nline two\r\nthree", T0)], "line one line two  three"),
        ([("user", " \t\n  padded  \r\n", T0)], "padded"),
        ([("user", "x" * 60, T0)], "x" * 60),
        ([("user", "y" * 61, T0)], "y" * 60 + "..."),
        ([("user", " " * 10 + "z" * 55 + " " * 10, T0)], "z" * 55),
        ([("user", "\n" * 5 + "w" * 58 + " tail", T0)], "w" * 58 + " t..."),
        ([("user", "数据库" * 30, T0)], ("数据库" * 20) + "..."),
        ([("user", "\u3000\xa0\u2003全角 spaces\u3000\x85", T0)], "全角 spaces"),
        ([("user", "", T0), ("user", "after empty", T0 + 1)], ""),  # "" is content, not NULL
    ],
)
def test_preview_rules(
    store: SessionDB, messages: list[tuple[str, str | None, float]], preview: str
) -> None:
    store.create_session("s", "cli")
    if messages:
        add(store, "s", *messages)
    [row] = store.list_sessions_rich()
    assert row["preview"] == preview


def test_preview_breaks_timestamp_ties_by_id(store: SessionDB) -> None:
    store.create_session("s", "cli")
    add(store, "s", ("user", "first inserted", T0), ("user", "second inserted", T0))
    assert store.list_sessions_rich()[0]["preview"] == "first inserted"


def test_last_active_is_the_latest_message_else_started_at(store: SessionDB) -> None:
    store.create_session("quiet", "cli")
    store.create_session("busy", "cli")
    add(store, "busy", ("user", "a", T0 + 30), ("assistant", "b", T0 + 90), ("user", "c", T0 + 60))
    rows = by_id(store.list_sessions_rich())
    assert rows["busy"]["last_active"] == T0 + 90
    assert rows["quiet"]["last_active"] == rows["quiet"]["started_at"]


def test_order_children_sources_and_paging(store: SessionDB) -> None:
    for i, source in enumerate(["cli", "telegram", "cli", "discord", "telegram", "cli"]):
        store.create_session(f"s{i}", source)
    store.create_session("child", "cli", parent_session_id="s0")
    newest_first = ["s5", "s4", "s3", "s2", "s1", "s0"]
    assert [r["id"] for r in store.list_sessions_rich()] == newest_first
    assert [r["id"] for r in store.list_sessions_rich(include_children=True)] == [
        "child", *newest_first,
    ]  # fmt: skip
    assert [r["id"] for r in store.list_sessions_rich(source="cli")] == ["s5", "s2", "s0"]
    assert [r["id"] for r in store.list_sessions_rich(exclude_sources=["cli", "discord"])] == [
        "s4", "s1",
    ]  # fmt: skip
    assert [r["id"] for r in store.list_sessions_rich(exclude_sources=[])] == newest_first
    assert [
        r["id"] for r in store.list_sessions_rich(source="telegram", exclude_sources=["telegram"])
    ] == []
    pages = [[r["id"] for r in store.list_sessions_rich(limit=4, offset=o)] for o in (0, 4, 8)]
    assert pages == [newest_first[:4], newest_first[4:], []]


def test_one_query_however_long_the_page(store: SessionDB) -> None:
    for i in range(30):
        store.create_session(f"s{i:02d}", "cli")
        add(store, f"s{i:02d}", ("user", f"hello {i}", T0 + i), ("assistant", "hi", T0 + i + 1))
    for limit in (1, 30):
        with captured_selects(store) as statements:
            rows = store.list_sessions_rich(limit=limit)
        assert len(rows) == limit and len(statements) == 1
    assert all(r["preview"].startswith("hello") for r in rows)


def _chain(store: SessionDB) -> None:
    """root -(compression)-> mid -(compression)-> tip, plus a subagent branch of root."""
    store.create_session("root", "cli", model="m-root", system_prompt="p-root")
    add(store, "root", ("user", "root question", T0))
    store.create_session("branch", "cli", parent_session_id="root")  # before root ended
    store.end_session("root", "compression")
    store.create_session("mid", "cli", parent_session_id="root")
    store.end_session("mid", "compression")
    store.create_session(
        "tip", "cli", model="m-tip", system_prompt="p-tip", parent_session_id="mid"
    )
    add(store, "tip", ("user", "continued\nafter compression", T0 + 500))
    store.set_session_title("tip", "The tip")


def test_compression_root_shows_its_tip(store: SessionDB) -> None:
    _chain(store)
    store.create_session("plain", "cli")
    rows = store.list_sessions_rich()
    assert [r["id"] for r in rows] == ["plain", "tip"]  # children stay hidden
    row = rows[1]
    tip = store.get_session("tip")
    root = store.get_session("root")
    assert tip is not None and root is not None
    assert row["_lineage_root_id"] == "root"
    assert row["started_at"] == root["started_at"]
    assert row["source"] == root["source"]
    for field in TIP_FIELDS - {"last_active", "preview"}:
        assert row[field] == tip[field], field
    assert row["preview"] == "continued after compression"
    assert row["last_active"] == T0 + 500
    assert "_lineage_root_id" not in rows[0]


def test_compression_projection_can_be_switched_off(store: SessionDB) -> None:
    _chain(store)
    [row] = store.list_sessions_rich(project_compression_tips=False)
    assert row["id"] == "root" and row["preview"] == "root question"
    assert "_lineage_root_id" not in row
    everything = by_id(store.list_sessions_rich(include_children=True))
    assert set(everything) == {"root", "branch", "mid", "tip"}
    assert everything["root"]["end_reason"] == "compression"
    assert all("_lineage_root_id" not in r for r in everything.values())


def test_broken_or_branch_only_chains_leave_the_row_alone(
    store: SessionDB, clock: FakeClock
) -> None:
    store.create_session("lonely", "cli")
    store.end_session("lonely", "compression")  # compressed, but no continuation was made
    store.create_session("early", "cli")
    store.create_session("sub", "cli", parent_session_id="early")  # a subagent, not a successor
    clock.advance(1)
    store.end_session("early", "compression")
    rows = by_id(store.list_sessions_rich())
    for name in ("lonely", "early"):
        assert rows[name]["id"] == name and rows[name]["end_reason"] == "compression"
        assert "_lineage_root_id" not in rows[name]


def test_tip_projection_costs_a_bounded_number_of_queries(store: SessionDB) -> None:
    for i in range(5):
        _root, _tip = f"r{i}", f"t{i}"
        store.create_session(_root, "cli")
        store.end_session(_root, "compression")
        store.create_session(_tip, "cli", parent_session_id=_root)
    with captured_selects(store) as statements:
        rows = store.list_sessions_rich()
    assert [r["id"] for r in rows] == [f"t{i}" for i in reversed(range(5))]
    # SQLite: the page, one hop query per chain step (here 1, plus the one that finds no
    # successor), and the tips' rich rows in one query: independent of how many roots are on
    # the page. PostgreSQL: one statement (a recursive CTE follows the chains).
    assert len(statements) == (4 if store.is_sqlite else 1)


def test_one_statement_projection_matches_the_hop_by_hop_one(store: SessionDB) -> None:
    """Chains of several hops, dead ends, branches, two sources: every page and filter gives
    what the page statement plus the hop-by-hop projection gives."""
    _chain(store)
    for i in range(6):
        store.create_session(f"c{i}", "cli" if i % 2 else "telegram")
        add(store, f"c{i}", ("user", f"chain {i}", T0 + i))
        store.end_session(f"c{i}", "compression")
        for hop in range(i % 3 + 1):
            parent = f"c{i}" if hop == 0 else f"c{i}h{hop - 1}"
            store.create_session(f"c{i}h{hop}", "cli", parent_session_id=parent)
            if hop < i % 3:
                store.end_session(f"c{i}h{hop}", "compression")
    store.create_session("dead", "cli")
    store.end_session("dead", "compression")
    shapes = [
        {"source": None, "exclude_sources": None},
        {"source": "cli", "exclude_sources": None},
        {"source": None, "exclude_sources": ["telegram"]},
    ]
    projected = 0
    statements = dialects.for_dialect(store.engine.dialect)  # PostgreSQL: one statement
    with store.engine.connect() as conn:
        for shape in shapes:
            for limit, offset in ((20, 0), (3, 0), (3, 2), (5, 7)):
                found = statements.list_sessions_rich(
                    conn,
                    **shape,  # type: ignore[arg-type]
                    limit=limit,
                    offset=offset,
                    include_children=False,
                    project_compression_tips=True,
                )
                excluded = list(shape["exclude_sources"] or ())
                statement = listing._page_statement(False, bool(shape["source"]), bool(excluded))
                params = {"source": shape["source"], "excluded": excluded}
                expected = [
                    listing._rich_dict(row)
                    for row in fastpath.rows(
                        conn,
                        statement,
                        {**params, "lim": limit, "off": offset},
                        expanding=["excluded"] if excluded else [],
                    )
                ]
                listing._project_tips(conn, expected)
                assert found == expected, (shape, limit, offset)
                projected += sum("_lineage_root_id" in row for row in found)
    assert projected > 0


def test_batched_tips_agree_with_compression_tip(store: SessionDB) -> None:
    _chain(store)
    store.create_session("solo", "cli")
    store.create_session("open", "cli")
    store.end_session("open", "compression")
    names = ["root", "mid", "tip", "branch", "solo", "open", "missing"]
    with store.engine.connect() as conn:
        batched = listing.compression_tips(conn, names)
        assert batched == {name: listing.compression_tip(conn, name) for name in names}
    assert batched["root"] == "tip" and batched["branch"] == "branch"


def test_listing_subqueries_use_idx_messages_session(store: SessionDB) -> None:
    store.create_session("s", "cli")
    add(store, "s", ("user", "plan", T0))
    with captured_selects(store) as statements:
        store.list_sessions_rich()
    [statement] = statements
    plan = explain(store, *statement)
    assert plan.count("idx_messages_session") >= 2, plan
    if store.is_sqlite:
        assert "SCAN m" not in plan
        assert "idx_sessions_started" in plan  # the page walks the index, no full sort
