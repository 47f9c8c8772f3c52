"""PostgreSQL backends terminated at every step of a write unit: the caller gets either success
or a package error (never a raw driver error), nothing is half written, and the store keeps
working. Terminations are real (``pg_terminate_backend`` from an admin connection)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import NullPool

from hermes_store import HermesStoreError, SessionDB
from tests.conftest import url_string

STEPS = ("idle", "after_begin", "after_first_statement", "before_commit")


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

    def arm(self, step: str) -> None:
        self.step, self.fired = step, False

    def _fire(self, conn: Connection, step: str) -> None:
        if self.step != step or self.fired:
            return
        self.fired = True
        # The pid the server gave this very connection (libpq's PQbackendPID).
        _terminate(self.admin, conn.connection.driver_connection.info.backend_pid)  # type: ignore[union-attr]

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
