"""Group commit on PostgreSQL (``hermes_store.uow.pggroup``): the one-statement writes of a process
that arrive while another is in flight share the next transaction; a failing write fails alone;
a group lost while it committed is reported, never run twice; groups of different processes
take row locks in one order (no deadlock). Directly and through PgBouncer.

Every wait is on a condition: a row lock held by the test's own transaction keeps the first
write in flight while the others queue (``wait_for_queued_units``), and the server's
``pg_stat_activity`` says when a write waits for that lock."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import NullPool

from hermes_store import DatabaseUnavailableError, SessionDB, UnknownSessionError
from hermes_store.uow.unit import StoreStats
from tests.conftest import url_string
from tests.support import proc_workers

GUARD = 120.0  # a hang guard only


@pytest.fixture(params=["postgresql", "pgbouncer"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def admin(pg_worker_url: URL | None, db_url: URL) -> Iterator[Connection]:
    """A direct connection to the test database (never through PgBouncer)."""
    assert pg_worker_url is not None
    engine = sa.create_engine(pg_worker_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        yield conn
    engine.dispose()


class RowLock:
    """The test's own transaction holding a session's row: writes to it wait."""

    def __init__(self, url: URL, session: str) -> None:
        self.engine = sa.create_engine(url, poolclass=NullPool)
        self.conn = self.engine.connect()
        self.conn.begin()
        self.conn.execute(
            sa.text("SELECT 1 FROM sessions WHERE id = :s FOR UPDATE"), {"s": session}
        )
        self.pid = self.conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()

    def release(self) -> None:
        if self.conn.in_transaction():
            self.conn.commit()
            self.conn.close()
            self.engine.dispose()


def _waiting_writer(admin: Connection, besides: int) -> int:
    """The pid of the backend that waits for a row lock (once one does)."""
    query = sa.text(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND pid <> :besides"
    )
    deadline = time.monotonic() + GUARD
    while time.monotonic() < deadline:
        pid = admin.execute(query, {"besides": besides}).scalar()
        if pid is not None:
            return int(pid)
        time.sleep(0.01)  # polling the server's view of a lock wait: no event to wait on
    raise AssertionError("no write ever waited for the row lock")


def _call(outcomes: dict[str, Any], name: str, fn: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        try:
            outcomes[name] = fn()
        except Exception as error:
            outcomes[name] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _total(stores: list[SessionDB]) -> StoreStats:
    total = StoreStats()
    for store in stores:
        stats = store.stats()
        total.groups += stats.groups
        total.grouped_units += stats.grouped_units
        total.max_group = max(total.max_group, stats.max_group)
        total.lost_groups += stats.lost_groups
    return total


@dataclass
class Scene:
    """A first append to "s" in flight (its backend ``waiting`` for the test's row lock) and
    calls queued behind it, each through a store of its own; ``outcomes`` by call name."""

    stores: list[SessionDB]
    lock: RowLock
    threads: list[threading.Thread]
    waiting: int
    outcomes: dict[str, Any]

    def finish(self) -> SessionDB:
        """Let the writes go, wait for every call; the first store, to read back with."""
        self.lock.release()
        for thread in self.threads:
            thread.join(GUARD)
            assert not thread.is_alive()
        return self.stores[0]


@contextmanager
def queued_behind_a_locked_write(
    url: URL, admin: Connection, direct: URL, later: dict[str, Callable[[SessionDB], Any]]
) -> Iterator[Scene]:
    stores = [SessionDB(url_string(url)) for _ in range(1 + len(later))]
    first = stores[0]
    lock: RowLock | None = None
    try:
        for session in ("s", "t"):
            first.create_session(session, "cli")
        lock = RowLock(direct, "s")
        outcomes: dict[str, Any] = {}
        threads = [_call(outcomes, "first", lambda: first.append_message("s", "user", "first"))]
        waiting = _waiting_writer(admin, lock.pid)
        for store, (name, fn) in zip(stores[1:], later.items(), strict=True):
            threads.append(_call(outcomes, name, lambda fn=fn, store=store: fn(store)))
        assert first.uow.wait_for_queued_units(len(later), GUARD)
        yield Scene(stores, lock, threads, waiting, outcomes)
    finally:
        if lock is not None:
            lock.release()
        for store in stores:
            store.close()


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
        assert isinstance(first, DatabaseUnavailableError)
        assert "may or may not" in str(first)
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
