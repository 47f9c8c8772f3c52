"""The Unit of Work under contention: lock retries, non-retryable errors, exhaustion, reads that
never take the write lock, checkpoint cadence, and many processes x threads on one database.

Locks are forced for real: a second raw ``sqlite3`` connection holding ``BEGIN IMMEDIATE``, or two
PostgreSQL connections that deadlock. Worker processes use the ``spawn`` start method.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection

from hermes_store import (
    DatabaseLockedError,
    HermesStoreError,
    RetryPolicy,
    SessionDB,
    UnitOfWork,
)
from hermes_store.errors import WriteRefusedError, is_retryable
from tests.support import proc_workers
from tests.support.backends import url_string
from tests.support.proc_workers import Shape

FAST_RETRY = RetryPolicy(attempts=400, min_wait=0.002, max_wait=0.005)
SHORT_RETRY = RetryPolicy(attempts=3, min_wait=0.001, max_wait=0.002)


@pytest.fixture
def db_file(tmp_path: Path) -> Path:
    path = tmp_path / "state.db"
    SessionDB(path).close()
    return path


@pytest.fixture
def blocker(db_file: Path) -> Iterator[sqlite3.Connection]:
    """A second raw connection, to hold the write lock (``BEGIN IMMEDIATE``) when told."""
    conn = sqlite3.connect(db_file, isolation_level=None, check_same_thread=False, timeout=5)
    yield conn
    if conn.in_transaction:
        conn.execute("ROLLBACK")
    conn.close()


def _retry_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name.startswith("hermes_store.uow.") and "busy" in r.message
    ]


# -- SQLite: a forced lock -----------------------------------------------------------------------


@pytest.mark.parametrize("call", ["append_message", "update_token_counts", "create_session"])
def test_forced_lock_is_retried_then_succeeds(
    db_file: Path,
    blocker: sqlite3.Connection,
    caplog: pytest.LogCaptureFixture,
    call: str,
) -> None:
    """The lock outlasts the writer's busy timeout many times over: only retries can succeed."""
    caplog.set_level(logging.DEBUG, logger="hermes_store.uow")
    store = SessionDB(db_file, retry=FAST_RETRY, writer_busy_timeout=0.01)
    try:
        store.create_session("s", "cli")
        blocker.execute("BEGIN IMMEDIATE")
        release = threading.Timer(0.3, lambda: blocker.execute("COMMIT"))
        release.start()
        try:
            if call == "append_message":
                store.append_message("s", "user", "after the lock")
            elif call == "update_token_counts":
                store.update_token_counts("s", input_tokens=7)
            else:
                store.create_session("t", "cli")
        finally:
            release.join()
        assert _retry_records(caplog), "the unit should have met the lock and retried"
        session = store.get_session("s")
        assert session is not None
        if call == "append_message":
            assert store.message_count("s") == 1 and session["message_count"] == 1
        elif call == "update_token_counts":
            assert session["input_tokens"] == 7
        else:
            assert store.get_session("t") is not None
    finally:
        store.close()


def test_exhaustion_raises_database_locked_with_nothing_written(
    db_file: Path, blocker: sqlite3.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="hermes_store.uow")
    store = SessionDB(db_file, retry=SHORT_RETRY, writer_busy_timeout=0.01)
    try:
        store.create_session("s", "cli")
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(DatabaseLockedError, match="locked") as raised:
            store.append_message("s", "user", "never written")
        assert isinstance(raised.value, HermesStoreError)
        assert len(_retry_records(caplog)) == SHORT_RETRY.attempts - 1  # 3 attempts, 2 pauses
        caplog.clear()
        with pytest.raises(DatabaseLockedError):
            store.update_token_counts("s", input_tokens=5)
        assert len(_retry_records(caplog)) == SHORT_RETRY.attempts - 1
        blocker.execute("ROLLBACK")
        session = store.get_session("s")
        assert session is not None
        assert session["message_count"] == 0 and session["input_tokens"] == 0
        assert store.message_count() == 0
        # The store is not left broken: the next write goes through.
        store.append_message("s", "user", "now")
        assert store.message_count("s") == 1
    finally:
        store.close()


def test_reads_do_not_take_the_write_lock(db_file: Path, blocker: sqlite3.Connection) -> None:
    """Every read succeeds while another connection holds BEGIN IMMEDIATE and has uncommitted
    rows; the lock is only released after the reads (a read that queued would fail)."""
    store = SessionDB(db_file, retry=SHORT_RETRY, writer_busy_timeout=0.01)
    try:
        store.create_session("s", "cli")
        store.append_message("s", "user", "committed hello")
        blocker.execute("BEGIN IMMEDIATE")
        blocker.execute(
            "INSERT INTO sessions (id, source, started_at) VALUES ('uncommitted', 'x', 0)"
        )
        assert store.get_session("s") is not None
        assert store.get_session("uncommitted") is None  # not visible: still uncommitted
        assert [m["content"] for m in store.get_messages("s")] == ["committed hello"]
        assert store.message_count() == 1 and store.session_count() == 1
        assert store.resolve_session_id("s") == "s"
        assert [row["id"] for row in store.search_sessions()] == ["s"]
        assert [row["id"] for row in store.list_sessions_rich()] == ["s"]
        assert [row["id"] for row in store.search_messages("hello")] != []
        assert len(store.export_all()) == 1
        # ...while a write, meanwhile, cannot get in.
        with pytest.raises(DatabaseLockedError):
            store.append_message("s", "user", "blocked")
        blocker.execute("COMMIT")
        assert store.get_session("uncommitted") is not None
    finally:
        store.close()


# -- which errors are retried --------------------------------------------------------------------


def _locked_error(path: Path) -> sa.exc.OperationalError:
    """A real SQLITE_BUSY from sqlite3 (one connection holds the lock, another wants it),
    wrapped the way SQLAlchemy wraps it."""
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
    assert raised.value.sqlite_errorcode & 0xFF == 5  # SQLITE_BUSY
    return sa.exc.OperationalError("BEGIN IMMEDIATE", None, raised.value)


def test_lock_error_inside_a_unit_reruns_the_whole_unit(
    sqlite_store: SessionDB, tmp_path: Path
) -> None:
    calls: list[int] = []
    busy = _locked_error(tmp_path / "other.db")

    def unit(conn: Connection) -> str:
        calls.append(1)
        conn.exec_driver_sql(
            "INSERT INTO sessions (id, source, started_at) VALUES (?, 'cli', 0)",
            (f"attempt-{len(calls)}",),
        )
        if len(calls) == 1:
            raise busy  # rolled back, then the unit runs again from scratch
        return "done"

    assert sqlite_store.uow.run(unit) == "done"
    assert len(calls) == 2
    assert sqlite_store.get_session("attempt-1") is None  # the first attempt was rolled back
    assert sqlite_store.get_session("attempt-2") is not None


def test_non_lock_error_is_not_retried(store: SessionDB) -> None:
    """A constraint's refusal (NOT NULL) propagates at once, as the package's WriteRefusedError:
    exactly one attempt, nothing written."""
    calls: list[int] = []

    def unit(conn: Connection) -> None:
        calls.append(1)
        conn.execute(sa.text("INSERT INTO sessions (id, source, started_at) VALUES ('n', NULL, 0)"))

    with pytest.raises(WriteRefusedError, match=r"(?i)not[ -]null"):
        store.uow.run(unit)
    assert len(calls) == 1
    assert store.get_session("n") is None


def test_non_lock_error_on_the_hot_path_is_not_retried(sqlite_store: SessionDB) -> None:
    calls: list[int] = []

    def unit(cursor: Any) -> None:
        calls.append(1)
        cursor.execute("INSERT INTO sessions (id, source, started_at) VALUES ('n', NULL, 0)")

    with pytest.raises(WriteRefusedError, match="NOT NULL"):
        sqlite_store.uow.run_driver(unit)
    assert len(calls) == 1
    assert sqlite_store.get_session("n") is None
    # The hot path's connection is usable afterwards.
    sqlite_store.create_session("s", "cli")
    sqlite_store.append_message("s", "user", "fine")
    assert sqlite_store.message_count("s") == 1


def test_lock_error_on_the_hot_path_reruns_the_unit(
    sqlite_store: SessionDB, tmp_path: Path
) -> None:
    calls: list[int] = []
    busy = _locked_error(tmp_path / "other.db")

    def unit(cursor: Any) -> int:
        calls.append(1)
        cursor.execute(
            "INSERT INTO sessions (id, source, started_at) VALUES (?, 'cli', 0)",
            (f"attempt-{len(calls)}",),
        )
        if len(calls) == 1:
            raise busy
        return len(calls)

    assert sqlite_store.uow.run_driver(unit) == 2
    assert sqlite_store.get_session("attempt-1") is None
    assert sqlite_store.get_session("attempt-2") is not None


def test_an_unknown_session_is_not_retried_and_writes_nothing(store: SessionDB) -> None:
    with pytest.raises(HermesStoreError):
        store.append_message("nobody", "user", "x")
    assert store.message_count() == 0 and store.uow.writes == 0


# -- checkpoints ---------------------------------------------------------------------------------


def test_checkpoint_cadence(db_file: Path) -> None:
    store = SessionDB(db_file, checkpoint_every=3)
    try:
        store.create_session("s", "cli")  # write 1
        for index in range(6):  # writes 2..7: checkpoints after 3 and 6
            store.append_message("s", "user", f"m{index}")
        assert store.uow.writes == 7
        assert store.uow.checkpoints == 2
        store.get_messages("s")  # reads never count
        assert store.uow.writes == 7 and store.uow.checkpoints == 2
        store.update_token_counts("s", input_tokens=1)  # write 8
        store.end_session("s", "user_exit")  # write 9: the third checkpoint
        assert store.uow.checkpoints == 3
    finally:
        store.close()
    never = SessionDB(db_file, checkpoint_every=0)
    try:
        for index in range(5):
            never.append_message("s", "user", f"n{index}")
        assert never.uow.checkpoints == 0
    finally:
        never.close()


def test_failing_checkpoint_is_logged_not_raised(
    db_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An authorizer denies the checkpoint pragma: a real driver error, which must stay quiet."""
    store = SessionDB(db_file, checkpoint_every=2)

    def deny_checkpoint(action: int, arg1: str | None, *_: object) -> int:
        if action == sqlite3.SQLITE_PRAGMA and arg1 == "wal_checkpoint":
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    @event.listens_for(store.engine, "connect")
    def _deny(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.set_authorizer(deny_checkpoint)

    store.engine.dispose()  # every connection from now on carries the authorizer
    caplog.set_level(logging.WARNING, logger="hermes_store.uow")
    try:
        store.create_session("s", "cli")
        for index in range(5):
            store.append_message("s", "user", f"m{index}")
        assert store.uow.writes == 6
        assert store.uow.checkpoints == 0
        failures = [r for r in caplog.records if "checkpoint failed" in r.message]
        assert len(failures) == 3
        assert store.message_count("s") == 5
    finally:
        store.close()  # its checkpoint fails too, quietly


# -- many threads of one process -----------------------------------------------------------------


def test_threads_share_one_store(store: SessionDB) -> None:
    store.create_session("shared", "cli")
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for op in range(25):
                store.append_message("shared", "user", f"t{thread}-{op}")
                store.update_token_counts("shared", input_tokens=1, output_tokens=2)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    session = store.get_session("shared")
    assert session is not None
    assert session["message_count"] == store.message_count("shared") == 200
    assert session["input_tokens"] == 200 and session["output_tokens"] == 400
    assert len({m["content"] for m in store.get_messages("shared")}) == 200


# -- many processes x threads --------------------------------------------------------------------

PROCESSES = 6
SHAPE = Shape(threads=8, ops=8, own_sessions=False)  # per process: 64 appends + 64 increments


@pytest.mark.slow
def test_processes_and_threads_append_and_increment_exactly(db_url: URL) -> None:
    url = url_string(db_url)
    store = SessionDB(url)
    try:
        store.create_session("shared", "cli")
        errors, _ = proc_workers.run(url, writers=PROCESSES, readers=0, shape=SHAPE)
        assert errors == []
        total = PROCESSES * SHAPE.threads * SHAPE.ops
        session = store.get_session("shared")
        assert session is not None
        assert session["message_count"] == total
        assert store.message_count("shared") == total
        assert session["input_tokens"] == total
        assert session["output_tokens"] == 2 * total
        assert session["estimated_cost_usd"] == pytest.approx(0.5 * total)
        contents = [m["content"] for m in store.get_messages("shared")]
        assert len(set(contents)) == total  # no unit ran twice after committing
    finally:
        store.close()


# -- PostgreSQL: deadlocks and serialization failures are retried --------------------------------


def _pg_raw(url: URL) -> psycopg.Connection[Any]:
    return psycopg.connect(url.set(drivername="postgresql").render_as_string(hide_password=False))


def test_pg_real_deadlock_and_serialization_errors_are_retryable(pg_url: URL) -> None:
    db_url = pg_url
    store = SessionDB(url_string(db_url))
    store.create_session("a", "x")
    store.create_session("b", "x")
    store.close()
    first, second = _pg_raw(db_url), _pg_raw(db_url)
    try:
        # 40P01: each holds one row and wants the other's.
        for conn in (first, second):
            conn.execute("SET deadlock_timeout = '50ms'")
        first.execute("UPDATE sessions SET input_tokens = 1 WHERE id = 'a'")
        second.execute("UPDATE sessions SET input_tokens = 1 WHERE id = 'b'")
        failures: list[BaseException] = []

        def cross(conn: psycopg.Connection[Any], row: str) -> None:
            try:
                conn.execute("UPDATE sessions SET input_tokens = 2 WHERE id = %s", (row,))
            except psycopg.Error as error:
                failures.append(error)
                conn.rollback()

        thread = threading.Thread(target=cross, args=(first, "b"))
        thread.start()
        cross(second, "a")
        thread.join()
        assert len(failures) == 1
        deadlock = failures[0]
        assert getattr(deadlock, "sqlstate", None) == "40P01"
        assert is_retryable(deadlock)
        assert is_retryable(sa.exc.OperationalError("UPDATE", None, deadlock))  # type: ignore[arg-type]
        first.rollback()
        second.rollback()
        # 40001: a repeatable-read transaction updates a row changed since its snapshot.
        first.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        first.execute("SELECT input_tokens FROM sessions WHERE id = 'a'").fetchone()
        second.execute("UPDATE sessions SET input_tokens = 9 WHERE id = 'a'")
        second.commit()
        with pytest.raises(psycopg.errors.SerializationFailure) as raised:
            first.execute("UPDATE sessions SET input_tokens = 10 WHERE id = 'a'")
        assert raised.value.sqlstate == "40001"
        assert is_retryable(raised.value)
        first.rollback()
        # And a plain constraint error is not.
        with pytest.raises(psycopg.errors.NotNullViolation) as not_null:
            first.execute("INSERT INTO sessions (id, source, started_at) VALUES ('n', NULL, 0)")
        assert not is_retryable(not_null.value)
        first.rollback()
    finally:
        first.close()
        second.close()


def test_pg_deadlocked_unit_is_rerun_and_both_units_commit(pg_url: URL) -> None:
    """Two units lock two rows in opposite orders; the server kills one (40P01), the Unit of
    Work re-runs it whole, and both increments land exactly once."""
    store = SessionDB(url_string(pg_url), retry=FAST_RETRY)
    try:
        store.create_session("a", "x")
        store.create_session("b", "x")
        both_hold_one = threading.Barrier(2, timeout=10)
        attempts: list[str] = []
        errors: list[BaseException] = []

        def unit(order: tuple[str, str]) -> Callable[[Connection], None]:
            def run(conn: Connection) -> None:
                attempts.append(order[0])
                conn.exec_driver_sql("SET LOCAL deadlock_timeout = '50ms'")
                bump = sa.text("UPDATE sessions SET input_tokens = input_tokens + 1 WHERE id = :id")
                conn.execute(bump, {"id": order[0]})
                if attempts.count(order[0]) == 1:  # only the first attempts meet
                    both_hold_one.wait()
                conn.execute(bump, {"id": order[1]})

            return run

        def worker(order: tuple[str, str]) -> None:
            try:
                store.uow.run(unit(order))
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(o,)) for o in (("a", "b"), ("b", "a"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(attempts) == 3  # two first attempts, one re-run of the deadlock victim
        for row in ("a", "b"):
            session = store.get_session(row)
            assert session is not None and session["input_tokens"] == 2
    finally:
        store.close()


def test_uow_is_shared_by_a_store(store: SessionDB) -> None:
    assert isinstance(store.uow, UnitOfWork)
    assert store.uow.retry.attempts == 15
    assert (store.uow.retry.min_wait, store.uow.retry.max_wait) == (0.020, 0.150)


def test_concurrent_bulk_imports_return_their_own_ids(store: SessionDB) -> None:
    """append_messages returns the ids of exactly its rows, even with other writers around."""
    store.create_session("bulk", "cli")
    returned: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for batch in range(3):
                rows = [{"role": "user", "content": f"t{thread}-b{batch}-{i}"} for i in range(40)]
                ids = store.append_messages("bulk", rows)
                returned.setdefault(thread, []).extend(ids)
                store.append_message("bulk", "assistant", f"t{thread}-single-{batch}")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    by_id = {m["id"]: m["content"] for m in store.get_messages("bulk")}
    for thread, ids in returned.items():
        assert [by_id[i] for i in ids] == [
            f"t{thread}-b{batch}-{i}" for batch in range(3) for i in range(40)
        ]
    session = store.get_session("bulk")
    assert session is not None and session["message_count"] == len(by_id) == 4 * 3 * 41


def test_keyset_pages_are_complete_while_a_writer_appends(store: SessionDB) -> None:
    """Paging with ``after_id`` returns every existing message exactly once, in order, even
    with equal timestamps and while another thread keeps appending."""
    store.create_session("paged", "cli")
    rows = [{"role": "user", "content": f"m{i}", "timestamp": 1000.0 + i // 7} for i in range(300)]
    expected = store.append_messages("paged", rows)
    stop = threading.Event()

    def writer() -> None:
        count = 0
        while not stop.is_set() and count < 200:
            store.append_message("paged", "assistant", f"late {count}")
            count += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        seen: list[int] = []
        after: int | None = None
        while True:
            page = store.get_messages("paged", limit=16, after_id=after)
            seen.extend(m["id"] for m in page)
            if len(page) < 16:
                break
            after = page[-1]["id"]
    finally:
        stop.set()
        thread.join()
    assert seen[: len(expected)] == expected  # old rows first (older timestamps), all once
    assert len(seen) == len(set(seen))
    assert [m["id"] for m in store.iter_messages("paged", page_size=7)] == [
        m["id"] for m in store.get_messages("paged")
    ]
