"""Revision ``h10_pg_long_text``: on PostgreSQL its upgrade indexes the long messages already
stored (in batches) and installs the triggers; its downgrade drops the table, functions and
triggers; on SQLite it changes nothing but the version."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB
from hermes_store.schema import ddl, migrate, revisions
from hermes_store.schema import steps as schema_ops
from tests.support.backends import PG_ENV, reset_pg, url_string

REVISION = "h10_pg_long_text"
BEFORE = revisions.REVISIONS[revisions.REVISIONS.index(REVISION) - 1]
FILLER = "filler words " * (ddl.PG_INDEXED_CHARS // 13 + 1000)


@pytest.fixture
def before_url(pg_worker_url: URL | None) -> URL:
    """The worker's PostgreSQL database, empty, at the revision before this one."""
    if pg_worker_url is None:
        pytest.skip(f"PostgreSQL tests need {PG_ENV}")
    reset_pg(pg_worker_url)
    migrate.upgrade(pg_worker_url, BEFORE)
    return pg_worker_url


@pytest.fixture
def plain(before_url: URL) -> Iterator[Engine]:
    engine = sa.create_engine(before_url, poolclass=NullPool)
    yield engine
    engine.dispose()


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> int:
    """The revision's backfill two messages at a time, so a handful of messages takes
    several batches."""
    monkeypatch.setattr(schema_ops, "BACKFILL_BATCH", 2)
    return 2


def _objects(engine: Engine) -> dict[str, list[str]]:
    """The revision's objects present in the database."""
    with engine.connect() as conn:
        return {
            "tables": list(
                conn.execute(
                    sa.text("SELECT tablename FROM pg_tables WHERE tablename = :t"),
                    {"t": ddl.PG_CHUNK_TABLE},
                ).scalars()
            ),
            "functions": sorted(
                conn.execute(
                    sa.text("SELECT proname FROM pg_proc WHERE proname LIKE 'hermes\\_%'")
                ).scalars()
            ),
            "triggers": sorted(
                conn.execute(
                    sa.text(
                        "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"
                        " AND tgrelid = 'messages'::regclass"
                    )
                ).scalars()
            ),
        }


def _chunked(engine: Engine) -> dict[int, list[int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(f"SELECT message_id, chunk_no FROM {ddl.PG_CHUNK_TABLE} ORDER BY 1, 2")
        ).all()
    found: dict[int, list[int]] = {}
    for message_id, chunk_no in rows:
        found.setdefault(int(message_id), []).append(int(chunk_no))
    return found


def test_upgrade_indexes_stored_long_messages_in_batches_and_downgrade_drops(
    before_url: URL, plain: Engine, small_batches: int, caplog: pytest.LogCaptureFixture
) -> None:
    with plain.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO sessions (id, source, started_at) VALUES ('s', 'cli', 1)")
        )
        for n in range(7):
            content = f"{FILLER} tailword{n}" if n % 2 == 0 else f"short message {n}"
            conn.execute(
                sa.text(
                    "INSERT INTO messages (session_id, role, content, timestamp)"
                    " VALUES ('s', 'user', :c, :t)"
                ),
                {"c": content, "t": n},
            )
        long_ids = list(
            conn.execute(
                sa.text("SELECT id FROM messages WHERE content LIKE 'filler%' ORDER BY id")
            ).scalars()
        )
    assert _objects(plain)["tables"] == []
    with caplog.at_level(logging.INFO):
        assert migrate.upgrade(before_url, REVISION) == REVISION
    chunked = _chunked(plain)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("indexed ")]
    counts = [sum(len(chunked[i]) for i in long_ids[:n]) for n in (2, 4)]
    assert progress == [
        f"indexed {n} long messages in {chunks} chunks so far"
        for n, chunks in zip((2, 4), counts, strict=True)
    ]
    assert sorted(chunked) == long_ids
    assert all(
        numbers == list(range(len(numbers))) and len(numbers) > 1 for numbers in chunked.values()
    )
    assert _objects(plain) == {
        "tables": [ddl.PG_CHUNK_TABLE],
        "functions": sorted(
            (ddl.PG_CHUNK_CUT_FUNCTION, ddl.PG_CHUNK_FILL_FUNCTION, ddl.PG_CHUNK_SYNC_FUNCTION)
        ),
        "triggers": sorted(ddl.PG_CHUNK_TRIGGERS),
    }
    with SessionDB(url_string(before_url)) as db:
        with_short = db.append_message("s", "user", "tailword2 in a short one")
        assert {hit["id"] for hit in db.search_messages("tailword2")} == {long_ids[1], with_short}
        assert {hit["id"] for hit in db.search_messages("tailword0")} == {long_ids[0]}

    migrate.downgrade(before_url, BEFORE)
    assert _objects(plain) == {"tables": [], "functions": [], "triggers": []}
    with SessionDB(url_string(before_url), migrate="never") as db:  # writes still work
        db.append_message("s", "user", f"{FILLER} after the downgrade")
    assert migrate.upgrade(before_url) == revisions.HEAD  # and the upgrade runs again
    assert len(_chunked(plain)) == len(long_ids) + 1


def test_the_revision_changes_nothing_but_the_version_on_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    migrate.upgrade(path, BEFORE)
    engine = sa.create_engine(f"sqlite:///{path}", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            before = conn.execute(sa.text("SELECT type, name, sql FROM sqlite_master")).all()
        assert migrate.upgrade(path, REVISION) == REVISION
        with engine.connect() as conn:
            after = conn.execute(sa.text("SELECT type, name, sql FROM sqlite_master")).all()
        assert sorted(map(tuple, after)) == sorted(map(tuple, before))
        migrate.downgrade(path, BEFORE)
        assert migrate.current(path) == BEFORE
    finally:
        engine.dispose()


class _WriteOnFirstBatch(logging.Handler):
    """At the backfill's first progress line, another program commits a long message whose id
    is below the batches' position (its id was taken before the batch passed it)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(logging.INFO)
        self.engine = engine
        self.written = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.written or not record.getMessage().startswith("indexed "):
            return
        self.written = True
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO messages (id, session_id, role, content, timestamp)"
                    " VALUES (1, 's', 'user', :c, 0)"
                ),
                {"c": f"{FILLER} latecomer"},
            )


def test_a_long_message_committed_during_the_backfill_is_indexed(
    before_url: URL, plain: Engine, small_batches: int
) -> None:
    """The first pass runs before the triggers exist (writers are not held up); the second,
    after them, indexes what was committed meanwhile."""
    with plain.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO sessions (id, source, started_at) VALUES ('s', 'cli', 1)")
        )
        for n in range(1001, 1005):
            conn.execute(
                sa.text(
                    "INSERT INTO messages (id, session_id, role, content, timestamp)"
                    " VALUES (:id, 's', 'user', :c, 1)"
                ),
                {"id": n, "c": f"{FILLER} early{n}"},
            )
    handler = _WriteOnFirstBatch(plain)
    logging.getLogger().addHandler(handler)
    previous = logging.getLogger().level
    logging.getLogger().setLevel(logging.INFO)
    try:
        migrate.upgrade(before_url, REVISION)
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger().setLevel(previous)
    assert handler.written
    assert sorted(_chunked(plain)) == [1, 1001, 1002, 1003, 1004]
    with SessionDB(url_string(before_url)) as db:
        assert [hit["id"] for hit in db.search_messages("latecomer")] == [1]


def test_the_check_sees_a_missing_trigger_and_a_rebuild_restores_it(
    pg_worker_url: URL | None,
) -> None:
    """Without its insert trigger the index of long messages silently misses what is written
    since: the index check says so, and a rebuild recreates the trigger and indexes those."""
    if pg_worker_url is None:
        pytest.skip(f"PostgreSQL tests need {PG_ENV}")
    reset_pg(pg_worker_url)
    with SessionDB(url_string(pg_worker_url)) as db:
        db.create_session("s", "cli")
        db.append_message("s", "tool", f"{FILLER} before")
        assert db.check_search_index()
        engine = sa.create_engine(pg_worker_url, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP TRIGGER {ddl.PG_CHUNK_TRIGGERS[0]} ON messages"))
        finally:
            engine.dispose()
        missed = db.append_message("s", "tool", f"{FILLER} unindexedword")
        db.append_message("s", "user", "short unindexedword")
        assert missed not in {hit["id"] for hit in db.search_messages("unindexedword")}
        assert not db.check_search_index()
        db.rebuild_search_index()
        assert db.check_search_index()
        assert missed in {hit["id"] for hit in db.search_messages("unindexedword")}
        later = db.append_message("s", "tool", f"{FILLER} laterword")
        db.append_message("s", "user", "short laterword")
        assert later in {hit["id"] for hit in db.search_messages("laterword")}
