"""Operating a long-lived store: backup and restore while writers write, a bounded WAL,
chunked retention racing itself, Markdown and redacted exports."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.engine.factory import JOURNAL_SIZE_LIMIT_ENV
from hermes_store.errors import (
    DatabaseLockedError,
    InvalidInputError,
    NotADatabaseError,
    SchemaTooNewError,
    StoreMisuseError,
    UnrecognizedSchemaError,
)
from hermes_store.ops import backup, maintenance, retention
from hermes_store.schema import migrate
from tests.support import legacy, proc_workers
from tests.support.backends import is_sqlite, url_string
from tests.support.waiting import GUARD

CTX = mp.get_context("fork")
DEADLINE = 120.0  # a hang guard only: every wait below is on a pipe, an event or a join
GOLDEN = Path(__file__).parent / "golden" / "tour.md"


def _ids(path: Path) -> set[int]:
    raw = sqlite3.connect(path)
    try:
        return {row[0] for row in raw.execute("SELECT id FROM messages")}
    finally:
        raw.close()


# -- backup -------------------------------------------------------------------------------------


def _appender(path: str, number: int, began: object, stop: object, pipe: Connection) -> None:
    """Appends until told to stop; reports the ids acknowledged before the backup began."""
    store = SessionDB(path)
    session = f"writer-{number}"
    store.create_session(session, "gateway")
    before: list[int] = []
    count = 0
    while not stop.is_set():  # type: ignore[attr-defined]
        message_id = store.append_message(session, "user", f"writer {number} message {count}")
        count += 1
        if not began.is_set():  # type: ignore[attr-defined]
            before.append(message_id)  # acknowledged before the backup began
        if count == 20:
            pipe.send("warm")
    store.close()
    pipe.send(before)


def _never_committer(path: str, stop: object, pipe: Connection) -> None:
    """Writes rows and rolls them back, over and over: none may ever reach a backup."""
    raw = sqlite3.connect(path, isolation_level=None, timeout=30)
    raw.execute("PRAGMA busy_timeout=30000")
    rounds = 0
    while not stop.is_set() or rounds < 3:  # type: ignore[attr-defined]
        raw.execute("BEGIN IMMEDIATE")
        raw.execute(
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "VALUES ('writer-0', 'user', 'never committed', 0)"
        )
        raw.execute("ROLLBACK")
        rounds += 1
        if rounds == 3:
            pipe.send("warm")
    raw.close()
    pipe.send(rounds)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["backup", "vacuum"])
def test_a_backup_taken_while_8_writers_write_is_a_consistent_snapshot(
    tmp_path: Path, method: backup.Method
) -> None:
    path = tmp_path / "state.db"
    SessionDB(path).close()
    began, stop = CTX.Event(), CTX.Event()
    pipes, processes = [], []
    for number in range(8):
        ours, theirs = CTX.Pipe()
        process = CTX.Process(target=_appender, args=(str(path), number, began, stop, theirs))
        pipes.append(ours)
        processes.append(process)
    ours, theirs = CTX.Pipe()
    pipes.append(ours)
    processes.append(CTX.Process(target=_never_committer, args=(str(path), stop, theirs)))
    for process in processes:
        process.start()
    try:
        for pipe in pipes:
            assert pipe.poll(DEADLINE), "a writer never warmed up"
            assert pipe.recv() == "warm"
        began.set()
        with SessionDB(path) as store:
            report = backup.backup(store.engine, tmp_path / "copy.db", method=method, verify=True)
    finally:
        stop.set()
        answers = [pipe.recv() if pipe.poll(DEADLINE) else None for pipe in pipes]
        for process in processes:
            process.join(DEADLINE)
    assert report.verified is True and report.problems == []
    acknowledged = {i for answer in answers[:8] for i in answer}
    assert len(acknowledged) >= 8 * 19
    copy = tmp_path / "copy.db"
    in_copy = _ids(copy)
    assert acknowledged <= in_copy
    assert in_copy <= _ids(path)  # everything in the copy was committed
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    with SessionDB(copy) as restored:
        assert restored.check_search_index()
        assert not [r for r in restored.search_messages("never committed") if r]
        assert restored.session_count() == 8
    raw = sqlite3.connect(copy)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert (
        raw.execute("SELECT count(*) FROM messages WHERE content = 'never committed'").fetchone()[0]
        == 0
    )
    raw.close()


def test_backup_refuses_the_database_itself_and_an_existing_file(sqlite_store: SessionDB) -> None:
    path = Path(str(sqlite_store.db_path))
    for target in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        with pytest.raises(InvalidInputError, match="onto the database itself"):
            backup.backup(sqlite_store.engine, target)
    existing = path.parent / "existing.db"
    backup.backup(sqlite_store.engine, existing)
    with pytest.raises(InvalidInputError, match="exists"):
        backup.backup(sqlite_store.engine, existing)
    backup.backup(sqlite_store.engine, existing, overwrite=True)
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".")) == []


def test_a_closed_store_refuses_a_backup_and_writes_nothing(tmp_path: Path) -> None:
    """``backup()`` after ``close()`` went on through the disposed engine, which quietly opened
    new connections to the file; it is refused like every other call."""
    db = SessionDB(tmp_path / "state.db")
    db.create_session("s", "cli")
    db.close()
    with pytest.raises(StoreMisuseError, match="this SessionDB is closed"):
        db.backup(tmp_path / "snapshot.db")
    assert not (tmp_path / "snapshot.db").exists()


def test_a_backup_or_restore_path_under_an_unknown_home_folder_is_refused(
    sqlite_store: SessionDB,
) -> None:
    """``~nosuchuser/...``: Python's bare RuntimeError ("Could not determine home directory")
    escaped both; refused as a path given wrongly, before anything is written."""
    with pytest.raises(InvalidInputError, match="home folder cannot be found"):
        sqlite_store.backup("~nosuchuser-hermes/b.db")
    with pytest.raises(InvalidInputError, match="home folder cannot be found"):
        backup.restore(sqlite_store.engine, "~nosuchuser-hermes/b.db")


def test_backup_and_restore_on_postgresql_name_pg_dump(pg_url: URL) -> None:
    with SessionDB(url_string(pg_url)) as store:
        with pytest.raises(backup.NotSupportedError, match="pg_dump"):
            backup.backup(store.engine, "/tmp/never.db")
        with pytest.raises(backup.NotSupportedError, match="pg_restore"):
            backup.restore(store.engine, "/tmp/never.db")
    result = CliRunner().invoke(cli, ["--db", url_string(pg_url), "backup", "x.db"])
    assert result.exit_code == 1 and "pg_dump" in result.output


def test_restore_writes_into_the_live_file_that_other_instances_keep_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store, SessionDB(path) as other:
        store.create_session("kept", "cli")
        store.append_message("kept", "user", "in the snapshot")
        backup.backup(store.engine, tmp_path / "snap.db")
        store.create_session("later", "cli")
        store.append_message("later", "user", "after the snapshot")
        inode = path.stat().st_ino
        report = backup.restore(store.engine, tmp_path / "snap.db")
        assert (report.sessions, report.messages) == (1, 1)
        assert path.stat().st_ino == inode  # written into, never replaced
        assert other.get_session("later") is None
        assert [m["content"] for m in other.get_messages("kept")] == ["in the snapshot"]
        other.append_message("kept", "assistant", "written after the restore")
        assert store.message_count("kept") == 2
        assert store.search_messages("snapshot")[0]["session_id"] == "kept"
        assert store.check_search_index()


def test_a_restore_gives_up_on_a_write_lock_held_past_its_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the live file's write lock (a stuck writer): the restore waited
    forever (Python's backup() steps again after every busy step). It now gives up after its
    wait with DatabaseLockedError, the live content untouched."""
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("snapshot", "cli")
        backup.backup(store.engine, tmp_path / "snap.db")
        store.create_session("live", "cli")
    monkeypatch.setattr(backup, "RESTORE_LOCK_WAIT_S", 0.2)
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(
        target=proc_workers.hold_write_lock_until, args=(str(path), ready, release)
    )
    holder.start()
    try:
        assert ready.wait(GUARD)
        outcome: list[BaseException | None] = []

        def restoring() -> None:
            try:
                backup.restore(path, tmp_path / "snap.db")
            except BaseException as error:  # handed to the test
                outcome.append(error)
            else:
                outcome.append(None)

        thread = threading.Thread(target=restoring, daemon=True)
        thread.start()
        thread.join(GUARD)
        assert not thread.is_alive(), "the restore still waits: a hang"
        assert isinstance(outcome[0], DatabaseLockedError), outcome
        assert "nothing of" in str(outcome[0])
    finally:
        release.set()
        holder.join(GUARD)
    with SessionDB(path) as store:
        assert sorted(s["id"] for s in store.list_sessions_rich()) == ["live", "snapshot"]


def _steady_writer(path: str, restored: object, stop: object, pipe: Connection) -> None:
    """Appends to session ``s`` throughout a restore; reports the ids acknowledged after it."""
    store = SessionDB(path)
    after: list[int] = []
    count = 0
    while not stop.is_set():  # type: ignore[attr-defined]
        done = restored.is_set()  # type: ignore[attr-defined]
        message_id = store.append_message("s", "user", f"steady {count}")
        count += 1
        if done:
            after.append(message_id)
            if len(after) == 5:
                pipe.send("written after")
        if count == 20:
            pipe.send("warm")
    store.close()
    pipe.send(after)


@pytest.mark.slow
def test_a_restore_while_another_process_writes_is_atomic_and_loses_no_later_write(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        _fill(store, 200, messages=5)
        backup.backup(store.engine, tmp_path / "snap.db")
    restored, stop = CTX.Event(), CTX.Event()
    ours, theirs = CTX.Pipe()
    writer = CTX.Process(target=_steady_writer, args=(str(path), restored, stop, theirs))
    writer.start()
    try:
        assert ours.poll(DEADLINE) and ours.recv() == "warm"
        with SessionDB(path) as store:
            backup.restore(store.engine, tmp_path / "snap.db", pages_per_step=8)
        restored.set()
        assert ours.poll(DEADLINE) and ours.recv() == "written after"
    finally:
        stop.set()
        after = ours.recv() if ours.poll(DEADLINE) else None
        writer.join(DEADLINE)
    assert after
    assert set(after) <= _ids(path)
    with SessionDB(path) as store:
        assert store.session_count() == 201
        session = store.get_session("s")
        assert session is not None and session["message_count"] == store.message_count("s")
        assert store.check_search_index()
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()


def test_restore_refuses_a_damaged_or_older_snapshot_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        garbage = tmp_path / "garbage.db"
        garbage.write_bytes(b"SQLite format 3\x00" + b"\x01" * 4000)
        with pytest.raises(backup.SnapshotError, match="refusing to restore"):
            backup.restore(store.engine, garbage)
        older = tmp_path / "older.db"
        backup.backup(store.engine, older)
        migrate.downgrade(older, "v5_billing_columns")
        with pytest.raises(backup.SnapshotError, match="head is"):
            backup.restore(store.engine, older)
        assert store.get_session("s") is not None


def _set_schema_version(path: Path, version: int) -> None:
    """What a newer release of the original store leaves in a file."""
    raw = sqlite3.connect(path)
    try:
        with raw:
            raw.execute("UPDATE schema_version SET version = ?", (version,))
    finally:
        raw.close()


def _schema_version(path: Path) -> int:
    raw = sqlite3.connect(path)
    try:
        return int(raw.execute("SELECT version FROM schema_version").fetchone()[0])
    finally:
        raw.close()


def test_restore_refuses_a_snapshot_from_a_newer_release_before_writing(tmp_path: Path) -> None:
    """Once restored, such a file could not be opened again, not even to restore another
    snapshot over it."""
    path = tmp_path / "state.db"
    newer = tmp_path / "newer.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        backup.backup(store.engine, newer)
        store.create_session("kept", "cli")
        _set_schema_version(newer, 99)
        assert any("schema_version 99" in p for p in backup.check_snapshot(newer))
        with pytest.raises(backup.SnapshotError, match="knows versions up to 6"):
            backup.restore(store.engine, newer)
        with pytest.raises(backup.SnapshotError, match="knows versions up to 6"):
            backup.restore(path, newer)
        assert store.get_session("kept") is not None
    assert _schema_version(path) == 6
    runner = CliRunner()
    refused = runner.invoke(cli, ["--db", str(path), "restore", str(newer), "--yes"])
    assert refused.exit_code == 1, refused.output
    assert refused.stderr.startswith("Error: refusing to restore") and "99" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1
    with SessionDB(path) as store:
        assert store.session_count() == 2


def test_restore_puts_back_a_live_file_this_release_cannot_open(tmp_path: Path) -> None:
    """Restore is the way back from a file of a newer release (or one damaged past repair):
    named by its path it is written into without being opened as a store. A path that holds
    no database is still refused, and nothing is created or written there."""
    path = tmp_path / "state.db"
    good = tmp_path / "good.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        store.append_message("s", "user", "in the snapshot")
        backup.backup(store.engine, good)
        store.create_session("lost", "cli")
    _set_schema_version(path, 99)
    with pytest.raises(SchemaTooNewError):
        SessionDB(path)
    report = backup.restore(path, good)
    assert (report.sessions, report.messages) == (1, 1)
    with SessionDB(path) as store:
        assert store.get_session("lost") is None
        assert store.search_messages("snapshot")[0]["session_id"] == "s"

    _set_schema_version(path, 99)
    runner = CliRunner()
    done = runner.invoke(cli, ["--db", str(path), "restore", str(good), "--yes", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["sessions"] == 1
    listed = runner.invoke(cli, ["--db", str(path), "sessions", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [s["id"] for s in json.loads(listed.stdout)] == ["s"]

    with SessionDB(path) as store, store.uow.connect(write=True) as conn:
        conn.exec_driver_sql("ALTER TABLE messages DROP COLUMN reasoning")
    with pytest.raises(UnrecognizedSchemaError, match="restore it from a backup"):
        SessionDB(path)
    done = runner.invoke(cli, ["--db", str(path), "restore", str(good), "--yes"])
    assert done.exit_code == 0, done.output
    with SessionDB(path) as store:
        assert store.message_count("s") == 1

    junk = tmp_path / "notes.txt"
    junk.write_text("not a database\n" * 100)
    with pytest.raises(NotADatabaseError):
        backup.restore(junk, good)
    assert junk.read_text() == "not a database\n" * 100
    with pytest.raises(NotADatabaseError):
        backup.restore(tmp_path / "absent.db", good)
    assert not (tmp_path / "absent.db").exists()


# -- bounded growth -----------------------------------------------------------------------------


def test_the_wal_is_cut_back_to_the_limit_after_a_burst_of_100k_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 1024 * 1024
    monkeypatch.setenv(JOURNAL_SIZE_LIMIT_ENV, str(limit))
    path = tmp_path / "state.db"
    wal = Path(f"{path}-wal")
    with SessionDB(path, checkpoint_every=0) as store:
        store.create_session("burst", "cli")
        # A long reader pins the WAL so the burst cannot be checkpointed away meanwhile.
        reader = sqlite3.connect(path, isolation_level=None)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM messages").fetchone()
        batch = [{"role": "user", "content": f"burst message {i} " * 3} for i in range(1000)]
        for _ in range(100):
            store.append_messages("burst", batch)
        assert wal.stat().st_size > 8 * limit
        reader.execute("ROLLBACK")
        reader.close()
        assert store.uow.checkpoint()
        store.append_message("burst", "user", "the next commit restarts the WAL")
        assert wal.stat().st_size <= limit
        assert store.message_count("burst") == 100_001


def test_the_wal_limit_is_configurable_and_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(JOURNAL_SIZE_LIMIT_ENV, "12345")
    with SessionDB(tmp_path / "a.db") as store, store.uow.connect(write=False) as conn:
        assert conn.exec_driver_sql("PRAGMA journal_size_limit").scalar() == 12345
    monkeypatch.setenv(JOURNAL_SIZE_LIMIT_ENV, "lots")
    with pytest.raises(InvalidInputError, match=JOURNAL_SIZE_LIMIT_ENV):
        SessionDB(tmp_path / "b.db")


def _fill(store: SessionDB, sessions: int, *, messages: int = 2, ended: bool = True) -> None:
    for number in range(sessions):
        sid = f"s{number:05d}"
        store.create_session(sid, "cli")
        store.append_messages(sid, [{"role": "user", "content": f"note {number}"}] * messages)
        if ended:
            store.end_session(sid, "done")


def test_optimize_merges_the_index_and_reports_sizes(store: SessionDB) -> None:
    _fill(store, 40)
    report = maintenance.optimize(store.uow)
    assert report.merge_steps >= 1 and report.bytes_before > 0 and report.bytes_after > 0
    assert store.check_search_index()
    assert store.search_messages("note")[0]["snippet"]


def test_vacuum_offline_refuses_while_the_file_is_open_and_enables_incremental_vacuum(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        _fill(store, 50, messages=20)
        with pytest.raises(DatabaseLockedError, match="open in another"):
            maintenance.vacuum_offline(path)
        retention.run(store.uow, retention.Policy(-1))
    before, after = maintenance.vacuum_offline(path)
    assert after < before
    with SessionDB(path) as store:
        _fill(store, 50, messages=20)
        retention.run(store.uow, retention.Policy(-1))
        report = maintenance.optimize(store.uow)
        assert report.pages_freed > 0 and report.bytes_after < report.bytes_before
        assert store.session_count() == 0


# -- retention ----------------------------------------------------------------------------------


def test_retention_policy_keeps_titled_and_lineage_and_the_preview_matches(
    store: SessionDB,
) -> None:
    _fill(store, 6)
    store.set_session_title("s00001", "keep me")
    store.create_session("child", "cli", parent_session_id="s00001")
    store.end_session("child", "done")
    store.create_session("parent-of-active", "cli")
    store.end_session("parent-of-active", "done")
    store.create_session("active", "cli", parent_session_id="parent-of-active")
    store.create_session("telegram-old", "telegram")
    store.end_session("telegram-old", "done")
    future = time.time() + 86400
    policy = retention.Policy(0, ("cli",), keep_titled=True, keep_lineage=True)
    with store.uow.connect(write=False) as conn:
        preview = set(conn.scalars(retention.candidates(policy, future)))
    assert preview == {"s00000", "s00002", "s00003", "s00004", "s00005"}
    # A generous step bound: the chunks are the sessions' count, not the machine's speed.
    report = retention.run(store.uow, policy, chunk=2, now=future, step_seconds=10)
    assert (report.sessions, report.messages, report.chunks) == (5, 10, 3)
    assert report.largest_chunk == 2
    left = {s["id"] for s in store.search_sessions(limit=100)}
    assert left == {"s00001", "child", "parent-of-active", "active", "telegram-old"}


def test_cli_prune_preview_lists_exactly_what_prune_deletes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        _fill(store, 5)
        store.set_session_title("s00002", "titled")
        store.create_session("open", "cli")
    runner = CliRunner()
    args = ["--db", str(path), "sessions", "prune", "--older-than", "0", "--keep-titled"]
    preview = runner.invoke(cli, [*args, "--dry-run", "--json"])
    assert preview.exit_code == 0, preview.output
    listed = {row["id"] for row in json.loads(preview.stdout)}
    done = runner.invoke(cli, [*args, "--json", "--chunk", "2", "--yes"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["sessions"] == len(listed) == 4
    with SessionDB(path) as store:
        assert {s["id"] for s in store.search_sessions()} == {"s00002", "open"}


def _pruner(url: str, chunk: int, gate: object, pipe: Connection) -> None:
    store = SessionDB(url)
    gate.wait(DEADLINE)  # type: ignore[attr-defined]
    report = retention.run(store.uow, retention.Policy(0, ("old",)), chunk=chunk)
    store.close()
    pipe.send((report.sessions, report.messages, report.chunks, report.largest_chunk))


def _observer(url: str, gate: object, stop: object, pipe: Connection) -> None:
    """A writer: each write unit records how many old sessions it saw left."""
    store = SessionDB(url)
    store.create_session("writer", "gateway")
    gate.wait(DEADLINE)  # type: ignore[attr-defined]
    seen = []
    while not stop.is_set():  # type: ignore[attr-defined]
        seen.append(
            store.uow.run(
                lambda conn: (
                    conn.exec_driver_sql(
                        "INSERT INTO messages (session_id, role, content, timestamp) "
                        "VALUES ('writer', 'user', 'still writing', 0)"
                    ),
                    conn.exec_driver_sql(
                        "SELECT count(*) FROM sessions WHERE source = 'old'"
                    ).scalar(),
                )[1]
            )
        )
    store.close()
    pipe.send(seen)


@pytest.mark.slow
def test_two_retention_jobs_racing_delete_each_session_once(db_url: URL) -> None:
    url, total, chunk = url_string(db_url), 600, 25
    with SessionDB(url) as store:
        for number in range(total):
            store.create_session(f"old-{number:04d}", "old")
            store.append_messages(f"old-{number:04d}", [{"role": "user", "content": "x"}] * 2)
            store.end_session(f"old-{number:04d}", "done")
        store.create_session("young", "old")  # active: never pruned
    gate, stop = CTX.Barrier(3), CTX.Event()
    pipes, processes = [], []
    for _ in range(2):
        ours, theirs = CTX.Pipe()
        processes.append(CTX.Process(target=_pruner, args=(url, chunk, gate, theirs)))
        pipes.append(ours)
    observer_pipe, theirs = CTX.Pipe()
    observer = CTX.Process(target=_observer, args=(url, gate, stop, theirs))
    for process in [*processes, observer]:
        process.start()
    try:
        reports = [pipe.recv() if pipe.poll(DEADLINE) else None for pipe in pipes]
    finally:
        stop.set()
        seen = observer_pipe.recv() if observer_pipe.poll(DEADLINE) else None
        for process in [*processes, observer]:
            process.join(DEADLINE)
    assert None not in reports and seen is not None
    assert sum(r[0] for r in reports) == total  # each session deleted once, by one job
    assert sum(r[1] for r in reports) == 2 * total
    assert all(r[3] <= chunk for r in reports)
    with SessionDB(url) as store:
        assert store.session_count("old") == 1
        assert store.message_count("writer") == len(seen)
    # The writer got in between chunks: it saw the jobs half done, never a whole prune.
    assert any(1 < left < total for left in seen), seen[:20]
    if is_sqlite(db_url):
        # SQLite has one write lock: between two of the writer's units each job held it for
        # one chunk at most. (PostgreSQL's writer never waits for the jobs at all, its rows are
        # not theirs: how much they delete between its writes is CPU scheduling, not locking.)
        steps = [before - after for before, after in itertools.pairwise(seen)]
        assert max(steps) <= 2 * chunk, max(steps)


def test_secure_delete_and_the_merge_leave_no_pruned_text_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    word = "xylophonicsecret"
    with SessionDB(path) as store:
        store.create_session("gone", "cli")
        store.append_message("gone", "user", f"the passphrase is {word} " * 2000)
        store.end_session("gone", "done")
        _fill(store, 3, ended=False)
        report = retention.run(
            store.uow, retention.Policy(-1), secure_delete=True, merge_index=True
        )
        assert report.sessions == 1 and report.index_merged
        assert store.search_messages(word) == []
    assert word.encode() not in path.read_bytes()


# -- exports ------------------------------------------------------------------------------------


@pytest.fixture
def tour_db(tmp_path: Path) -> Iterator[Path]:
    """The README tour's database: the original store's file at schema_version 3, upgraded."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    migrate.upgrade(path)
    yield path


def test_markdown_export_of_the_tour_database_matches_the_golden_file(
    tour_db: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tour.md"
    result = CliRunner().invoke(
        cli, ["--db", str(tour_db), "export", "--format", "md", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    if os.environ.get("HERMES_STORE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(out.read_text(encoding="utf-8"), encoding="utf-8")
    assert out.read_text(encoding="utf-8") == GOLDEN.read_text(encoding="utf-8")


def test_markdown_split_writes_one_owner_only_file_per_session(
    tour_db: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "md"
    result = CliRunner().invoke(
        cli, ["--db", str(tour_db), "export", "--format", "md", "--split", "-o", str(folder)]
    )
    assert result.exit_code == 0, result.output
    written = sorted(folder.iterdir())
    assert len(written) == 4
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written)
    plan = next(p for p in written if "database-migration-plan-7f3c" in p.name)
    assert plan.read_text(encoding="utf-8").startswith("# Database migration plan\n")


SECRET = "sk-proj-Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL"


def test_redacted_exports_are_marked_masked_and_refused_by_import(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli", system_prompt=f"key {SECRET}")
        store.append_message(
            "s",
            "assistant",
            None,
            tool_calls=[
                {
                    "id": "c",
                    "type": "function",
                    "function": {
                        "name": "terminal",
                        "arguments": json.dumps({"command": f"export K={SECRET}"}),
                    },
                }
            ],
        )
        store.append_message("s", "tool", f"OPENAI_API_KEY={SECRET}", tool_call_id="c")
    runner = CliRunner()
    for fmt, name in (("jsonl", "r.jsonl"), ("md", "r.md")):
        out = tmp_path / name
        result = runner.invoke(
            cli, ["--db", str(path), "export", "--redact", "--format", fmt, "-o", str(out)]
        )
        assert result.exit_code == 0, result.output
        text = out.read_text(encoding="utf-8")
        assert SECRET not in text and "[REDACTED:" in text
    assert "Redacted export" in (tmp_path / "r.md").read_text(encoding="utf-8")
    assert json.loads((tmp_path / "r.jsonl").read_text(encoding="utf-8"))["redacted"] is True

    target = tmp_path / "copy.db"
    refused = runner.invoke(cli, ["--db", str(target), "import", str(tmp_path / "r.jsonl")])
    assert refused.exit_code == 1 and "redacted export" in refused.output
    with SessionDB(target) as copy:
        assert copy.session_count() == 0
    forced = runner.invoke(
        cli, ["--db", str(target), "import", "--force", str(tmp_path / "r.jsonl")]
    )
    assert forced.exit_code == 0, forced.output
    with SessionDB(target) as copy:
        assert SECRET not in json.dumps(copy.export_session("s"))


def test_cli_backup_verify_optimize_and_restore(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        _fill(store, 10)
    runner = CliRunner()
    copy = tmp_path / "copy.db"
    done = runner.invoke(cli, ["--db", str(path), "backup", str(copy), "--verify", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["verified"] is True
    again = runner.invoke(cli, ["--db", str(path), "backup", str(copy)])
    assert again.exit_code == 1 and "exists" in again.output
    optimized = runner.invoke(cli, ["--db", str(path), "db", "optimize", "--json"])
    assert optimized.exit_code == 0, optimized.output
    assert json.loads(optimized.output)["bytes_before"] > 0
    with SessionDB(path) as store:
        store.delete_session("s00000")
    restored = runner.invoke(cli, ["--db", str(path), "restore", str(copy), "--yes", "--json"])
    assert restored.exit_code == 0, restored.output
    assert json.loads(restored.output)["sessions"] == 10
    with SessionDB(path) as store:
        assert store.get_session("s00000") is not None
    vacuumed = runner.invoke(cli, ["--db", str(path), "db", "optimize", "--vacuum", "--json"])
    assert vacuumed.exit_code == 0, vacuumed.output


def test_cli_optimize_on_postgresql_reports_sizes(pg_url: URL) -> None:
    with SessionDB(url_string(pg_url)) as store:
        _fill(store, 3)
    result = CliRunner().invoke(cli, ["--db", url_string(pg_url), "db", "optimize", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["backend"] == "postgresql" and report["bytes_before"] > 0


def test_a_new_file_gives_freed_pages_back_online_and_stays_the_original_stores(
    tmp_path: Path,
) -> None:
    """Files this package creates have incremental vacuum on: a prune and an online optimize
    return the space without ``--vacuum``; the original store still reads and writes them."""
    from tests.support.seed_store import SeedSessionDB

    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        with store.uow.connect(write=False) as conn:
            assert conn.exec_driver_sql("PRAGMA auto_vacuum").scalar() == 2  # INCREMENTAL
        _fill(store, 50, messages=20)
        retention.run(store.uow, retention.Policy(-1))
        report = maintenance.optimize(store.uow)
        assert report.pages_freed > 0
        assert not any("--vacuum" in note for note in report.notes)
    seed = SeedSessionDB(path)
    try:
        seed.create_session("from-the-original", "cli")
        seed.append_message("from-the-original", "user", "written by the original store")
    finally:
        seed.close()
    with SessionDB(path) as store:
        assert store.search_messages("original")[0]["session_id"] == "from-the-original"
        assert store.check_search_index()


def test_optimize_says_why_the_total_grew(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        for number in range(20):
            sid = f"s{number:05d}"
            store.create_session(sid, "cli")
            for turn in range(30):
                store.append_message(sid, "user", f"note {number} {turn} " + "word " * 40)
        report = maintenance.optimize(store.uow)
    # Six hundred small commits leave a WAL that the merge's pages make larger still.
    assert report.bytes_after > report.bytes_before
    assert any("bytes more than before" in note and "WAL" in note for note in report.notes)
