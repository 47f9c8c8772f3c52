"""Opening a damaged database at head: repaired from the data under the write lock (with a
WARNING saying what was repaired), or refused clearly; a sound database opens without the lock.

Damage is done for real with raw SQL on real databases: the FTS table or a trigger dropped,
the original's ``schema_version`` row set back, a column dropped, PostgreSQL's tsvector and
GIN index dropped.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import DatabaseLockedError, SessionDB
from hermes_store.errors import UnrecognizedSchemaError
from hermes_store.schema import ddl, migrate
from tests.support.backends import run_sql, url_string

WARNED = "hermes_store.schema.migrate"


def _populated(path: Path) -> None:
    store = SessionDB(path)
    store.create_session("s", "cli")
    store.append_messages("s", [{"role": "user", "content": f"zebra number {i}"} for i in range(5)])
    store.close()


def _raw(path: Path, *statements: str) -> None:
    con = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in statements:
            con.execute(statement)
    finally:
        con.close()


def _sqlite_sound(path: Path) -> None:
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        con.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")
        assert con.execute("SELECT version FROM schema_version").fetchall() == [(6,)]
        names = {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='trigger'")}
        assert set(ddl.FTS_TRIGGERS) <= names
    finally:
        con.close()


def _repair_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == WARNED and r.levelno == logging.WARNING and "repaired" in r.getMessage()
    ]


def _holding_write_lock(path: Path) -> sqlite3.Connection:
    blocker = sqlite3.connect(path, isolation_level=None, timeout=5)
    blocker.execute("BEGIN IMMEDIATE")
    return blocker


@pytest.mark.parametrize(
    ("damage", "writable"),
    [
        (("DROP TABLE messages_fts",), False),  # every append raised "no such table"
        (("DROP TRIGGER messages_fts_insert",), True),
        ((*(f"DROP TRIGGER {t}" for t in ddl.FTS_TRIGGERS), "DROP TABLE messages_fts"), True),
    ],
    ids=["fts-table", "insert-trigger", "everything"],
)
def test_missing_full_text_objects_are_repaired_on_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: tuple[str, ...], writable: bool
) -> None:
    path = tmp_path / "state.db"
    _populated(path)
    _raw(path, *damage)
    if writable:  # rows written while the index was not kept must be found after the repair
        _raw(
            path,
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "VALUES ('s', 'user', 'zebra written meanwhile', 1)",
        )
    expected = 6 if writable else 5
    caplog.set_level(logging.WARNING, logger=WARNED)
    store = SessionDB(path)
    try:
        [warning] = _repair_warnings(caplog)
        assert "messages_fts" in warning and "rebuilt" in warning
        assert len(store.search_messages("zebra", limit=50)) == expected
        store.append_message("s", "assistant", "zebra after the repair")
        assert len(store.search_messages("zebra", limit=50)) == expected + 1
        assert store.check_search_index()
    finally:
        store.close()
    _sqlite_sound(path)
    caplog.clear()
    blocker = _holding_write_lock(path)
    try:  # repaired for good: the next open reads only, so another writer cannot stall it
        SessionDB(path, writer_busy_timeout=0.05).close()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert _repair_warnings(caplog) == []


@pytest.mark.parametrize("version", [3, None])
def test_stale_schema_version_at_head_is_fixed_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, version: int | None
) -> None:
    """Alembic at head and every column present: the marker is rewritten, once."""
    path = tmp_path / "state.db"
    _populated(path)
    _raw(path, "DELETE FROM schema_version")
    if version is not None:
        _raw(path, f"INSERT INTO schema_version (version) VALUES ({version})")
    caplog.set_level(logging.WARNING, logger=WARNED)
    SessionDB(path).close()
    [warning] = _repair_warnings(caplog)
    assert f"schema_version from {version} to 6" in warning
    _sqlite_sound(path)
    caplog.clear()
    blocker = _holding_write_lock(path)
    try:  # before the fix every open took the migration path and queued for this lock
        SessionDB(path, writer_busy_timeout=0.05).close()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert _repair_warnings(caplog) == []


def test_sound_database_opens_without_the_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _populated(path)
    blocker = _holding_write_lock(path)
    try:
        store = SessionDB(path, writer_busy_timeout=0.05)
        assert len(store.search_messages("zebra")) == 5
        store.close()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


def test_damaged_database_waits_for_the_lock_to_repair(tmp_path: Path) -> None:
    """The repair is a write: with another writer holding the lock it fails as locked (and
    changes nothing), then succeeds once the lock is free."""
    path = tmp_path / "state.db"
    _populated(path)
    _raw(path, "DROP TABLE messages_fts")
    blocker = _holding_write_lock(path)
    try:
        with pytest.raises(DatabaseLockedError):
            SessionDB(path, writer_busy_timeout=0.05)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    store = SessionDB(path)
    try:
        assert len(store.search_messages("zebra")) == 5
    finally:
        store.close()


def test_missing_column_at_head_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _populated(path)
    _raw(path, "ALTER TABLE messages DROP COLUMN reasoning_details")
    before = path.read_bytes()
    with pytest.raises(UnrecognizedSchemaError, match=r"lacks columns \['reasoning_details'\]"):
        SessionDB(path)
    assert path.read_bytes() == before


# -- PostgreSQL ----------------------------------------------------------------------------------


def _pg_indexes(url: URL) -> set[str]:
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return set(
                conn.execute(
                    sa.text("SELECT indexname FROM pg_indexes WHERE tablename = 'messages'")
                ).scalars()
            )
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "damage",
    [
        (f"DROP INDEX {ddl.PG_FTS_INDEX}",),
        (f"ALTER TABLE messages DROP COLUMN {ddl.PG_TSV_COLUMN}",),
        ("UPDATE schema_version SET version = 3",),
    ],
    ids=["gin-index", "tsvector-column", "schema-version"],
)
def test_pg_damage_is_repaired_on_open(
    pg_url: URL, caplog: pytest.LogCaptureFixture, damage: tuple[str, ...]
) -> None:
    url = url_string(pg_url)
    store = SessionDB(url)
    store.create_session("s", "cli")
    store.append_message("s", "user", "zebra crossing")
    store.close()
    run_sql(pg_url, *damage)
    caplog.set_level(logging.WARNING, logger=WARNED)
    store = SessionDB(url)
    try:
        assert len(_repair_warnings(caplog)) == 1
        [hit] = store.search_messages("zebra")
        assert hit["snippet"] == ">>>zebra<<< crossing"
        store.append_message("s", "user", "zebra again")
        assert len(store.search_messages("zebra")) == 2
    finally:
        store.close()
    assert ddl.PG_FTS_INDEX in _pg_indexes(pg_url)
    assert migrate.current(url) == migrate.head_revision()
    caplog.clear()
    SessionDB(url).close()
    assert _repair_warnings(caplog) == []


def test_pg_missing_column_at_head_is_refused(pg_url: URL) -> None:
    run_sql(pg_url, "ALTER TABLE sessions DROP COLUMN billing_mode")
    with pytest.raises(UnrecognizedSchemaError, match="billing_mode"):
        SessionDB(url_string(pg_url))
