"""Import into SQLite in bulk: the full-text index's insert triggers are suspended for each
batch and its messages indexed in one go, in the batch's own transaction.

What must hold: every id, timestamp, counter and cost lands exactly as exported; both indexes
(FTS5 and the CJK trigram table) end exactly as the triggers would have left them; the
triggers are back, word for word; a process killed in the middle of a batch leaves the file as
the last committed batch left it; and the original store reads and writes the result.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from hermes_store import InvalidInputError, SessionDB, transfer
from hermes_store.schema import fulltext
from tests.support import import_workers as workers
from tests.support.import_workers import index_problems, triggers
from tests.support.seed_store import SeedSessionDB


def import_records(store: SessionDB, records: list[dict[str, Any]], **options: Any) -> Any:
    return transfer.import_sessions(store, enumerate(records, 1), **options)


@pytest.mark.parametrize("json_each", [True, False])
def test_bulk_import_is_exact_and_leaves_both_indexes_as_the_triggers_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, json_each: bool
) -> None:
    """Whether a batch is indexed in one statement over its ids (``json_each``) or row by row
    (a SQLite built without JSON), both indexes end up as the triggers would have left them."""
    if not json_each:
        monkeypatch.setattr(fulltext, "_has_json_each", lambda conn: False)
    records = workers.export_records(sessions=20, per_session=12)
    path = tmp_path / "state.db"
    SessionDB(path).close()
    before = triggers(path)
    with SessionDB(path) as store:
        report = import_records(store, records, batch_size=6)
        assert (report.sessions, report.messages, report.messages_renumbered) == (20, 240, 0)
        for record in records:
            exported = store.export_session(record["id"])
            assert exported is not None
            for key, value in record.items():
                if key != "messages":
                    assert exported[key] == value, key  # type: ignore[literal-required]
            assert exported["messages"] == record["messages"]
        cjk = sum("数据库" in (m["content"] or "") for r in records for m in r["messages"])
        assert cjk > 0
        assert len(store.search_messages("数据库", limit=1000)) == cjk
        assert [h["session_id"] for h in store.search_messages("marker7x4")] == ["imported-0007"]
    assert triggers(path) == before
    assert index_problems(path) == []


@pytest.mark.parametrize("into", ["a store", "a new file"])
def test_the_original_store_reads_and_writes_an_imported_file(tmp_path: Path, into: str) -> None:
    records = workers.export_records(sessions=8, per_session=9)
    path = tmp_path / "state.db"
    if into == "a new file":  # built privately, then linked in place (import_new_file)
        transfer.import_new_file(path, enumerate(records, 1), batch_size=3)
    else:
        with SessionDB(path) as store:
            import_records(store, records, batch_size=3)
    original = SeedSessionDB(path)
    try:
        session = records[0]["id"]
        assert [m["content"] for m in original.get_messages(session)] == [
            m["content"] for m in records[0]["messages"]
        ]
        assert {h["session_id"] for h in original.search_messages("marker5x2")} == {"imported-0005"}
        new_id = original.append_message(session, "user", "written later zulufox 数据库迁移")
        assert new_id == 8 * 9 + 1
        assert [h["id"] for h in original.search_messages("zulufox")] == [new_id]
    finally:
        original.close()
    assert index_problems(path) == []
    with SessionDB(path) as store:
        assert [h["id"] for h in store.search_messages("数据库迁移")] == [new_id]


def test_taken_ids_get_the_ids_autoincrement_would_give(tmp_path: Path) -> None:
    """Ids 1..3 are taken and 4..5 were used once (a deleted session): the file's ids 4 and 5
    are free again and kept; its 1..3 are renumbered after the highest id, in file order,
    and the next append continues after them."""
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("local", "cli")
        store.create_session("gone", "cli")
        for n in range(3):
            store.append_message("local", "user", f"local {n}")
        for n in range(2):
            store.append_message("gone", "user", f"gone {n}")
        store.delete_session("gone")
        records = workers.export_records(sessions=2, per_session=4)
        report = import_records(store, records)
        assert report.messages_renumbered == 3
        ids = {
            m["content"]: m["id"]
            for r in records
            for m in (store.export_session(r["id"]) or {"messages": []})["messages"]
        }
        file_ids = {m["content"]: m["id"] for r in records for m in r["messages"]}
        renumbered = sorted(
            (file_ids[content], ids[content]) for content in ids if file_ids[content] <= 3
        )
        assert [new for _, new in renumbered] == [9, 10, 11]
        assert all(ids[c] == file_ids[c] for c in ids if file_ids[c] > 3)
        assert store.append_message("local", "user", "after") == 12
    assert index_problems(path) == []


@pytest.mark.parametrize(
    ("held", "renumbered"), [((10, 19), set()), ((11, 18), {11, 18}), ((14,), {14})]
)
def test_an_id_taken_anywhere_in_a_batchs_span_is_found(
    tmp_path: Path, held: tuple[int, ...], renumbered: set[int]
) -> None:
    """A batch's ids are looked up one by one only when its span (lowest to highest id) holds
    a row: ids held just outside the span leave every id kept; held at either end of it, or
    inside, exactly those are renumbered (after the highest id), as a lookup per id finds."""
    path = tmp_path / "state.db"
    records = workers.export_records(sessions=2, per_session=4)
    for record in records:
        for message in record["messages"]:
            message["id"] += 10  # the file's ids: 11..18
    with SessionDB(path) as store:
        store.create_session("local", "cli")
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for number in held:
            conn.execute(
                "INSERT INTO messages (id, session_id, role, content, timestamp) "
                "VALUES (?, 'local', 'user', ?, 1.0)",
                (number, f"local {number}"),
            )
    with SessionDB(path) as store:
        report = import_records(store, records)
        assert report.messages_renumbered == len(renumbered)
        stored = {
            m["content"]: m["id"]
            for r in records
            for m in (store.export_session(r["id"]) or {"messages": []})["messages"]
        }
    file_ids = {m["content"]: m["id"] for r in records for m in r["messages"]}
    assert len(stored) == 8
    moved = {file_ids[c] for c in stored if stored[c] != file_ids[c]}
    assert moved == renumbered
    assert all(stored[c] > max(18, *held) for c in stored if file_ids[c] in renumbered)
    assert index_problems(path) == []


def test_a_batch_whose_ids_are_all_taken_is_renumbered_whole(tmp_path: Path) -> None:
    """Every message id of the file is taken (the same export imported again under other
    session ids, as a second machine's history would be): nothing is kept, every message gets
    the next free id (this raised a raw TypeError when no id of a batch was free)."""
    path = tmp_path / "state.db"
    records = workers.export_records(sessions=2, per_session=4)
    again = [
        {
            **r,
            "id": f"{r['id']}-again",
            "parent_session_id": None,
            "messages": [{**m, "session_id": f"{r['id']}-again"} for m in r["messages"]],
        }
        for r in records
    ]
    with SessionDB(path) as store:
        import_records(store, records)
        report = import_records(store, again)
        assert report.messages_renumbered == report.messages == 8
        for r in again:
            exported = store.export_session(r["id"])
            assert exported is not None
            assert [m["content"] for m in exported["messages"]] == [
                m["content"] for m in r["messages"]
            ]
            assert min(m["id"] for m in exported["messages"]) > 8
    assert index_problems(path) == []


def test_a_trigger_of_another_shape_keeps_firing_row_by_row(tmp_path: Path) -> None:
    """An insert trigger that does more than this package's is left in place (and its work
    not done twice); the one it knows is suspended and put back."""
    path = tmp_path / "state.db"
    SessionDB(path).close()
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("CREATE TABLE audit (id INTEGER)")
        conn.execute("DROP TRIGGER messages_fts_insert")
        conn.execute(
            "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN\n"
            "    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);\n"
            "    INSERT INTO audit (id) VALUES (new.id);\nEND"
        )
    before = triggers(path)
    with SessionDB(path) as store:
        import_records(store, workers.export_records(sessions=4, per_session=5), batch_size=2)
    assert triggers(path) == before
    assert index_problems(path) == []
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM audit").fetchone()[0] == 20


@pytest.mark.parametrize("json_each", [True, False])
def test_the_batch_check_sees_an_index_that_disagrees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, json_each: bool
) -> None:
    """Counted over the ids as one JSON array, or in chunks of ids (no ``json_each``)."""
    if not json_each:
        monkeypatch.setattr(fulltext, "_has_json_each", lambda conn: False)
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        plain = store.append_message("s", "user", "plain words")
        chinese = store.append_message("s", "user", "数据库连接失败")
        rows = [(plain, "plain words"), (chinese, "数据库连接失败")]
        check = lambda conn: fulltext.SQLITE.unindexed(conn, rows)  # noqa: E731
        assert store.uow.run(check) == []
        with closing(sqlite3.connect(path, isolation_level=None)) as raw:
            raw.execute(
                "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', ?, ?)",
                rows[0],
            )
            raw.execute("INSERT INTO messages_cjk(rowid, content) VALUES (?, ?)", rows[0])
            raw.execute(
                "INSERT INTO messages_cjk(messages_cjk, rowid, content) VALUES ('delete', ?, ?)",
                rows[1],
            )
        assert store.uow.run(check) == [
            "messages_fts holds 1 of 2 messages",
            "messages_cjk is wrong about 2 of 2 messages",
        ]


def test_a_process_killed_mid_batch_leaves_the_last_committed_batch(tmp_path: Path) -> None:
    """The importer is killed (SIGKILL) in its second batch, its messages inserted with the
    triggers suspended, while it indexes them: the file holds the first batch, indexed, with
    every trigger in place, and both stores go on using it."""
    path = tmp_path / "state.db"
    SessionDB(path).close()
    before = triggers(path)
    records = workers.export_records(sessions=6, per_session=10)
    export = tmp_path / "export.jsonl"
    workers.write_export(export, records)
    workers.kill_in_second_batch(workers.import_and_stall, path, export, 3)
    assert triggers(path) == before
    assert index_problems(path) == []
    first = {r["id"] for r in records[:3]}
    with SessionDB(path) as store:
        assert {s["id"] for s in store.search_sessions(limit=100)} == first
        assert store.message_count() == 30
        assert {h["session_id"] for h in store.search_messages("marker5x1")} == {"imported-0005"}
    original = SeedSessionDB(path)
    try:
        added = original.append_message("imported-0005", "user", "after the crash yankeefox")
        assert [h["id"] for h in original.search_messages("yankeefox")] == [added]
    finally:
        original.close()
    with SessionDB(path) as store:
        report = import_records(store, records)  # the rest, on a second try
        assert (report.sessions, report.sessions_skipped) == (3, 3)
    assert index_problems(path) == []


@pytest.mark.parametrize("batch_size", [1, 100])
def test_every_batch_size_gives_the_same_file(tmp_path: Path, batch_size: int) -> None:
    records = workers.export_records(sessions=5, per_session=7)
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        import_records(store, records, batch_size=batch_size)
        exported = list(store.iter_export())
    assert [r["id"] for r in exported] == [r["id"] for r in records]
    assert [m["id"] for r in exported for m in r["messages"]] == [
        m["id"] for r in records for m in r["messages"]
    ]
    assert index_problems(path) == []


def test_marked_values_import_as_they_were_where_the_column_holds_them(store: SessionDB) -> None:
    """The export writes a value JSON or the import's checks have no plain form for as a
    marked object: the import stores the value it stands for. A non-finite or out-of-range
    float lands on both backends; text in a counter or a blob only in SQLite (PostgreSQL's
    columns cannot hold it), refused by line and field elsewhere; a malformed marker always."""
    numbers = {
        "id": "numbers",
        "source": "cli",
        "started_at": {"$sqlite": "real", "value": 1733500000000.0},
        "estimated_cost_usd": {"$sqlite": "real", "value": "Infinity"},
        "actual_cost_usd": {"$sqlite": "real", "value": "-Infinity"},
        "messages": [{"id": 1, "role": "user", "timestamp": 2.0, "content": "plain"}],
    }
    report = import_records(store, [numbers])
    assert (report.sessions, report.messages) == (1, 1)
    session = store.get_session("numbers")
    assert session is not None
    assert (session["started_at"], session["estimated_cost_usd"], session["actual_cost_usd"]) == (
        1733500000000.0,
        float("inf"),
        float("-inf"),
    )
    typed = {
        "id": "typed",
        "source": "cli",
        "started_at": 1.0,
        "input_tokens": {"$sqlite": "text", "value": "abc"},
        "messages": [
            {
                "id": 2,
                "role": "user",
                "timestamp": 3.0,
                "content": {"$sqlite": "blob", "base64": "AP8Q"},
            }
        ],
    }
    if store.uow.is_sqlite:
        import_records(store, [typed])
        restored = store.export_session("typed")
        assert restored is not None and restored["input_tokens"] == "abc"
        assert restored["messages"][0]["content"] == b"\x00\xff\x10"
    else:
        with pytest.raises(InvalidInputError, match="line 1: input_tokens holds text 'abc'"):
            import_records(store, [typed])
    malformed = {**numbers, "id": "bad", "ended_at": {"$sqlite": "blob", "base64": "!!"}}
    with pytest.raises(InvalidInputError, match="ended_at is not a stored value the export"):
        import_records(store, [malformed])
