"""Writes held up behind a row lock on PostgreSQL, for group commit and interrupt tests.

The test's own transaction locks a session's row (:class:`RowLock`): a first append to it
waits, in flight, and the calls started after it queue behind it in the store's group commit
(:func:`queued_behind_a_locked_write`). Every wait is on a condition: the server's
``pg_stat_activity`` says when the write waits for the lock, the store's counters when the
others have queued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB
from tests.support.backends import url_string
from tests.support.waiting import GUARD


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


def waiting_writer(admin: Connection, besides: int) -> int:
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


def call_in_thread(outcomes: dict[str, Any], name: str, fn: Callable[[], Any]) -> threading.Thread:
    """Run ``fn`` in a thread of its own; its result (or error) lands in ``outcomes[name]``."""

    def run() -> None:
        try:
            outcomes[name] = fn()
        except Exception as error:
            outcomes[name] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread


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
    """Sessions "s" and "t" on ``url``; a first append to "s" waiting for a row lock taken
    through ``direct`` (never a pooler), and each of ``later`` queued behind it."""
    stores = [SessionDB(url_string(url)) for _ in range(1 + len(later))]
    first = stores[0]
    lock: RowLock | None = None
    try:
        for session in ("s", "t"):
            first.create_session(session, "cli")
        lock = RowLock(direct, "s")
        outcomes: dict[str, Any] = {}
        threads = [
            call_in_thread(outcomes, "first", lambda: first.append_message("s", "user", "first"))
        ]
        waiting = waiting_writer(admin, lock.pid)
        for store, (name, fn) in zip(stores[1:], later.items(), strict=True):
            threads.append(call_in_thread(outcomes, name, lambda fn=fn, store=store: fn(store)))
        assert first.uow.wait_for_queued_units(len(later), GUARD)
        yield Scene(stores, lock, threads, waiting, outcomes)
    finally:
        if lock is not None:
            lock.release()
        for store in stores:
            store.close()
