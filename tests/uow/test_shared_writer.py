"""One writer per process and file; hooks on any engine; fork safety; ``synchronous``; stats.

Stores on one SQLite file in one process share an engine, a writer connection and the write
lock; they must agree on their options. An Engine passed in gets the store's hooks (or is
refused clearly). A forked child never uses its parent's connections or locks.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from hermes_store import (
    EngineSettingsError,
    InvalidInputError,
    RetryPolicy,
    SessionDB,
    SharedStoreMismatchError,
    UnsupportedEngineError,
)
from hermes_store.engine.factory import install_sqlite_hooks
from hermes_store.uow import shared
from tests.support.backends import is_sqlite, url_string

TIMEOUT = 120  # deadlock guards only


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


def _other_writer_blocked(path: Path) -> bool:
    """Whether a second connection cannot take the write lock right now."""
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


# -- one writer per file ---------------------------------------------------------------------


def test_stores_on_one_file_share_one_writer(path: Path, tmp_path: Path) -> None:
    first = SessionDB(path)
    (tmp_path / "alias").symlink_to(tmp_path)
    second = SessionDB(tmp_path / "alias" / "state.db")  # the same file by another name
    try:
        assert second.uow is first.uow and second.engine is first.engine
        assert shared.open_files() == 1
        first.create_session("s", "cli")
        second.append_message("s", "user", "through the second")
        first.close()
        # The other store keeps working: reads, writes, transactions.
        second.append_message("s", "user", "after the first closed")
        with second.transaction():
            second.update_token_counts("s", input_tokens=2)
        assert second.message_count("s") == 2
        assert shared.open_files() == 1
    finally:
        first.close()
        second.close()
    assert shared.open_files() == 0
    assert first.engine.pool.checkedout() == 0  # the last close released every connection
    reopened = SessionDB(path)
    try:
        assert reopened.uow is not first.uow
        assert reopened.message_count("s") == 2
    finally:
        reopened.close()


def test_a_block_opened_through_one_store_is_joined_by_another(path: Path) -> None:
    first, second = SessionDB(path), SessionDB(path)
    try:
        first.create_session("s", "cli")
        with first.transaction():
            second.append_message("s", "user", "joined")  # same thread: no self-deadlock
            assert first.message_count("s") == 1
        with pytest.raises(RuntimeError), first.transaction():
            second.append_message("s", "user", "rolled back")
            raise RuntimeError
        assert second.message_count("s") == 1
    finally:
        first.close()
        second.close()


def test_threads_of_two_stores_queue_on_one_lock_not_in_sqlite(path: Path) -> None:
    """Writers of one process never meet inside SQLite's busy handler: no retry is needed,
    however many threads write through however many stores."""
    stores = [SessionDB(path), SessionDB(path)]
    try:
        stores[0].create_session("s", "cli")
        errors: list[BaseException] = []

        def work(store: SessionDB, thread: int) -> None:
            try:
                for op in range(20):
                    store.append_message("s", "user", f"t{thread}-{op}")
                    store.update_token_counts("s", input_tokens=1)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=work, args=(stores[t % 2], t)) for t in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert errors == []
        session = stores[1].get_session("s")
        assert session is not None
        assert session["message_count"] == 120 and session["input_tokens"] == 120
        stats = stores[0].stats()
        assert stats.retries == 0
        assert stats.write_units == 1 + 240
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"synchronous": "normal"}, "synchronous"),
        ({"retry": RetryPolicy(attempts=3)}, "retry"),
        ({"checkpoint_every": 7}, "checkpoint_every"),
        ({"writer_busy_timeout": 0.25}, "writer_busy_timeout"),
    ],
)
def test_a_second_store_with_other_options_is_refused(
    path: Path, options: dict[str, Any], named: str
) -> None:
    first = SessionDB(path)
    try:
        with pytest.raises(SharedStoreMismatchError, match=named):
            SessionDB(path, **options)
        first.create_session("s", "cli")  # the first is untouched
        assert shared.open_files() == 1
    finally:
        first.close()
    again = SessionDB(path, **options)  # alone, the same options are fine
    again.close()


def test_a_store_through_another_engine_on_an_open_file_is_refused(path: Path) -> None:
    first = SessionDB(path)
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        with pytest.raises(SharedStoreMismatchError, match="different Engine"):
            SessionDB(engine)
    finally:
        first.close()
        engine.dispose()


# -- synchronous and stats -------------------------------------------------------------------


@pytest.mark.parametrize(("given", "pragma"), [(None, 2), ("full", 2), ("normal", 1)])
def test_synchronous_mode(path: Path, given: str | None, pragma: int) -> None:
    store = SessionDB(path) if given is None else SessionDB(path, synchronous=given)
    try:
        with store.uow.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == pragma
        with store.uow.connect(write=False) as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == pragma
    finally:
        store.close()


def test_a_bad_synchronous_mode_is_refused_before_anything_is_written(path: Path) -> None:
    with pytest.raises(InvalidInputError, match="synchronous"):
        SessionDB(path, synchronous="off")
    assert not path.exists()


def test_stats_count_units_waits_and_retries(path: Path) -> None:
    store = SessionDB(path)
    try:
        store.create_session("s", "cli")
        store.append_message("s", "user", "x")
        store.get_session("s")
        store.get_messages("s")
        stats = store.stats()
        assert stats.write_units == 2 and stats.read_units >= 2
        assert stats.lock_waits == 0 and stats.retries == 0
        with store.transaction():
            waiter = threading.Thread(target=store.append_message, args=("s", "user", "y"))
            waiter.start()
            assert store.uow.wait_for_waiting_writers(1, TIMEOUT)
        waiter.join(TIMEOUT)
        stats = store.stats()
        assert stats.lock_waits == 1 and stats.transactions == 1 and stats.write_units == 4
    finally:
        store.close()


# -- an Engine passed in ---------------------------------------------------------------------


def test_an_engine_passed_in_gets_the_hooks(db_url: URL) -> None:
    """Even connections already in its pool (connected before the hooks) begin write units
    with the lock taken up front and carry the store's per-connection settings."""
    engine = sa.create_engine(url_string(db_url))
    with engine.connect() as conn:  # a pooled connection that predates the hooks
        conn.exec_driver_sql("SELECT 1")
    store = SessionDB(engine)
    try:
        store.create_session("s", "cli")
        store.append_message("s", "user", "hello")
        with store.transaction() as conn:
            store.append_message("s", "user", "inside")
            if is_sqlite(db_url):
                assert _other_writer_blocked(Path(db_url.database or ""))
                # The writer queue's head asks without waiting (it polls): its writer has
                # committed into the WAL already.
                assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 0
                assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert store.message_count("s") == 2
        again = SessionDB(engine)  # the same engine again: hooked once, shared
        try:
            if is_sqlite(db_url):
                assert again.uow is store.uow
            assert again.message_count("s") == 2
        finally:
            again.close()
    finally:
        store.close()
    with engine.connect() as conn:  # the store does not dispose an engine it was given
        assert conn.exec_driver_sql("SELECT count(*) FROM messages").scalar() == 2
    engine.dispose()


def test_engines_the_hooks_cannot_make_safe_are_refused(path: Path) -> None:
    SessionDB(path).close()
    autocommit = sa.create_engine(f"sqlite:///{path}", isolation_level="AUTOCOMMIT")
    with pytest.raises(UnsupportedEngineError, match="AUTOCOMMIT"):
        SessionDB(autocommit)
    autocommit.dispose()
    hooked = sa.create_engine(f"sqlite:///{path}")
    store = SessionDB(hooked)
    try:
        install_sqlite_hooks(hooked)  # the same settings: idempotent
        with pytest.raises(EngineSettingsError, match="other settings"):
            install_sqlite_hooks(hooked, writer_busy_timeout=3)
    finally:
        store.close()
        hooked.dispose()


# -- fork ------------------------------------------------------------------------------------


def _child_writes(store: SessionDB, parent_writer: int, out: Any) -> None:
    """In a forked child: write and read through the store inherited from the parent."""
    try:
        store.append_message("s", "user", "from the child")
        with store.transaction():
            store.update_token_counts("s", input_tokens=1)
        fresh_writer = id(store.uow.backend.writer.connection) != parent_writer
        opened = SessionDB(store.db_path)  # a new store in the child shares the child's writer
        try:
            same = opened.uow is store.uow
            contents = [m["content"] for m in opened.get_messages("s")]
        finally:
            opened.close()
        out.send(("ok", (same, fresh_writer), contents))
    except BaseException as error:
        out.send(("error", repr(error), []))
    finally:
        store.close()


@pytest.fixture
def fork_context() -> Iterator[Any]:
    yield multiprocessing.get_context("fork")


def test_a_forked_child_never_uses_the_parents_connections_or_locks(
    path: Path, fork_context: Any
) -> None:
    """The child is forked after the parent has a writer and a read connection open: they
    are closed before the fork (SQLite's lock records must not reach the child), the child
    writes through connections of its own and the parent reopens its own lazily. Forked
    while a parent thread holds the file's write turn, the child does not deadlock on the
    inherited lock: it is refused the file (the writer could not be closed), and the parent
    goes on.
    """
    store = SessionDB(path)
    store.create_session("s", "cli")
    store.append_message("s", "user", "from the parent")
    store.get_session("s")  # the main thread holds a read connection too
    writer = store.uow.backend.writer.connection  # kept alive: its id stays its own
    parent_writer = id(writer)
    holding, release = threading.Event(), threading.Event()

    def hold_the_turn() -> None:
        with store.uow.backend.writer.turn():
            holding.set()
            release.wait(TIMEOUT)

    def fork_child() -> tuple[str, Any, list[str]]:
        receive, send = fork_context.Pipe(duplex=False)
        child = fork_context.Process(target=_child_writes, args=(store, parent_writer, send))
        child.start()
        send.close()
        assert receive.poll(TIMEOUT), "the child never reported (deadlocked?)"
        report: tuple[str, Any, list[str]] = receive.recv()
        child.join(TIMEOUT)
        assert child.exitcode == 0
        return report

    thread = threading.Thread(target=hold_the_turn)
    thread.start()
    try:
        assert holding.wait(TIMEOUT)
        status, checks, _contents = fork_child()
        assert status == "error" and "ForkedProcessError" in checks
        release.set()
        thread.join(TIMEOUT)
        status, checks, contents = fork_child()
        assert status == "ok", checks
        assert checks == (True, True)  # one writer shared in the child, not the parent's
        assert sorted(contents) == ["from the child", "from the parent"]
        # The parent's store is untouched by the child's close and goes on working.
        store.append_message("s", "user", "parent again")
        session = store.get_session("s")
        assert session is not None
        assert session["message_count"] == 3 and session["input_tokens"] == 1
    finally:
        release.set()
        thread.join(TIMEOUT)
        store.close()
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        raw.close()
