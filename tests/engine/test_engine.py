"""The engine factory and its SQLite hooks: pragmas, per-transaction BEGIN mode, WAL fallback."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from hermes_store import SessionDB, UnitOfWork, create_engine, default_db_path
from hermes_store.engine.factory import to_url


@pytest.fixture
def uow(tmp_path: Path) -> Iterator[UnitOfWork]:
    SessionDB(tmp_path / "state.db").close()  # a database at head
    engine = create_engine(tmp_path / "state.db")
    yield UnitOfWork(engine)
    engine.dispose()


def _other_writer_blocked(path: Path) -> bool:
    """Whether a second connection cannot take the write lock right now."""
    raw = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        raw.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as error:
        assert "locked" in str(error)
        return True
    else:
        raw.execute("ROLLBACK")
        return False
    finally:
        raw.close()


def test_write_units_take_the_lock_at_begin_and_reads_do_not(
    uow: UnitOfWork, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    with uow.connect(write=True) as conn:
        assert conn.connection.driver_connection.in_transaction  # type: ignore[union-attr]
        assert _other_writer_blocked(path)  # before the unit ran a single statement
    assert not _other_writer_blocked(path)
    with uow.connect(write=False) as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM sessions").scalar() == 0
        assert not _other_writer_blocked(path)  # a reader never holds the write lock


def test_connection_pragmas_per_unit_kind(uow: UnitOfWork) -> None:
    with uow.connect(write=True) as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        # The head of the writer queue polls the lock without waiting (WAL mode).
        head_ms = 0 if uow.write_queue else 1000
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == head_ms
    with uow.connect(write=False) as conn:  # the same pooled connection, now a reader
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000


def test_wal_refused_falls_back_to_delete_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "nfs-like.db"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE t (x)")
    raw.commit()
    raw.close()
    # The dot-file locking VFS has no shared memory, as on many network file systems. A URL
    # naming it is refused; an engine the application built with it is its own choice.
    engine: Engine = create_engine(
        sa.create_engine(f"sqlite:///file:{path}?vfs=unix-dotfile&uri=true")
    )
    try:
        with (
            caplog.at_level(logging.WARNING, logger="hermes_store.engine.factory"),
            engine.connect() as conn,
        ):
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "delete"
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")
            conn.commit()
        assert any("refuses WAL" in record.getMessage() for record in caplog.records)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM t").scalar() == 1
    finally:
        engine.dispose()


def test_urls_and_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert to_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert to_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"
    relative = to_url("some/state.db")
    assert relative.drivername == "sqlite" and Path(relative.database or "").is_absolute()
    monkeypatch.setenv("HERMES_HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / "state.db"
    monkeypatch.delenv("HERMES_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_db_path() == tmp_path / ".hermes" / "state.db"


def test_session_db_default_path_is_resolved_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_HOME", str(tmp_path / "agent"))
    db = SessionDB()
    try:
        db.create_session("s", "cli")
    finally:
        db.close()
    assert (tmp_path / "agent" / "state.db").stat().st_mode & 0o777 == 0o600
