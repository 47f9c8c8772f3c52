"""Faults: a writer killed mid-transaction, read-only files and folders, a full disk, files that
are not databases, and a PostgreSQL server that drops the store's connections.

Read-only cases run the store in a child process that drops root privileges to ``nobody``
(as root, ``chmod`` alone does not stop writes); a full disk is simulated with
``PRAGMA max_page_count`` set on every connection by an engine ``connect`` event.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import NullPool

from hermes_store import (
    DatabaseUnavailableError,
    HermesStoreError,
    InvalidInputError,
    NotADatabaseError,
    ReadOnlyDatabaseError,
    SessionDB,
    StorageFullError,
    create_engine,
)
from hermes_store.engine.factory import sqlite_file
from hermes_store.search.pipeline import check_index
from tests.support import proc_workers
from tests.support.backends import url_string

COMMITTED = 30


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sqlite_is_sound(path: Path) -> None:
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        # Raises (SQLITE_CORRUPT_VTAB) when the FTS index and the messages table disagree.
        raw.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES ('integrity-check', 1)")
        assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        raw.close()


# -- a writer killed in the middle of a transaction --------------------------------------------


@pytest.mark.slow
def test_sigkill_mid_transaction_leaves_every_committed_row(db_url: URL) -> None:
    _kill_mid_unit_and_check(db_url, "unit")


@pytest.mark.slow
def test_sigkill_inside_the_hot_path_unit(tmp_path: Path) -> None:
    """The same inside ``run_driver``, the SQLite hot path that ``append_message`` takes."""
    path = tmp_path / "state.db"
    SessionDB(path).close()
    _kill_mid_unit_and_check(sa.make_url(f"sqlite:///{path}"), "driver")


def _kill_mid_unit_and_check(db_url: URL, mode: str) -> None:
    url = url_string(db_url)
    proc, ready = proc_workers.spawn(proc_workers.die_inside_a_unit, url, COMMITTED, mode)
    try:
        assert ready.wait(timeout=120), "the writer never reached the middle of its unit"
        assert proc.is_alive()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL

    path = sqlite_file(db_url)
    if path is not None:
        _sqlite_is_sound(path)
    store = SessionDB(url)
    try:
        session = store.get_session("victim")
        assert session is not None
        assert session["message_count"] == COMMITTED
        contents = [m["content"] for m in store.get_messages("victim")]
        assert contents == [f"committed {i} durable" for i in range(COMMITTED)]
        assert store.search_messages("ghost") == []  # the index holds nothing uncommitted
        assert len(store.search_messages("durable", limit=100)) == COMMITTED
        # The next writer proceeds (the dead process's lock went with it).
        store.append_message("victim", "user", "after the crash")
        store.update_token_counts("victim", input_tokens=3)
        session = store.get_session("victim")
        assert session is not None
        assert session["message_count"] == COMMITTED + 1 and session["input_tokens"] == 3
        with store.uow.connect(write=True) as conn:
            assert check_index(conn)
    finally:
        store.close()
    if path is not None:
        _sqlite_is_sound(path)


# -- read-only files and folders ----------------------------------------------------------------


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder every user can reach (pytest's tmp_path sits under a 0700 folder)."""
    folder = Path(tempfile.mkdtemp(prefix="hermes-ro-"))
    folder.chmod(0o755)
    yield folder
    for root, dirs, _files in os.walk(folder):
        for name in dirs:
            (Path(root) / name).chmod(0o755)
    shutil.rmtree(folder, ignore_errors=True)


def _probe_as_nobody(path: Path) -> dict[str, str]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=proc_workers.drop_privileges_and_probe, args=(str(path), out))
    proc.start()
    try:
        report: dict[str, str] = out.get(timeout=120)
    except queue.Empty:
        report = {"probe": "no report"}
    proc.join(timeout=30)
    return report


@pytest.mark.parametrize("read_only", ["file", "folder"])
def test_read_only_database_refuses_writes_clearly_and_serves_reads(
    open_folder: Path, read_only: str
) -> None:
    """Root ignores permissions, so the store runs in a child that becomes ``nobody``: the
    file (0444 in a writable folder) or its folder (0555, the file itself 0666) is read-only."""
    folder = open_folder / "data"
    path = folder / "state.db"
    store = SessionDB(path)
    store.create_session("a", "cli")
    store.append_message("a", "user", "hello from before")
    store.close()
    if read_only == "file":
        path.chmod(0o444)
        folder.chmod(0o777)
    else:
        path.chmod(0o666)
        folder.chmod(0o555)
    before = _sha256(path)

    report = _probe_as_nobody(path)

    folder.chmod(0o755)
    if os.geteuid() == 0:
        assert report["uid"] == "65534"
    assert report.get("open") is None, report
    assert report["get_session"] == "ok 1", report
    assert report["get_messages"] == "ok ['hello from before']", report
    assert report["search"] == "ok 1", report
    assert report["list"] == "ok ['a']", report
    for write in ("append_message", "create_session", "update_token_counts", "set_session_title"):
        assert report[write].startswith("raised ReadOnlyDatabaseError"), report
        assert "refuses writes" in report[write] or "read" in report[write].lower()
    assert report["get_after"] == "ok 0", report  # still readable after the refusals
    assert not report["close"].startswith("RAW"), report
    assert _sha256(path) == before


def test_read_only_uri_refuses_writes_and_serves_reads(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SessionDB(path)
    store.create_session("a", "cli")
    store.append_message("a", "user", "hello")
    store.close()
    before = _sha256(path)
    store = SessionDB(f"sqlite:///file:{path}?mode=ro&uri=true")
    try:
        assert [m["content"] for m in store.get_messages("a")] == ["hello"]
        with pytest.raises(ReadOnlyDatabaseError):
            store.append_message("a", "user", "refused")
        with pytest.raises(ReadOnlyDatabaseError):
            store.create_session("b", "cli")
        assert store.message_count() == 1 and store.session_count() == 1
    finally:
        store.close()
    assert _sha256(path) == before


def test_a_sqlite_argument_that_would_be_ignored_is_refused(tmp_path: Path) -> None:
    """``sqlite:////path?mode=ro`` is no SQLite URI: SQLAlchemy dropped ``mode`` with a
    warning, and the store wrote into the file its caller asked to read only."""
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("a", "cli")
    before = _sha256(path)
    for query in ("mode=ro", "immutable=1&mode=ro", "cache=shared"):
        with pytest.raises(InvalidInputError, match="would be ignored"):
            SessionDB(f"sqlite:///{path}?{query}")
    assert _sha256(path) == before
    with SessionDB(f"sqlite:///{path}?timeout=5") as store:  # one the dialect takes
        assert store.session_count() == 1


# -- a full disk --------------------------------------------------------------------------------


def test_full_disk_raises_storage_full_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    seed = SessionDB(path)
    seed.create_session("s", "cli")
    seed.append_messages("s", [{"role": "user", "content": f"before {i}"} for i in range(5)])
    seed.close()
    raw = sqlite3.connect(path)
    pages = raw.execute("PRAGMA page_count").fetchone()[0]
    raw.close()
    limit = pages + 8  # room for small writes, none for a large one

    engine = create_engine(path)

    @event.listens_for(engine, "connect")
    def _cap(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.execute(f"PRAGMA max_page_count = {limit}")

    store = SessionDB(engine)
    big = "overflowing " * 40_000  # ~480 KB: far more than 8 pages
    try:
        with pytest.raises(StorageFullError) as raised:
            store.append_message("s", "user", big)
        assert isinstance(raised.value, HermesStoreError)
        with pytest.raises(StorageFullError):
            store.append_messages(
                "s", [{"role": "user", "content": f"{big} {i}"} for i in range(3)]
            )
        with pytest.raises(StorageFullError):
            store.update_system_prompt("s", big)
        session = store.get_session("s")
        assert session is not None
        assert session["message_count"] == store.message_count("s") == 5
        assert session["system_prompt"] is None
        assert store.search_messages("overflowing") == []
        # Small writes still fit: the store recovered from the failed transactions.
        store.append_message("s", "user", "small after full")
        assert store.message_count("s") == 6
    finally:
        store.close()
        engine.dispose()
    _sqlite_is_sound(path)


# -- files that are not databases ---------------------------------------------------------------

NOT_DATABASES = {
    "text": b"these are my notes, not a database\n" * 200,
    "empty": b"",
    "random": bytes(range(256)) * 64,
    "sqlite header then garbage": b"SQLite format 3\x00" + b"\xff" * 8000,
}


@pytest.mark.parametrize("kind", sorted(NOT_DATABASES))
def test_not_a_database_is_refused_and_never_modified(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(NOT_DATABASES[kind])
    before = _sha256(path)
    with pytest.raises(NotADatabaseError) as raised:
        SessionDB(path)
    assert str(path) in str(raised.value)
    assert _sha256(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.db"]  # no -wal/-shm/-journal


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.1, 4096, 100])
def test_truncated_database_is_refused_and_never_modified(tmp_path: Path, keep: float) -> None:
    full = tmp_path / "full.db"
    store = SessionDB(full)
    store.create_session("a", "cli")
    store.append_messages(
        "a", [{"role": "user", "content": f"message {i} " + "word " * 40} for i in range(1500)]
    )
    store.close()
    data = full.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else int(keep)
    path = tmp_path / "truncated" / "state.db"
    path.parent.mkdir()
    path.write_bytes(data[:cut])
    before = _sha256(path)
    with pytest.raises(HermesStoreError):
        opened = SessionDB(path)
        try:  # should it open at all, every use must fail clearly (and write nothing)
            opened.get_messages("a")
            opened.append_message("a", "user", "must not land")
        finally:
            opened.close()
    assert _sha256(path) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.db"]


# -- PostgreSQL: the server drops the store's connections ---------------------------------------


def _terminate_other_backends(url: URL) -> int:
    """What a server restart does to the store: every other connection to its database ends."""
    admin = sa.create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            killed = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
    finally:
        admin.dispose()
    return int(killed)


def _call_or_unavailable(fn: Any) -> str:
    try:
        fn()
    except DatabaseUnavailableError:
        return "unavailable"
    return "ok"


def test_pg_connections_terminated_between_calls(pg_url: URL) -> None:
    store = SessionDB(url_string(pg_url))
    try:
        store.create_session("s", "cli")
        for index in range(3):
            store.append_message("s", "user", f"before {index}")
        assert _terminate_other_backends(pg_url) >= 1
        # Pre-ping notices the dead pooled connection and reconnects (or the call says so).
        first = _call_or_unavailable(lambda: store.append_message("s", "user", "after"))
        store.append_message("s", "user", "recovered")  # the following call always works
        expected = 5 if first == "ok" else 4
        session = store.get_session("s")
        assert session is not None
        assert session["message_count"] == store.message_count("s") == expected
        assert _call_or_unavailable(lambda: store.search_messages("recovered")) == "ok"
    finally:
        store.close()


def test_pg_connection_killed_inside_a_unit_is_a_clear_error_with_nothing_written(
    pg_url: URL,
) -> None:
    store = SessionDB(url_string(pg_url))
    try:
        store.create_session("s", "cli")
        store.append_message("s", "user", "kept")

        def unit(conn: Connection) -> None:
            conn.execute(
                sa.text(
                    "INSERT INTO messages (session_id, role, content, timestamp) "
                    "VALUES ('s', 'user', 'lost with the connection', 0)"
                )
            )
            _terminate_other_backends(pg_url)  # the server ends this very transaction
            conn.execute(sa.text("SELECT 1"))

        with pytest.raises(DatabaseUnavailableError, match="connection"):
            store.uow.run(unit)
        # The store recovers on the next call; the half-done unit left nothing behind.
        assert [m["content"] for m in store.get_messages("s")] == ["kept"]
        store.append_message("s", "user", "next")
        session = store.get_session("s")
        assert session is not None and session["message_count"] == 2
    finally:
        store.close()
