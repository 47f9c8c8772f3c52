"""PostgreSQL backends terminated at every step of a write unit: the caller gets either success
or a package error (never a raw driver error), nothing is half written, and the store keeps
working. Terminations are real (``pg_terminate_backend`` from an admin connection)."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import NullPool

from hermes_store import (
    DatabaseUnavailableError,
    HermesStoreError,
    SessionDB,
    WriteOutcomeUnknownError,
)
from hermes_store.engine.factory import IDLE_SINCE_KEY, autocommit_engine
from tests.support.backends import url_string
from tests.support.latency_proxy import LatencyProxy

STEPS = ("idle", "before_statement", "after_begin", "after_first_statement", "before_commit")


@pytest.fixture
def admin(pg_url: URL) -> Iterator[Connection]:
    engine = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        yield conn
    engine.dispose()


def _terminate(admin: Connection, pid: int) -> None:
    # With a timeout, the call returns once the backend is gone (not merely signalled).
    query = sa.text("SELECT pg_terminate_backend(:pid, 5000)")
    assert admin.execute(query, {"pid": pid}).scalar()


def _terminate_all_but_admin(admin: Connection) -> int:
    """Every connection to the test database except the admin's own (the idle pooled ones)."""
    return int(
        admin.execute(
            sa.text(
                "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ).scalar_one()
    )


class Killer:
    """Terminates the backend of the store's connection at one step of the next write unit."""

    def __init__(self, store: SessionDB, admin: Connection) -> None:
        self.admin = admin
        self.step: str | None = None
        self.fired = False
        engine = store.engine
        event.listen(engine, "begin", self._on_begin)
        event.listen(engine, "after_cursor_execute", self._on_statement)
        event.listen(engine, "commit", self._on_commit)
        # One-statement writes and reads run on the autocommit twin: killed before they leave.
        twin = autocommit_engine(engine)
        event.listen(twin, "before_cursor_execute", self._before_statement)
        event.listen(twin, "after_cursor_execute", self._on_statement)

    def arm(self, step: str) -> None:
        self.step, self.fired = step, False

    def _fire(self, conn: Connection, step: str) -> None:
        if self.step != step or self.fired:
            return
        self.fired = True
        # The pid the server gave this very connection (libpq's PQbackendPID).
        _terminate(self.admin, conn.connection.driver_connection.info.backend_pid)  # type: ignore[union-attr]

    def _before_statement(self, conn: Connection, *_: Any) -> None:
        self._fire(conn, "before_statement")

    def _on_begin(self, conn: Connection) -> None:
        self._fire(conn, "after_begin")

    def _on_statement(self, conn: Connection, *_: Any) -> None:
        self._fire(conn, "after_first_statement")

    def _on_commit(self, conn: Connection) -> None:
        self._fire(conn, "before_commit")


def _writes(store: SessionDB, n: int) -> dict[str, Callable[[], object]]:
    return {
        "create_session": lambda: store.create_session(f"new-{n}", "cli"),
        "append_message": lambda: store.append_message("s", "user", f"single {n}"),
        "append_messages": lambda: store.append_messages(
            "s", [{"role": "user", "content": f"bulk {n} {i}"} for i in range(3)]
        ),
        "update_token_counts": lambda: store.update_token_counts("s", input_tokens=1),
        "set_session_title": lambda: store.set_session_title("s", f"title {n}"),
        "end_session": lambda: store.end_session(f"new-{n}", "done"),
        "reopen_session": lambda: store.reopen_session(f"new-{n}"),
        "update_system_prompt": lambda: store.update_system_prompt(f"new-{n}", "be brief"),
        "ensure_session": lambda: store.ensure_session(f"other-{n}", "cli"),
        "clear_messages": lambda: store.clear_messages(f"other-{n}"),
        "delete_session": lambda: store.delete_session(f"other-{n}"),
        "prune_sessions": lambda: store.prune_sessions(older_than_days=0, source="none"),
    }


def test_pg_backend_terminated_at_every_step_of_every_write(pg_url: URL, admin: Connection) -> None:
    store = SessionDB(url_string(pg_url))
    try:
        store.create_session("s", "cli")
        killer = Killer(store, admin)
        outcomes: dict[tuple[str, str], str] = {}
        landed = {"messages": 0, "tokens": 0}
        for n, step in enumerate(STEPS):
            for name, call in _writes(store, n).items():
                if step == "idle":
                    _terminate_all_but_admin(admin)
                else:
                    killer.arm(step)
                try:
                    call()
                except HermesStoreError as error:
                    outcomes[(step, name)] = type(error).__name__
                except Exception as error:  # the bug: a raw driver error reached the caller
                    outcomes[(step, name)] = f"RAW {type(error).__name__}: {error}"
                else:
                    outcomes[(step, name)] = "ok"
                    landed["messages"] += {"append_message": 1, "append_messages": 3}.get(name, 0)
                    landed["tokens"] += name == "update_token_counts"
                killer.arm("")
                # The store keeps working right after, and a failed unit left nothing behind.
                session = store.get_session("s")
                assert session is not None
                assert session["message_count"] == store.message_count("s") == landed["messages"]
                assert session["input_tokens"] == landed["tokens"]
        raw = {key: value for key, value in outcomes.items() if value.startswith("RAW")}
        assert raw == {}
        # Each step was reached: the terminations inside a unit really failed those units.
        for step in STEPS[1:]:
            assert any(outcomes[(step, name)] != "ok" for name in _writes(store, 0)), step
        store.append_message("s", "user", "after the storm")
        assert store.message_count("s") == landed["messages"] + 1
        assert len(store.search_messages("storm")) == 1
    finally:
        store.close()


def test_pg_pooled_connection_left_mid_request_is_replaced(pg_url: URL) -> None:
    """A pooled connection whose last request is still in flight (libpq status ACTIVE: what a
    send that failed halfway after a termination leaves) must be replaced at checkout. The
    pool's liveness check used to flip ``autocommit`` on it, and psycopg's
    ``ProgrammingError: can't change 'autocommit' now: connection in transaction status
    ACTIVE`` reached the caller raw."""
    store = SessionDB(url_string(pg_url))
    try:
        store.create_session("s", "cli")
        store.append_message("s", "user", "before")
        left: list[int] = []

        def leave_a_request_in_flight(dbapi_connection: Any, _record: Any) -> None:
            if not left:  # once: the real driver state, a query sent and never read
                dbapi_connection.pgconn.send_query(b"SELECT 1")
                left.append(1)

        event.listen(store.engine.pool, "checkin", leave_a_request_in_flight)
        with store.engine.connect():
            pass
        event.remove(store.engine.pool, "checkin", leave_a_request_in_flight)
        assert left == [1]
        store.append_message("s", "user", "after")  # raised the raw ProgrammingError
        session = store.get_session("s")
        assert session is not None and session["message_count"] == 2
    finally:
        store.close()


def test_pg_terminated_idle_connections_cost_the_caller_nothing(
    pg_url: URL, admin: Connection
) -> None:
    """A server restart (every backend terminated while the pools sit idle): the next calls
    all succeed, on fresh connections, without a ping per call."""
    store = SessionDB(url_string(pg_url))
    try:
        store.create_session("s", "cli")
        for round_number in range(3):
            with store.transaction():  # the main pool holds a connection too
                store.append_message("s", "user", f"in a block {round_number}")
            assert _terminate_all_but_admin(admin) >= 1
            store.append_message("s", "user", f"single {round_number}")
            store.update_token_counts("s", input_tokens=1)
            with store.transaction():
                store.end_session("s", "done")
            assert store.get_session("s") is not None
        assert store.message_count("s") == 6
        session = store.get_session("s")
        assert session is not None and session["input_tokens"] == 3
    finally:
        store.close()


def test_pg_connection_idle_for_long_is_pinged_once(pg_url: URL) -> None:
    """Only a connection idle past the threshold costs a ping: one extra round trip."""
    with LatencyProxy((pg_url.host or "127.0.0.1", pg_url.port or 5432), delay=0.0) as proxy:
        store = SessionDB(url_string(pg_url.set(host="127.0.0.1", port=proxy.port)))
        try:
            store.create_session("s", "cli")
            for _ in range(8):  # warm: connection open, statement prepared
                store.update_token_counts("s", input_tokens=1)
            pool = autocommit_engine(store.engine).pool
            idle = []

            def age(_dbapi: Any, record: Any) -> None:
                record.info[IDLE_SINCE_KEY] -= 3600.0  # as if idle for an hour
                idle.append(1)

            proxy.reset()
            store.update_token_counts("s", input_tokens=1)
            assert proxy.reset() == 1
            event.listen(pool, "checkin", age)
            store.update_token_counts("s", input_tokens=1)  # checked in "an hour ago"
            event.remove(pool, "checkin", age)
            proxy.reset()
            store.update_token_counts("s", input_tokens=1)
            assert idle == [1] and proxy.reset() == 2  # the ping, then the statement
            session = store.get_session("s")
            assert session is not None and session["input_tokens"] == 11
        finally:
            store.close()


@dataclass
class _Ledger:
    """What the writer threads saw: acknowledged and unacknowledged writes."""

    acked: list[str] = field(default_factory=list)
    unacked: list[str] = field(default_factory=list)
    tokens_acked: int = 0
    tokens_unacked: int = 0
    raw: list[str] = field(default_factory=list)
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    progressed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.progressed = threading.Condition(self.lock)


def _writer(store: SessionDB, number: int, writes: int, ledger: _Ledger) -> None:
    for index in range(writes):
        content = f"w{number}-{index}"
        try:
            if index % 3 == 2:
                store.update_token_counts("s", input_tokens=1)
                outcome = "tokens"
            else:
                store.append_message("s", "user", content)
                outcome = "message"
        except DatabaseUnavailableError:
            outcome = "lost " + ("tokens" if index % 3 == 2 else "message")
        except Exception as error:  # the bug: anything else reached the caller
            outcome = f"raw {type(error).__name__}: {error}"
        with ledger.progressed:
            ledger.calls += 1
            if outcome == "message":
                ledger.acked.append(content)
            elif outcome == "tokens":
                ledger.tokens_acked += 1
            elif outcome == "lost message":
                ledger.unacked.append(content)
            elif outcome == "lost tokens":
                ledger.tokens_unacked += 1
            else:
                ledger.raw.append(outcome)
            ledger.progressed.notify_all()


def _kill_stream(pg_url: URL, admin: Connection, *, threads: int, writes: int, kills: int) -> None:
    """``threads`` writers append and add tokens on one session while backends of the store
    are terminated at random moments; then every acknowledged write is there exactly once and
    no unacknowledged one twice, and the counters agree with the rows."""
    name = f"hermes-kill-{random.randrange(10**9)}"
    store = SessionDB(url_string(pg_url.update_query_dict({"application_name": name})))
    rng = random.Random()
    ledger = _Ledger()
    total = threads * writes
    try:
        store.create_session("s", "cli")
        workers = [
            threading.Thread(target=_writer, args=(store, number, writes, ledger))
            for number in range(threads)
        ]
        for worker in workers:
            worker.start()
        done_kills = 0
        target = 0
        while done_kills < kills:
            # Wait (on the writers' progress, never on a clock) a random number of calls.
            target = min(total, target + rng.randint(1, max(2, 2 * total // kills)))
            with ledger.progressed:
                ledger.progressed.wait_for(lambda goal=target: ledger.calls >= goal, timeout=300)
                if ledger.calls >= total:
                    break
            killed = admin.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid, 5000) FROM (SELECT pid FROM "
                    "pg_stat_activity WHERE application_name = :name ORDER BY random() LIMIT 1) "
                    "AS victim"
                ),
                {"name": name},
            ).scalar()
            done_kills += bool(killed)
        for worker in workers:
            worker.join(300)
            assert not worker.is_alive()
        assert ledger.raw == []
        assert done_kills >= 1
        rows = [m["content"] for m in store.get_messages("s")]
        found = Counter(rows)
        assert [content for content, count in found.items() if count > 1] == []  # no duplicates
        assert set(ledger.acked) <= set(found)  # every acknowledged write landed (once)
        assert set(found) <= set(ledger.acked) | set(ledger.unacked)
        session = store.get_session("s")
        assert session is not None
        assert session["message_count"] == len(rows)
        assert ledger.tokens_acked <= session["input_tokens"]
        assert session["input_tokens"] <= ledger.tokens_acked + ledger.tokens_unacked
        print(f"kills {done_kills}, lost {len(ledger.unacked)} appends", end=" ")
        print(f"and {ledger.tokens_unacked} token updates; retries {store.stats().retries}")
    finally:
        store.close()


def test_pg_backends_killed_during_a_stream_of_writes(pg_url: URL, admin: Connection) -> None:
    _kill_stream(pg_url, admin, threads=4, writes=60, kills=12)


@pytest.mark.slow
def test_pg_many_kills_during_a_stream_of_writes(pg_url: URL, admin: Connection) -> None:
    _kill_stream(pg_url, admin, threads=8, writes=250, kills=150)


def test_pg_write_that_never_left_is_retried_and_lands_once(pg_url: URL) -> None:
    """A write whose connection is found closed when the driver is about to send it provably
    never reached the server: it is retried on a fresh connection and lands exactly once (an
    append is not idempotent, so only this proof allows the retry)."""
    store = SessionDB(url_string(pg_url))
    try:
        store.create_session("s", "cli")
        twin = autocommit_engine(store.engine)
        closed: list[int] = []

        def close_before_sending(conn: Connection, *_: Any) -> None:
            if not closed:
                closed.append(1)
                conn.connection.driver_connection.close()  # type: ignore[union-attr]

        event.listen(twin, "before_cursor_execute", close_before_sending)
        try:
            message_id = store.append_message("s", "user", "exactly once")
        finally:
            event.remove(twin, "before_cursor_execute", close_before_sending)
        assert closed == [1]
        assert [m["id"] for m in store.get_messages("s")] == [message_id]
        session = store.get_session("s")
        assert session is not None and session["message_count"] == 1
        stats = store.stats()
        assert stats.retries + stats.group_reruns == 1  # sent again once (alone, after its group)
    finally:
        store.close()


def test_pg_write_lost_in_flight_is_reported_not_repeated(pg_url: URL, admin: Connection) -> None:
    """The backend dies while an append is on its way: the caller gets WriteOutcomeUnknownError
    (it may have landed), the store does not send it again, and keeps working."""
    store = SessionDB(url_string(pg_url))
    try:
        store.create_session("s", "cli")
        killer = Killer(store, admin)
        killer.arm("before_statement")
        with pytest.raises(WriteOutcomeUnknownError, match="may have landed"):
            store.append_message("s", "user", "in flight")
        assert killer.fired
        killer.arm("")
        assert store.message_count("s") == 0  # the backend died before it read the request
        assert store.append_message("s", "user", "after") > 0
        assert [m["content"] for m in store.get_messages("s")] == ["after"]
    finally:
        store.close()
