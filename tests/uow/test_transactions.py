"""``db.transaction()``: calls composed into one unit, on SQLite and PostgreSQL.

One BEGIN, one commit, everything rolled back on an exception; nesting and calls inside
``uow.session()``/``uow.connect()`` join the open unit; another thread's call is never swallowed
into it; waiting for the lock at BEGIN is retried while a lock met inside the block rolls it
back and raises DatabaseLockedError; reads inside see the unit's writes; a write inside a
read-only unit is refused.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection

from hermes_store import (
    ChatSession,
    DatabaseLockedError,
    ReadOnlyUnitError,
    RetryPolicy,
    SessionDB,
    TransactionMisuseError,
)
from hermes_store.uow import writequeue
from tests.support.backends import is_sqlite, url_string
from tests.support.queue_workers import starve

FAST_RETRY = RetryPolicy(attempts=400, min_wait=0.002, max_wait=0.005)
TIMEOUT = 60  # a deadlock guard only


def _outside(url: URL) -> sa.Engine:
    """A plain engine (no hooks) that sees only committed rows."""
    return sa.create_engine(url_string(url), poolclass=sa.pool.NullPool)


def _committed_sessions(url: URL) -> list[str]:
    engine = _outside(url)
    try:
        with engine.connect() as conn:
            return list(conn.scalars(sa.text("SELECT id FROM sessions ORDER BY id")))
    finally:
        engine.dispose()


def _committed_messages(url: URL) -> list[str]:
    engine = _outside(url)
    try:
        with engine.connect() as conn:
            return list(conn.scalars(sa.text("SELECT content FROM messages ORDER BY id")))
    finally:
        engine.dispose()


def test_calls_inside_commit_together_in_one_unit(store: SessionDB, db_url: URL) -> None:
    before = store.stats()
    with store.transaction():
        store.create_session("t", "cli")
        store.append_message("t", "user", "first")
        store.append_message("t", "assistant", "second")
        store.update_token_counts("t", input_tokens=3)
        store.set_session_title("t", "Composed")
        assert _committed_sessions(db_url) == []  # nothing is visible before the commit
    after = store.stats()
    assert after.write_units - before.write_units == 1  # one unit, however many calls
    assert after.transactions - before.transactions == 1
    assert _committed_sessions(db_url) == ["t"]
    assert _committed_messages(db_url) == ["first", "second"]
    session = store.get_session("t")
    assert session is not None
    assert session["message_count"] == 2 and session["input_tokens"] == 3
    assert session["title"] == "Composed"


def test_an_exception_rolls_back_every_call(store: SessionDB, db_url: URL) -> None:
    store.create_session("kept", "cli")
    with pytest.raises(RuntimeError, match="changed my mind"), store.transaction():
        store.create_session("t", "cli")
        store.append_message("t", "user", "gone")
        store.append_message("kept", "user", "gone too")
        store.update_token_counts("kept", input_tokens=9)
        raise RuntimeError("changed my mind")
    assert _committed_sessions(db_url) == ["kept"]
    assert _committed_messages(db_url) == []
    kept = store.get_session("kept")
    assert kept is not None and kept["message_count"] == 0 and kept["input_tokens"] == 0
    assert store.stats().rollbacks >= 1
    # The store goes on working.
    store.append_message("kept", "user", "after")
    assert store.message_count("kept") == 1


def test_nested_blocks_join_the_outer_unit(store: SessionDB, db_url: URL) -> None:
    with store.transaction() as outer:
        store.create_session("t", "cli")
        with store.transaction() as inner:  # joins: no second BEGIN, no deadlock
            assert inner is outer
            store.append_message("t", "user", "inner")
        assert _committed_messages(db_url) == []  # the inner block did not commit
    assert _committed_messages(db_url) == ["inner"]
    with pytest.raises(ValueError), store.transaction():
        with store.transaction():
            store.append_message("t", "user", "rolled back with the outer block")
        raise ValueError("outer fails")
    assert _committed_messages(db_url) == ["inner"]


def test_calls_inside_uow_session_and_connect_join_them(store: SessionDB, db_url: URL) -> None:
    with store.uow.session() as s:
        s.add(ChatSession(id="orm", source="cli", started_at=1.0))
        s.flush()
        store.append_message("orm", "user", "joined the ORM unit")  # sees the flushed row
        assert store.message_count("orm") == 1
        assert _committed_sessions(db_url) == []
    assert _committed_sessions(db_url) == ["orm"]
    with store.uow.connect() as conn:
        conn.execute(
            sa.text("INSERT INTO sessions (id, source, started_at) VALUES ('core', 'cli', 2)")
        )
        store.append_message("core", "user", "joined the Core unit")
    assert store.message_count("core") == 1
    with pytest.raises(KeyError), store.uow.connect() as conn:
        store.create_session("lost", "cli")
        raise KeyError("abort")
    assert store.get_session("lost") is None


def test_reads_inside_see_the_units_writes(store: SessionDB) -> None:
    with store.transaction():
        store.create_session("t", "cli", model="m")
        store.append_message("t", "user", "hello zebrafinch")
        store.set_session_title("t", "Visible inside")
        assert store.get_session("t") is not None
        assert store.get_session_title("t") == "Visible inside"
        assert store.message_count("t") == 1 and store.message_count() == 1
        assert [m["content"] for m in store.get_messages("t")] == ["hello zebrafinch"]
        assert [row["id"] for row in store.list_sessions_rich()] == ["t"]
        assert [hit["session_id"] for hit in store.search_messages("zebrafinch")] == ["t"]
        assert store.export_session("t") is not None

        seen: dict[str, Any] = {}

        def other_thread() -> None:  # not in the unit: sees committed rows only
            seen["session"] = store.get_session("t")
            seen["count"] = store.message_count()

        reader = threading.Thread(target=other_thread)
        reader.start()
        reader.join(TIMEOUT)
        assert seen == {"session": None, "count": 0}


def test_another_threads_call_is_not_swallowed(store: SessionDB, db_url: URL) -> None:
    """A call from another thread while a block is open lands in a unit of its own: the block's
    rollback does not take it along."""
    store.create_session("s", "cli")
    store.create_session("b", "cli")  # the block's own row: no row lock in the other's way
    started = threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        started.set()
        try:
            store.append_message("s", "user", "from the other thread")
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=other)
    with pytest.raises(RuntimeError), store.transaction():
        store.append_message("b", "user", "from the block")
        thread.start()
        assert started.wait(TIMEOUT)
        if is_sqlite(db_url):
            # It queues for the file's write turn (held by this block) ...
            assert store.uow.wait_for_waiting_writers(1, TIMEOUT)
        else:
            # ... or, on PostgreSQL, commits on a connection of its own meanwhile.
            thread.join(TIMEOUT)
            assert _committed_messages(db_url) == ["from the other thread"]
        raise RuntimeError("roll the block back")
    thread.join(TIMEOUT)
    assert not thread.is_alive() and errors == []
    assert _committed_messages(db_url) == ["from the other thread"]
    if is_sqlite(db_url):
        assert store.stats().lock_waits >= 1


def test_every_unit_begins_through_the_one_begin(store: SessionDB, db_url: URL) -> None:
    """Connection units fire the engine's begin event once per unit (never again for calls
    joined into a block; PostgreSQL's one-statement writes outside a block begin nothing,
    they run in autocommit); the SQLite hot path begins on the driver through the same begin
    function: the write lock is taken up front, with the writer's busy timeout."""
    begins: list[bool] = []

    @event.listens_for(store.engine, "begin")
    def _count(conn: Connection) -> None:
        begins.append(True)

    # PostgreSQL runs a one-statement write outside a block in autocommit: no BEGIN at all.
    units = 2 if is_sqlite(db_url) else 0
    try:
        store.create_session("s", "cli")
        store.end_session("s", "done")
        assert len(begins) == units
        with store.transaction():
            store.reopen_session("s")
            store.append_message("s", "user", "three")
            store.update_token_counts("s", input_tokens=1)
        assert len(begins) == units + 1
    finally:
        event.remove(store.engine, "begin", _count)
    if is_sqlite(db_url):
        path = Path(db_url.database or "")

        def inside(cursor: Any) -> tuple[bool, int]:
            blocked = _other_writer_blocked(path)
            return blocked, cursor.execute("PRAGMA busy_timeout").fetchone()[0]

        # Alone, the hot path asks SQLite for the lock without waiting (busy timeout 0): taken,
        # the write would join the line instead.
        assert store.uow.run_driver(inside) == (True, 0)
        # In line (behind a head that marked the line starving), the head of the writer queue
        # asks without waiting too: it polls, and its writer knows it writes into a WAL.
        queue = store.uow.write_queue
        assert queue is not None
        with writequeue.WriteQueue(path).turn() as turn:  # another member of the line
            assert turn.queued
            starve(turn)
            issued = queue.tickets()[0]
            found: list[tuple[bool, int]] = []
            behind = threading.Thread(target=lambda: found.append(store.uow.run_driver(inside)))
            behind.start()
            deadline = time.monotonic() + TIMEOUT
            while queue.tickets()[0] == issued:  # until it stands in line behind
                assert time.monotonic() < deadline
                time.sleep(0.005)
        behind.join(TIMEOUT)
        assert found == [(True, 0)]
        assert queue.stats().turns >= 1
        store.append_message("s", "user", "hot")  # and the hot path's own units still commit
        assert store.message_count("s") == 2


def _other_writer_blocked(path: Path) -> bool:
    raw = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        raw.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError:
        return True
    else:
        raw.execute("ROLLBACK")
        return False
    finally:
        raw.close()


def test_write_inside_a_read_only_unit_is_refused(store: SessionDB, db_url: URL) -> None:
    store.create_session("s", "cli")
    refused = pytest.raises(ReadOnlyUnitError, match="read-only unit")
    with refused, store.uow.connect(write=False):
        store.append_message("s", "user", "refused")
    with refused, store.uow.connect(write=False):
        store.create_session("t", "cli")
    # Raw SQL too: the database itself refuses it (SQLite query_only, PostgreSQL READ ONLY).
    with pytest.raises(ReadOnlyUnitError), store.uow.connect(write=False) as conn:
        conn.execute(
            sa.text("INSERT INTO sessions (id, source, started_at) VALUES ('raw', 'cli', 0)")
        )
    assert _committed_sessions(db_url) == ["s"]
    assert _committed_messages(db_url) == []
    # Reads inside a read unit work, and the pooled connection writes again afterwards.
    with store.uow.connect(write=False):
        assert store.get_session("s") is not None
    store.append_message("s", "user", "fine")
    assert store.message_count("s") == 1


# -- locks -----------------------------------------------------------------------------------


@pytest.fixture
def busy_signal() -> Iterator[threading.Event]:
    """Set when the Unit of Work logs that it met a busy database and will retry."""
    seen = threading.Event()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "busy" in record.getMessage():
                seen.set()

    logger = logging.getLogger("hermes_store.uow")
    handler, level = Handler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_waiting_for_the_lock_at_begin_is_retried(
    tmp_path: Path, busy_signal: threading.Event
) -> None:
    """Another connection holds the write lock far past the writer's busy timeout: the block
    waits (BEGIN is retried, nothing ran yet), then runs exactly once and commits."""
    path = tmp_path / "state.db"
    store = SessionDB(path, retry=FAST_RETRY, writer_busy_timeout=0.01)
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        store.create_session("s", "cli")
        blocker.execute("BEGIN IMMEDIATE")
        runs: list[int] = []
        errors: list[BaseException] = []

        def block() -> None:
            try:
                with store.transaction():
                    runs.append(1)
                    store.append_message("s", "user", "after the wait")
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=block)
        thread.start()
        assert busy_signal.wait(TIMEOUT), "the block never met the lock"
        assert runs == []  # it has not started: it is still waiting at BEGIN
        blocker.execute("COMMIT")
        thread.join(TIMEOUT)
        assert errors == [] and runs == [1]
        assert store.message_count("s") == 1
        assert store.stats().retries >= 1
    finally:
        blocker.close()
        store.close()


def _sqlite_busy(path: Path) -> sa.exc.OperationalError:
    """A real SQLITE_BUSY (one connection holds the lock, another wants it), wrapped."""
    holder = sqlite3.connect(path, isolation_level=None)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError) as raised:
            other.execute("BEGIN IMMEDIATE")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        other.close()
    return sa.exc.OperationalError("BEGIN IMMEDIATE", None, raised.value)


def test_a_lock_met_inside_the_block_rolls_it_back_and_raises(
    sqlite_store: SessionDB, tmp_path: Path
) -> None:
    busy = _sqlite_busy(tmp_path / "other.db")
    runs: list[int] = []
    locked = pytest.raises(DatabaseLockedError, match="inside a transaction")
    with locked, sqlite_store.transaction():
        runs.append(1)
        sqlite_store.create_session("t", "cli")
        raise busy
    assert runs == [1]  # run once, never re-run
    assert sqlite_store.get_session("t") is None


def test_pg_serialization_failure_inside_the_block_rolls_back_and_raises(pg_url: URL) -> None:
    """A real 40001: the block's snapshot is older than a row another transaction changed."""
    store = SessionDB(url_string(pg_url))
    raw = psycopg.connect(
        pg_url.set(drivername="postgresql").render_as_string(hide_password=False), autocommit=True
    )
    try:
        store.create_session("s", "cli")
        runs: list[int] = []
        locked = pytest.raises(DatabaseLockedError, match="inside a transaction")
        with locked, store.transaction() as conn:
            runs.append(1)
            conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            store.create_session("t", "cli")
            assert store.get_session("s") is not None  # the snapshot is taken
            raw.execute("UPDATE sessions SET input_tokens = 5 WHERE id = 's'")
            store.update_token_counts("s", input_tokens=1)  # 40001 here
        assert runs == [1]
        assert store.get_session("t") is None
        session = store.get_session("s")
        assert session is not None and session["input_tokens"] == 5
    finally:
        raw.close()
        store.close()


def test_a_block_left_open_by_a_thread_that_ended_is_named_not_waited_for(
    db_url: URL,
) -> None:
    """A generator that opened a block in a thread that then ended, kept unfinished, holds
    the file's writer (SQLite) or the session row's lock (PostgreSQL): a later write of the
    process waited for it forever. It is refused at once, naming the thread; closing the
    generator rolls the block back and frees the writer and the row."""
    with SessionDB(db_url) as db:
        db.create_session("s", "cli")

        def held() -> Iterator[None]:
            with db.transaction():
                db.append_message("s", "user", "in the block")
                yield

        kept: list[Iterator[None]] = []
        opener = threading.Thread(target=lambda: kept.append(g := held()) or next(g))
        opener.start()
        opener.join()
        with pytest.raises(TransactionMisuseError, match="has ended"):
            db.append_message("s", "user", "after")
        kept[0].close()  # type: ignore[attr-defined]  # the block is rolled back
        db.append_message("s", "user", "after")
        assert [m["content"] for m in db.get_messages("s")] == ["after"]
