"""Group commit on PostgreSQL (``hermes_store.uow.pggroup``): the one-statement writes of a process
that arrive while another is in flight share the next transaction; a failing write fails alone;
a group lost while it committed is reported, never run twice; groups of different processes
take row locks in one order (no deadlock). Directly and through PgBouncer.

Every wait is on a condition: a row lock held by the test's own transaction keeps the first
write in flight while the others queue (``wait_for_queued_units``), and the server's
``pg_stat_activity`` says when a write waits for that lock."""

from __future__ import annotations

import gc
import multiprocessing
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection

from hermes_store import SessionDB, UnknownSessionError, WriteOutcomeUnknownError
from hermes_store.uow.unit import StoreStats
from tests.support import proc_workers
from tests.support.backends import url_string
from tests.support.pg_row_locks import GUARD, queued_behind_a_locked_write


@pytest.fixture(params=["postgresql", "pgbouncer"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _total(stores: list[SessionDB]) -> StoreStats:
    total = StoreStats()
    for store in stores:
        stats = store.stats()
        total.groups += stats.groups
        total.grouped_units += stats.grouped_units
        total.max_group = max(total.max_group, stats.max_group)
        total.lost_groups += stats.lost_groups
    return total


def test_writes_queued_behind_one_in_flight_share_one_transaction(
    db_url: URL, admin: Connection, pg_worker_url: URL
) -> None:
    later: dict[str, Callable[[SessionDB], Any]] = {
        "second": lambda db: db.append_message("s", "assistant", "second"),
        "tokens": lambda db: db.update_token_counts("s", input_tokens=7),
        "other": lambda db: db.append_message("t", "user", "elsewhere"),
    }
    with queued_behind_a_locked_write(db_url, admin, pg_worker_url, later) as scene:
        db = scene.finish()
        outcomes = scene.outcomes
        assert not [value for value in outcomes.values() if isinstance(value, Exception)]
        by_id = {m["id"]: m["content"] for m in db.get_messages("s") + db.get_messages("t")}
        assert by_id == {
            outcomes["first"]: "first",
            outcomes["second"]: "second",
            outcomes["other"]: "elsewhere",
        }
        s = db.get_session("s")
        assert s is not None and (s["message_count"], s["input_tokens"]) == (2, 7)
        t = db.get_session("t")
        assert t is not None and t["message_count"] == 1
        stats = _total(scene.stores)
        assert (stats.groups, stats.grouped_units, stats.max_group) == (2, 4, 3)
        assert stats.lost_groups == 0


def test_a_failing_write_fails_alone_and_the_others_land(
    db_url: URL, admin: Connection, pg_worker_url: URL
) -> None:
    later: dict[str, Callable[[SessionDB], Any]] = {
        "second": lambda db: db.append_message("s", "assistant", "second"),
        "missing": lambda db: db.append_message("nope", "user", "nowhere"),
        "tokens": lambda db: db.update_token_counts("s", output_tokens=3),
    }
    with queued_behind_a_locked_write(db_url, admin, pg_worker_url, later) as scene:
        db = scene.finish()
        assert isinstance(scene.outcomes["missing"], UnknownSessionError)
        assert [m["content"] for m in db.get_messages("s")] == ["first", "second"]
        s = db.get_session("s")
        assert s is not None and (s["message_count"], s["output_tokens"]) == (2, 3)
        assert db.get_session("nope") is None
        assert _total(scene.stores).lost_groups == 1  # rolled back whole; each ran again alone


def test_a_write_lost_while_committing_is_reported_and_never_repeated(
    db_url: URL, admin: Connection, pg_worker_url: URL
) -> None:
    later: dict[str, Callable[[SessionDB], Any]] = {
        f"queued{n}": lambda db, n=n: db.append_message("s", "user", f"queued {n}")
        for n in range(3)
    }
    with queued_behind_a_locked_write(db_url, admin, pg_worker_url, later) as scene:
        # The first write's message was sent and waits on the server: its fate is unknown to
        # the client once its connection is cut.
        terminate = sa.text("SELECT pg_terminate_backend(:p, 5000)")
        assert admin.execute(terminate, {"p": scene.waiting}).scalar()
        db = scene.finish()
        first = scene.outcomes["first"]
        assert isinstance(first, WriteOutcomeUnknownError)
        assert "may have landed" in str(first)
        landed = sorted(m["content"] for m in db.get_messages("s"))
        assert landed == ["queued 0", "queued 1", "queued 2"]  # "first" was not re-run
        s = db.get_session("s")
        assert s is not None and s["message_count"] == 3


@pytest.mark.slow
def test_groups_of_two_processes_writing_many_sessions_never_deadlock(
    db_url: URL, admin: Connection
) -> None:
    sessions = [f"s{n}" for n in range(4)]
    with SessionDB(url_string(db_url)) as db:
        for session in sessions:
            db.create_session(session, "cli")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(3)
    results = ctx.Queue()
    processes = [
        ctx.Process(
            target=proc_workers.write_sessions_in_random_order,
            args=(url_string(db_url), sessions, 4, 60, seed, start, results),
        )
        for seed in range(2)
    ]
    for process in processes:
        process.start()
    start.wait(GUARD)
    outcomes = [results.get(timeout=GUARD) for _ in processes]
    for process in processes:
        process.join(GUARD)
        assert process.exitcode == 0
    assert [error for outcome in outcomes for error in outcome["errors"]] == []
    assert sum(outcome["lost_groups"] for outcome in outcomes) == 0  # no deadlock aborted one
    assert sum(outcome["groups"] for outcome in outcomes) > 0
    with SessionDB(url_string(db_url)) as db:
        appended = sum(outcome["appended"][s] for outcome in outcomes for s in sessions)
        assert sum(db.message_count(s) for s in sessions) == appended
        for session in sessions:
            row = db.get_session(session)
            assert row is not None
            assert row["message_count"] == sum(o["appended"][session] for o in outcomes)
            assert row["input_tokens"] == sum(o["tokens"][session] for o in outcomes)


TRICKY = [
    "it's",
    "back\\slash \\' and \\\\",
    "100% %(content)s %s {0}",
    "a; DROP TABLE messages; --",
    "$$ dollar $tag$ quoted $tag$",
    "E'escaped\\n'",
    "naïve 日本語 😀 \u2028",
    "",
]


def test_values_reach_the_server_exactly_as_given(db_url: URL) -> None:
    """A group is one message with client-side bound parameters: quotes, backslashes, percent
    signs, semicolons and dollar quotes arrive as given, whatever the group's size."""
    with SessionDB(url_string(db_url)) as db:
        db.create_session("s", "cli")
        ids = [
            db.append_message("s", "tool", text, tool_name=text, tool_call_id=text)
            for text in TRICKY
        ]
        db.update_token_counts("s", input_tokens=2**40, model=TRICKY[3], billing_mode=TRICKY[1])
        stored = db.get_messages("s")
        assert [m["id"] for m in stored] == ids
        assert [(m["content"], m["tool_name"], m["tool_call_id"]) for m in stored] == [
            (text, text, text) for text in TRICKY
        ]
        session = db.get_session("s")
        assert session is not None
        assert (session["input_tokens"], session["model"], session["billing_mode"]) == (
            2**40,
            TRICKY[3],
            TRICKY[1],
        )


def test_a_store_in_a_schema_of_its_own_groups_into_that_schema(db_url: URL) -> None:
    """A group is SQL written by the store, not by SQLAlchemy's execution: it must still land
    in the store's schema, never in same-named tables of the search path (here another store,
    in ``public``, holding a session of the same id)."""
    url = url_string(db_url)
    with SessionDB(url) as public, SessionDB(url, schema="grouped") as placed:
        for db in (public, placed):
            db.create_session("s", "cli")
        placed.append_message("s", "user", "in the schema")
        placed.update_token_counts("s", input_tokens=5)
        public.append_message("s", "user", "in public")
        assert [m["content"] for m in placed.get_messages("s")] == ["in the schema"]
        assert [m["content"] for m in public.get_messages("s")] == ["in public"]
        placed_row, public_row = placed.get_session("s"), public.get_session("s")
        assert placed_row is not None and public_row is not None
        assert (placed_row["message_count"], placed_row["input_tokens"]) == (1, 5)
        assert (public_row["message_count"], public_row["input_tokens"]) == (1, 0)
        assert placed.stats().lost_groups == 0  # it went into its schema at the first try
        assert placed.uow.statement_groups is not public.uow.statement_groups


def test_a_callers_engine_has_a_queue_of_its_own_that_goes_with_it(pg_url: URL) -> None:
    """Stores on the package's engines for one URL share a queue; a caller's engine gets one
    of its own, shared by the stores on it and collected with it: keyed by ``id()`` it stayed
    for the process's life and went to the next engine made at the same address."""
    url = url_string(pg_url)
    with SessionDB(url) as first, SessionDB(url) as second:
        assert first.uow.statement_groups is second.uow.statement_groups
    given = sa.create_engine(pg_url)
    with SessionDB(given) as first, SessionDB(given) as second:
        groups = first.uow.statement_groups
        assert groups is not None and groups is second.uow.statement_groups
        first.create_session("s", "cli")
        first.append_message("s", "user", "through the caller's engine")
    other = sa.create_engine(pg_url)
    with SessionDB(other) as db:
        assert db.uow.statement_groups is not groups
    other.dispose()
    gone = weakref.ref(groups)
    given.dispose()
    del given, first, second, groups, db
    gc.collect()
    assert gone() is None
