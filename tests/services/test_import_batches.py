"""How an import goes batch by batch, and what the SQLite bulk path does around the batches.

What must hold: batches land whole and in file order; an invalid record stops the import with
exactly the batches before its own committed (nothing of its own batch, valid records
included); a batch that fails to write stops the reading; on PostgreSQL the rows go in through
``COPY``, never as INSERT statements. On SQLite each batch reaches the full-text index in id
order, FTS5's automerge is off while the batches go in, one merge follows them, and the
table's settings are put back (after a failure too); the next batch is read while one is
indexed.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from hermes_store import SessionDB, transfer
from hermes_store.errors import InvalidInputError
from hermes_store.ops import maintenance
from hermes_store.schema import ddl, fulltext
from tests.support import import_workers as workers

BOTH = pytest.mark.parametrize("backend", ["sqlite", "postgresql"])


def counted(records: list[dict[str, Any]], taken: list[int]) -> Iterator[tuple[int, Any]]:
    """(line, record) of each, noting in ``taken`` how many the import has taken so far."""
    for line, record in enumerate(records, 1):
        taken[0] = line
        yield line, record


@BOTH
def test_an_invalid_record_leaves_exactly_the_batches_before_its_own(store: SessionDB) -> None:
    """Batches of 3 sessions; the 8th record is invalid: the first two batches (6 sessions)
    are in, the 7th session (valid, in the invalid one's batch) is not."""
    records = workers.export_records(sessions=12, per_session=4)
    del records[7]["messages"][2]["role"]
    taken = [0]
    with pytest.raises(InvalidInputError, match=r"line 8, message 2: role is required"):
        transfer.import_sessions(store, counted(records, taken), batch_size=3)
    assert {s["id"] for s in store.search_sessions(limit=100)} == {r["id"] for r in records[:6]}
    assert store.message_count() == 24
    for record in records[:6]:
        exported = store.export_session(record["id"])
        assert exported is not None
        assert exported["messages"] == record["messages"]
    assert taken[0] == 8  # nothing read past the invalid record


@BOTH
def test_a_batch_that_fails_to_write_stops_the_reading(
    store: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second batch's write fails: the first batch stays, the second is rolled back, and
    the reader stopped within the batches it may hold ahead (not the whole file)."""
    records = workers.export_records(sessions=40, per_session=3)
    real = transfer._write_batch
    writes = [0]

    def failing(conn: Any, batch: Any, pending: Any, *rest: Any) -> Any:
        writes[0] += 1
        outcome = real(conn, batch, pending, *rest)
        if writes[0] == 2:
            raise transfer.ImportCheckError("the second batch disagrees")
        return outcome

    monkeypatch.setattr(transfer, "_write_batch", failing)
    taken = [0]
    with pytest.raises(transfer.ImportCheckError, match="second batch"):
        transfer.import_sessions(store, counted(records, taken), batch_size=2)
    assert {s["id"] for s in store.search_sessions(limit=100)} == {r["id"] for r in records[:2]}
    assert store.message_count() == 6
    # nothing read past the batch that failed, but (SQLite) the one read ahead meanwhile
    assert taken[0] in ((4, 6) if store.is_sqlite else (4,))


def test_sqlite_indexes_each_batch_in_id_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newest-first file's batch reaches the full-text index in ascending ids (FTS5 starts a
    new segment at every lower rowid): the rows handed to the index are sorted."""
    records = workers.export_records(sessions=9, per_session=5)
    seen: list[list[int]] = []
    real = fulltext.SQLITE.unindexed

    def spy(conn: Any, rows: Any) -> list[str]:
        seen.append([row[0] for row in rows])
        return real(conn, rows)

    monkeypatch.setattr(fulltext.SQLITE, "unindexed", spy)
    with SessionDB(tmp_path / "state.db") as store:
        transfer.import_sessions(store, enumerate(records, 1), batch_size=3)
        assert [m["id"] for r in store.iter_export() for m in r["messages"]] == [
            m["id"] for r in records for m in r["messages"]
        ]
    assert len(seen) == 3
    assert all(ids == sorted(ids) and len(ids) == 15 for ids in seen)


def test_sqlite_reads_the_next_batch_while_this_one_is_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch after the first is read (in the reader thread) before the batch ahead of it
    commits: its first record is taken while that batch's unit is still open, once its rows
    are in and the index statements run. Each unit waits, before it ends, for the reader to
    take the next batch's first record; reading after the commit (or in this thread) would
    never let it."""
    records = workers.export_records(sessions=12, per_session=3)
    firsts = {line: threading.Event() for line in (4, 7, 10)}  # batches of 3 sessions
    readers: dict[int, str] = {}

    def source() -> Iterator[tuple[int, Any]]:
        for line, record in enumerate(records, 1):
            if line in firsts:
                readers[line] = threading.current_thread().name
                firsts[line].set()
            yield line, record

    real = transfer._write_batch
    waited: list[bool] = []

    def spy(conn: Any, batch: list[Any], pending: Any, *rest: Any) -> Any:
        outcome = real(conn, batch, pending, *rest)
        following = batch[-1].line + 1
        if following in firsts:
            waited.append(firsts[following].wait(timeout=30))
        return outcome

    monkeypatch.setattr(transfer, "_write_batch", spy)
    with SessionDB(tmp_path / "state.db") as store:
        report = transfer.import_sessions(store, source(), batch_size=3)
        assert (report.sessions, report.messages) == (12, 36)
    assert waited == [True, True, True]
    assert set(readers.values()) == {"hermes-store-import-reader"}


@pytest.mark.parametrize("backend", ["postgresql"])
def test_postgresql_imports_through_copy(store: SessionDB) -> None:
    """Sessions and messages (kept and renumbered ids alike) go in by ``COPY``: no INSERT
    statement reaches the server through SQLAlchemy's cursor."""
    from sqlalchemy import event

    store.create_session("local", "cli")
    store.append_message("local", "user", "holds message id 1")
    records = workers.export_records(sessions=6, per_session=4)
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", seen)
    try:
        report = transfer.import_sessions(store, enumerate(records, 1), batch_size=4)
    finally:
        event.remove(store.engine, "before_cursor_execute", seen)
    assert (report.sessions, report.messages, report.messages_renumbered) == (6, 24, 1)
    assert [s for s in statements if s.lstrip().upper().startswith("INSERT")] == []
    for record in records:
        exported = store.export_session(record["id"])
        assert exported is not None
        assert [m["content"] for m in exported["messages"]] == [
            m["content"] for m in record["messages"]
        ]


def fts5_settings(conn: Any) -> dict[str, dict[str, int]]:
    return {
        table: {
            str(k): int(v)
            for k, v in conn.exec_driver_sql(
                f"SELECT k, v FROM {table}_config WHERE k IN ('automerge', 'crisismerge')"
            )
        }
        for table in (ddl.FTS_TABLE, ddl.CJK_TABLE)
    }


@pytest.mark.parametrize("fail", [False, True])
def test_sqlite_batches_go_in_without_automerge_then_one_merge_and_the_settings_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    """While the batches are written FTS5's automerge is off (crisis merges far off); after
    them one merge leaves no level with ``usermerge`` (4) segments, and the table's settings
    are what they were (FTS5's defaults), also when the import fails midway."""
    records = workers.export_records(sessions=30, per_session=4)
    during: list[dict[str, dict[str, int]]] = []
    real = transfer._write_batch

    def spy(conn: Any, batch: Any, pending: Any, *rest: Any) -> Any:
        during.append(fts5_settings(conn))
        if fail and len(during) == 20:
            raise transfer.ImportCheckError("the twentieth batch disagrees")
        return real(conn, batch, pending, *rest)

    monkeypatch.setattr(transfer, "_write_batch", spy)
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        if fail:
            with pytest.raises(transfer.ImportCheckError):
                transfer.import_sessions(store, enumerate(records, 1), batch_size=1)
        else:
            transfer.import_sessions(store, enumerate(records, 1), batch_size=1)
        assert during and all(
            settings == {table: maintenance.JOB_FTS5_SETTINGS for table in settings}
            for settings in during
        )
        after = store.uow.run(fts5_settings, write=False)
        assert after == {
            table: maintenance.FTS5_DEFAULT_SETTINGS for table in (ddl.FTS_TABLE, ddl.CJK_TABLE)
        }
        shape = store.uow.run(fulltext.structure, write=False)
        assert shape is not None
        if not fail:  # 30 batches made 30 segments or more: merged as automerge would
            assert shape.segments <= 3 * shape.levels
        assert store.message_count() == (19 if fail else 30) * 4
    assert index_problems(path) == []


def index_problems(path: Path) -> list[str]:
    """FTS5's integrity check of both indexes."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        return fulltext.index_damage(conn)


@BOTH
@pytest.mark.parametrize("batch_size", [1, 2, 100])
def test_titles_held_twice_land_the_same_whatever_the_batch_size(
    store: SessionDB, batch_size: int
) -> None:
    """A title is kept by the first session of the file that has it, later ones are cleared
    and counted, as when another session of the database holds it; titles compare exactly,
    as the unique index does ("Plan" and "plan" are two titles). A skipped session (its id
    already imported) never holds a title."""
    store.create_session("local", "cli")
    store.set_session_title("local", "Held")
    titled = [
        ("a", "Plan"),
        ("b", "Plan"),
        ("c", "plan"),
        ("d", "Held"),
        ("a", "Other"),  # skipped: "a" is in
        ("e", "Other"),
        ("f", "Plan"),
        ("g", None),
    ]
    records: list[dict[str, Any]] = [
        {"id": sid, "source": "cli", "started_at": 1.7e9 + n, "title": title, "messages": []}
        for n, (sid, title) in enumerate(titled)
    ]
    report = transfer.import_sessions(store, enumerate(records, 1), batch_size=batch_size)
    assert (report.sessions, report.sessions_skipped, report.titles_cleared) == (7, 1, 3)
    stored = {sid: store.get_session_title(sid) for sid in ("a", "b", "c", "d", "e", "f", "g")}
    assert stored == {
        "a": "Plan",
        "b": None,
        "c": "plan",
        "d": None,
        "e": "Other",
        "f": None,
        "g": None,
    }
    assert store.get_session_title("local") == "Held"
