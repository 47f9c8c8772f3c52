"""Import into a SQLite file that does not exist yet (``transfer.import_new_file``): built under a
private name with its journal in memory and no fsync per batch, then put in WAL mode, flushed
and linked in place.

What must hold: the file is what ``import_sessions`` makes of the same export in a new store
(every value, both indexes, the triggers), in WAL mode and owner-only, with nothing left beside
it (the original store reads and writes it: tests/services/test_transfer.py); what committed
before a failure or an interrupt lands and nothing else; a crash leaves no file under the
name, and the next such import removes what it left; a database that exists, or appears while
the file is built, is never touched.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hermes_store import SessionDB, transfer
from hermes_store.cli import cli
from hermes_store.engine import files
from hermes_store.errors import InvalidInputError, StorageFullError
from tests.support import import_workers as workers
from tests.support.import_workers import index_problems, triggers


def journal_mode(path: Path) -> str:
    with closing(sqlite3.connect(path)) as conn:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])


def beside(path: Path) -> list[str]:
    return sorted(os.listdir(path.parent))


def exported(path: Path) -> list[Any]:
    with SessionDB(path) as store:
        return list(store.iter_export())


def created_meanwhile(records: list[dict[str, Any]], path: Path) -> Iterator[tuple[int, Any]]:
    """The records, and as the 4th is read, another store creates the database at ``path``
    (with a session of its own, ``theirs``)."""
    for line, record in enumerate(records, 1):
        if line == 4:
            with SessionDB(path) as other:
                other.create_session("theirs", "cli")
        yield line, record


def test_a_new_file_is_what_import_sessions_makes_in_wal_mode_with_nothing_beside_it(
    tmp_path: Path,
) -> None:
    records = workers.export_records(sessions=20, per_session=12)
    built, reference = tmp_path / "built" / "state.db", tmp_path / "reference.db"
    report = transfer.import_new_file(built, enumerate(records, 1), batch_size=6)
    with SessionDB(reference) as store:
        expected = transfer.import_sessions(store, enumerate(records, 1), batch_size=6)
    assert report == expected
    assert (report.sessions, report.messages) == (20, 240)
    assert beside(built) == ["state.db"]
    assert journal_mode(built) == "wal"
    assert stat.S_IMODE(built.stat().st_mode) == 0o600
    assert stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    assert triggers(built) == triggers(reference)
    assert index_problems(built) == []
    assert exported(built) == exported(reference)
    got = [m for r in exported(built) for m in r["messages"]]
    assert got == [m for r in records for m in r["messages"]]
    with SessionDB(built) as store:
        cjk = sum("数据库" in (m["content"] or "") for r in records for m in r["messages"])
        assert cjk > 0 and len(store.search_messages("数据库", limit=1000)) == cjk
        assert [h["session_id"] for h in store.search_messages("marker7x4")] == ["imported-0007"]


def test_an_invalid_record_lands_exactly_the_batches_before_its_own(tmp_path: Path) -> None:
    records = workers.export_records(sessions=12, per_session=4)
    records[7]["messages"][1]["timestamp"] = "yesterday"
    path = tmp_path / "state.db"
    report = transfer.ImportReport()
    with pytest.raises(InvalidInputError, match="line 8"):
        transfer.import_new_file(path, enumerate(records, 1), batch_size=3, report=report)
    assert (report.sessions, report.messages) == (6, 24)
    assert beside(path) == ["state.db"]
    assert journal_mode(path) == "wal"
    assert [r["id"] for r in exported(path)] == [r["id"] for r in records[:6]]
    assert index_problems(path) == []


def test_an_interrupt_lands_what_committed_and_goes_on_to_the_caller(tmp_path: Path) -> None:
    records = workers.export_records(sessions=12, per_session=4)

    def interrupted() -> Iterator[tuple[int, Any]]:
        for line, record in enumerate(records, 1):
            if line == 8:
                raise KeyboardInterrupt
            yield line, record

    path = tmp_path / "state.db"
    report = transfer.ImportReport()
    with pytest.raises(KeyboardInterrupt):
        transfer.import_new_file(path, interrupted(), batch_size=3, report=report)
    assert (report.sessions, report.messages) == (6, 24)
    assert [r["id"] for r in exported(path)] == [r["id"] for r in records[:6]]
    assert beside(path) == ["state.db"]


def test_a_failure_before_anything_committed_leaves_nothing(tmp_path: Path) -> None:
    records = workers.export_records(sessions=4, per_session=2)
    records[0]["started_at"] = "soon"
    path = tmp_path / "state.db"
    with pytest.raises(InvalidInputError, match="line 1"):
        transfer.import_new_file(path, enumerate(records, 1))
    assert beside(path) == []


@pytest.mark.parametrize("kind", ["file", "dangling link"])
def test_an_existing_path_is_refused_and_left_as_it_was(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "state.db"
    if kind == "file":
        with SessionDB(path) as store:
            store.create_session("mine", "cli")
    else:
        path.symlink_to(tmp_path / "elsewhere.db")
    before = beside(path)
    with pytest.raises(transfer.DatabaseTargetError, match="exists already"):
        transfer.import_new_file(path, enumerate(workers.export_records(2, 2), 1))
    assert beside(path) == before
    if kind == "file":
        assert [r["id"] for r in exported(path)] == ["mine"]


@pytest.mark.parametrize("path", [None, 3, b"state.db"])
def test_a_path_that_is_not_one_is_refused_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInputError, match="must be a file path"):
        transfer.import_new_file(path, enumerate(workers.export_records(2, 2), 1))
    assert os.listdir(tmp_path) == []


def test_a_database_created_meanwhile_is_left_alone_and_the_built_file_named(
    tmp_path: Path,
) -> None:
    """Another process creates the database while the import builds its file: the link is
    refused, the other database keeps exactly what it holds, the built file is kept whole."""
    records = workers.export_records(sessions=6, per_session=3)
    path = tmp_path / "state.db"

    with pytest.raises(transfer.DatabaseTargetError, match="created by another process") as caught:
        transfer.import_new_file(path, created_meanwhile(records, path), batch_size=2)
    assert [r["id"] for r in exported(path)] == ["theirs"]
    built = [name for name in beside(path) if name.endswith(".import")]
    assert len(built) == 1 and built[0] in str(caught.value)
    assert [r["id"] for r in exported(tmp_path / built[0])] == [r["id"] for r in records]
    assert index_problems(tmp_path / built[0]) == []


@pytest.mark.slow
def test_a_killed_import_leaves_no_file_and_the_next_one_removes_its_leftovers(
    tmp_path: Path,
) -> None:
    """The importer is killed (SIGKILL) while it indexes its second batch: nothing appears
    under the name (the first batch was never made durable there); the next import into the
    same name removes the dead build's file and lands the whole export."""
    path = tmp_path / "state.db"
    records = workers.export_records(sessions=6, per_session=10)
    export = tmp_path / "export.jsonl"
    workers.write_export(export, records)
    workers.kill_in_second_batch(workers.import_new_file_and_stall, path, export, 3)
    assert not os.path.lexists(path)
    assert any(name.endswith(".import") for name in beside(path))
    with open(export, "rb") as handle:
        report = transfer.import_new_file(
            path, transfer.read_records(handle, lambda _: None), batch_size=3
        )
    assert (report.sessions, report.messages) == (6, 60)
    assert beside(path) == ["export.jsonl", "state.db"]
    assert [r["id"] for r in exported(path)] == [r["id"] for r in records]
    assert index_problems(path) == []


def test_the_cli_builds_a_new_file_and_imports_into_an_existing_one(tmp_path: Path) -> None:
    records = workers.export_records(sessions=5, per_session=4)
    export = tmp_path / "export.jsonl"
    workers.write_export(export, records)
    runner = CliRunner(env={"HERMES_STORE_URL": None})
    path = tmp_path / "db" / "state.db"
    first = runner.invoke(cli, ["--db", str(path), "import", str(export), "--json"])
    assert first.exit_code == 0, first.output
    assert beside(path) == ["state.db"]  # built beside it and linked: no writer lock file
    again = runner.invoke(cli, ["--db", str(path), "import", str(export), "--json"])
    assert again.exit_code == 0, again.output
    assert '"sessions_skipped": 5' in again.stdout
    assert [r["id"] for r in exported(path)] == [r["id"] for r in records]


def test_a_failed_import_whose_file_cannot_be_linked_raises_its_own_error_naming_the_file(
    tmp_path: Path,
) -> None:
    """The import fails (an invalid record) after a batch committed, and the database was
    created meanwhile: the invalid record is what is raised, with a note naming the built
    file that holds the committed batch; the other database is untouched."""
    records = workers.export_records(sessions=6, per_session=3)
    records[4]["ended_at"] = "later"
    path = tmp_path / "state.db"

    with pytest.raises(InvalidInputError, match="line 5") as caught:
        transfer.import_new_file(path, created_meanwhile(records, path), batch_size=2)
    built = [name for name in beside(path) if name.endswith(".import")]
    assert len(built) == 1
    assert any(built[0] in note for note in caught.value.__notes__)
    assert [r["id"] for r in exported(path)] == ["theirs"]
    assert [r["id"] for r in exported(tmp_path / built[0])] == [r["id"] for r in records[:4]]


def test_a_dead_build_that_cannot_be_removed_is_left_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user's dead build in a shared folder (the refusal stands in for that user's
    file): it is left, said in the log, and the import goes on."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    path = tmp_path / "state.db"
    theirs = tmp_path / f".state.db.{int(gone.stdout)}.{'ab' * 6}.import"
    theirs.write_bytes(b"")
    unlink = os.unlink

    def refused(name: Any, *args: Any, **kwargs: Any) -> None:
        if Path(name) == theirs:
            raise PermissionError(1, "Operation not permitted", str(name))
        unlink(name, *args, **kwargs)

    monkeypatch.setattr(files.os, "unlink", refused)
    with caplog.at_level("WARNING", logger="hermes_store.engine.files"):
        report = transfer.import_new_file(path, enumerate(workers.export_records(3, 2), 1))
    assert report.sessions == 3
    assert theirs.exists() and str(theirs) in caplog.text
    assert beside(path) == sorted([theirs.name, "state.db"])


def test_a_disk_that_fills_up_lands_whole_batches_or_nothing(tiny_disk: Path) -> None:
    """A real 4 MB file system fills during the build: the error says the disk is full, and
    what is under the name afterwards is whole batches of the export, sound, in WAL mode;
    nothing else is left beside it but the built file a note names."""
    records = workers.export_records(sessions=200, per_session=30)  # ~10 MB of text
    path = tiny_disk / "state.db"
    report = transfer.ImportReport()
    with pytest.raises(StorageFullError) as caught:
        transfer.import_new_file(path, enumerate(records, 1), batch_size=5, report=report)
    left = [name for name in beside(path) if name != "state.db"]
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert all(name in notes for name in left), (left, notes)
    if path.exists():
        assert journal_mode(path) == "wal"
        assert index_problems(path) == []
        landed = [r["id"] for r in exported(path)]
        assert landed == [r["id"] for r in records[: len(landed)]]
        assert len(landed) == report.sessions and len(landed) % 5 == 0


@pytest.mark.parametrize("flush", [1, 2])
def test_an_interrupt_while_the_file_is_linked_says_truly_what_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flush: int
) -> None:
    """Ctrl-C as the built file is flushed (the 1st flush, before the link: nothing is under
    the name, and the report says nothing landed) or as the folder is (the 2nd, after the
    link: the file is there whole, and the report counts it)."""
    real_fsync = files.fsync_path
    flushes = 0

    def interrupted(path: Path) -> None:
        nonlocal flushes
        flushes += 1
        if flushes == flush:
            raise KeyboardInterrupt
        real_fsync(path)

    monkeypatch.setattr(files, "fsync_path", interrupted)
    records = workers.export_records(sessions=6, per_session=3)
    path = tmp_path / "state.db"
    report = transfer.ImportReport()
    with pytest.raises(KeyboardInterrupt):
        transfer.import_new_file(path, enumerate(records, 1), batch_size=2, report=report)
    if flush == 1:
        assert not os.path.lexists(path)
        assert (report.sessions, report.messages) == (0, 0)
    else:
        assert [r["id"] for r in exported(path)] == [r["id"] for r in records]
        assert (report.sessions, report.messages) == (6, 18)
