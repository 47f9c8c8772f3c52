"""``db optimize --vacuum --swap``: a compacted copy renamed over the file, which is never
rewritten in place (a replica following its WAL, such as Litestream, breaks when it is).

Every test runs on a real file holding a pruned history (English and CJK messages, the
full-text indexes behind them) and compares a full logical dump of it before and after."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import sqlite3
import stat
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.engine import files
from hermes_store.errors import (
    AccessDeniedError,
    DatabaseLockedError,
    NotADatabaseError,
    StorageFullError,
)
from hermes_store.ops import backup, maintenance, retention
from hermes_store.schema import migrate
from tests.support import fts_damage_workers, swap_workers
from tests.support.seed_store import SeedSessionDB

#: A hang guard only: every wait is on an event.
DEADLINE = 120.0
SPAWN = mp.get_context("spawn")
KEPT = 20


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 sessions of 30 messages (every third in Japanese, every fifth a long tool output);
    the 40 that ended are pruned, so the file holds free pages and index delete records."""
    path = tmp_path_factory.mktemp("swap") / "state.db"
    with SessionDB(path) as store:
        for number in range(60):
            session = f"s{number:03d}"
            store.create_session(session, "cli")
            messages: list[dict[str, Any]] = []
            for turn in range(30):
                if turn % 3 == 0:
                    text = f"東京タワーの夜景 第{number}回 {turn}"
                elif turn % 5 == 0:
                    text = f"tool output {number} " + "deployment log line " * 200
                else:
                    text = f"alpha{number} question about the replica {turn}"
                role = "tool" if turn % 5 == 0 else ("user", "assistant")[turn % 2]
                messages.append({"role": role, "content": text})
            store.append_messages(session, messages)
            if number >= KEPT:
                store.end_session(session, "done")
        assert retention.run(store.uow, retention.Policy(-1)).sessions == 60 - KEPT
    return path


@pytest.fixture
def state(pruned: Path, tmp_path: Path) -> Path:
    return Path(shutil.copy(pruned, tmp_path / "state.db"))


def _dump(path: Path) -> list[str]:
    """Every table's rows and the schema, as SQL text, with the header's own versions."""
    with closing(sqlite3.connect(path)) as conn:
        header = [
            f"{name}={conn.execute(f'PRAGMA {name}').fetchone()[0]}"
            for name in ("user_version", "application_id", "page_size", "encoding")
        ]
        # Sorted: a VACUUM lists the schema in another order; each row names its table.
        return header + sorted(conn.iterdump())


def _pragmas(path: Path) -> dict[str, Any]:
    with closing(sqlite3.connect(path)) as conn:
        return {
            name: conn.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("auto_vacuum", "journal_mode", "freelist_count", "integrity_check")
        }


def _revision(path: Path) -> str:
    with closing(sqlite3.connect(path)) as conn:
        return str(conn.execute("SELECT version_num FROM alembic_version").fetchone()[0])


def _beside(path: Path) -> list[str]:
    """The folder's names other than the writer queue's lock files."""
    return sorted(p.name for p in path.parent.iterdir() if not p.name.endswith("-writer.lock"))


def _unchanged(path: Path) -> Callable[[], None]:
    """A check that ``path`` is the very same file, byte for byte, with nothing beside it."""
    key, data, names = (
        (path.stat().st_ino, path.stat().st_mtime_ns),
        path.read_bytes(),
        _beside(path),
    )

    def check() -> None:
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == key
        assert path.read_bytes() == data
        assert _beside(path) == names

    return check


def test_the_swap_compacts_keeps_every_row_and_the_original_store_writes_it(state: Path) -> None:
    dump, mode = _dump(state), stat.S_IMODE(state.stat().st_mode)
    assert _pragmas(state)["freelist_count"] > 0
    inode = state.stat().st_ino

    before, after = maintenance.vacuum_swap(state)

    assert after < before and state.stat().st_size == after
    assert state.stat().st_ino != inode  # a new file, not the old one rewritten
    assert _dump(state) == dump
    assert _pragmas(state) == {
        "auto_vacuum": 2,  # incremental
        "journal_mode": "wal",
        "freelist_count": 0,
        "integrity_check": "ok",
    }
    assert _revision(state) == migrate.head_revision()
    assert stat.S_IMODE(state.stat().st_mode) == mode == 0o600
    assert _beside(state) == ["state.db"]  # no copy, no -wal/-shm/-journal left
    with SessionDB(state) as store:
        assert store.check_search_index()
        assert {hit["session_id"] for hit in store.search_messages("alpha7")} == {"s007"}
        found = {hit["session_id"] for hit in store.search_messages("東京タワー", limit=100)}
        assert found and found <= {f"s{number:03d}" for number in range(KEPT)}
        assert store.search_messages("夜景")
        assert not store.search_messages("alpha45")  # pruned, and gone from the index
    seed = SeedSessionDB(state)
    try:
        seed.create_session("from-the-original", "cli")
        seed.append_message("from-the-original", "user", "written by the original store 東京駅")
        assert seed.search_messages("original")[0]["session_id"] == "from-the-original"
    finally:
        seed.close()
    with SessionDB(state) as store:
        assert store.search_messages("東京駅")[0]["session_id"] == "from-the-original"
        assert store.check_search_index()


@pytest.mark.parametrize("auto_vacuum", [0, 1, 2], ids=["none", "full", "incremental"])
def test_the_copy_gets_incremental_vacuum_and_a_refused_swap_leaves_the_mode_alone(
    state: Path, auto_vacuum: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The original store's files have no auto-vacuum; whatever the file's, the swapped file
    has it incremental. The live file is only read: setting the copy's mode through the live
    connection once wrote the live file (and took its write lock) when it had auto-vacuum."""
    with closing(sqlite3.connect(state, isolation_level=None)) as conn:
        conn.execute(f"PRAGMA auto_vacuum={auto_vacuum}")
        conn.execute("VACUUM")
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == auto_vacuum
    dump = _dump(state)
    checked = backup.check_snapshot

    def then_a_write(path: Path) -> list[str]:
        with SessionDB(state) as other:
            other.create_session("late", "cli")
        return checked(path)

    monkeypatch.setattr(backup, "check_snapshot", then_a_write)
    with pytest.raises(DatabaseLockedError, match="written while"):
        maintenance.vacuum_swap(state)
    assert _pragmas(state)["auto_vacuum"] == auto_vacuum

    monkeypatch.setattr(backup, "check_snapshot", checked)
    maintenance.vacuum_swap(state)
    assert _pragmas(state)["auto_vacuum"] == 2
    with SessionDB(state) as store:
        store.delete_session("late")
    assert _dump(state) == dump


def test_a_write_after_the_snapshot_refuses_the_swap_and_changes_nothing(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write from another connection (closed again) between the copy and the lock."""
    checked = backup.check_snapshot
    inode = state.stat().st_ino

    def then_a_write(path: Path) -> list[str]:
        problems = checked(path)
        with SessionDB(state) as other:
            other.create_session("late", "cli")
            other.append_message("late", "user", "written while the copy was checked")
        return problems

    monkeypatch.setattr(backup, "check_snapshot", then_a_write)
    with pytest.raises(DatabaseLockedError, match="written while its compacted copy was made"):
        maintenance.vacuum_swap(state)
    assert state.stat().st_ino == inode
    assert _beside(state) == ["state.db"]
    with SessionDB(state) as store:
        assert store.get_messages("late")[0]["content"] == "written while the copy was checked"
        assert store.session_count() == KEPT + 1


def test_a_file_swapped_by_another_run_meanwhile_is_not_swapped_over(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another swap lands between this one's opening the file and its first read (the only
    moment this one holds no lock on it), then an agent writes to the new file. This swap
    then copies the old file: renaming that copy over the new one would lose the write."""
    connect = files.connect_sqlite
    landed: list[bool] = []

    def then_another_swap(where: Path, **options: Any) -> sqlite3.Connection:
        connection = connect(where, **options)
        if where == state and "timeout" not in options and not landed:
            landed.append(True)
            maintenance.vacuum_swap(state)
            with SessionDB(state) as agent:
                agent.create_session("on-the-new-file", "cli")
        return connection

    monkeypatch.setattr(files, "connect_sqlite", then_another_swap)
    with pytest.raises(DatabaseLockedError, match="replaced while its compacted copy was made"):
        maintenance.vacuum_swap(state)
    assert landed and _beside(state) == ["state.db"]
    with SessionDB(state) as store:
        assert store.get_session("on-the-new-file") is not None
    assert _pragmas(state)["integrity_check"] == "ok"


def test_the_swap_is_refused_while_another_process_has_the_file_open(state: Path) -> None:
    opened, release = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=swap_workers.hold_open, args=(str(state), opened, release))
    holder.start()
    try:
        assert opened.wait(DEADLINE)
        unchanged = _unchanged(state)
        with pytest.raises(DatabaseLockedError, match="open in another process"):
            maintenance.vacuum_swap(state)
        unchanged()
    finally:
        release.set()
        holder.join(DEADLINE)
    assert holder.exitcode == 0
    before, after = maintenance.vacuum_swap(state)  # alone now
    assert after < before


def _damage_btree(path: Path) -> None:
    """Garbage over the messages table's root page (no connection has the file open)."""
    with closing(sqlite3.connect(path)) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'messages'").fetchone()
    with path.open("r+b") as raw:
        raw.seek((root[0] - 1) * page_size)
        raw.write(b"\xa5" * page_size)


@pytest.mark.parametrize(
    "damage", [fts_damage_workers.damage_structure_record, _damage_btree], ids=["index", "b-tree"]
)
def test_a_damaged_file_is_not_swapped(state: Path, damage: Callable[[Path], None]) -> None:
    damage(state)
    unchanged = _unchanged(state)
    with pytest.raises(NotADatabaseError):
        maintenance.vacuum_swap(state)
    unchanged()
    result = CliRunner().invoke(cli, ["--db", str(state), "db", "optimize", "--vacuum", "--swap"])
    assert result.exit_code == 3, result.output
    unchanged()


def test_a_disk_too_full_for_the_copy_changes_nothing(state: Path, tiny_disk: Path) -> None:
    """The copy needs room beside the file; without it the swap fails and leaves no part of
    the copy behind."""
    path = Path(shutil.copy(state, tiny_disk / "state.db"))
    room = os.statvfs(tiny_disk)
    filler = tiny_disk / "filler"
    filler.write_bytes(bytes(room.f_bavail * room.f_frsize - 128 * 1024))  # 128 KiB stay free
    unchanged = _unchanged(path)
    with pytest.raises(StorageFullError):
        maintenance.vacuum_swap(path)
    unchanged()
    filler.unlink()
    maintenance.vacuum_swap(path)  # with room again, it goes through
    assert _dump(path) == _dump(state)


def test_a_symlinked_database_stays_a_symlink_and_the_file_keeps_its_mode(
    state: Path, tmp_path: Path
) -> None:
    os.chmod(state, 0o640)
    link = tmp_path / "elsewhere" / "state.db"
    link.parent.mkdir()
    link.symlink_to(state)
    dump, inode = _dump(state), state.stat().st_ino

    maintenance.vacuum_swap(link)

    assert link.is_symlink() and link.readlink() == state
    assert state.stat().st_ino != inode and not state.is_symlink()
    assert stat.S_IMODE(state.stat().st_mode) == 0o640
    assert _dump(link) == dump
    assert _beside(state) == ["elsewhere", "state.db"] and os.listdir(link.parent) == ["state.db"]


AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user")
NOBODY = 65534


@AS_ROOT
def test_root_swapping_a_users_file_leaves_it_the_users(state: Path) -> None:
    os.chown(state, NOBODY, NOBODY)
    maintenance.vacuum_swap(state)
    assert (state.stat().st_uid, state.stat().st_gid) == (NOBODY, NOBODY)
    assert stat.S_IMODE(state.stat().st_mode) == 0o600


@AS_ROOT
def test_a_copy_that_cannot_be_given_the_files_owner_is_not_swapped(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapped in, the copy would change hands (its owner could read it, the file's owner
    could not): refused before anything is copied. The refusal stands in for a user who
    may not give a file away."""
    os.chown(state, NOBODY, NOBODY)
    unchanged = _unchanged(state)

    def not_permitted(*_: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", not_permitted)
    with pytest.raises(AccessDeniedError, match="cannot be given that owner"):
        maintenance.vacuum_swap(state)
    unchanged()


@pytest.mark.parametrize("point", ["copying", "before-rename", "after-rename"])
def test_a_swap_killed_at_any_point_leaves_a_whole_file(state: Path, point: str) -> None:
    """SIGKILLed during its copy, with the old file out of WAL mode just before the rename,
    or just after it: the file at the path is the old one or the new one, every row in it
    (one only in the old file's WAL when the swap began its copy included), usable by the
    store and the original store; the next swap removes a copy left behind."""
    dump, inode = _dump(state), state.stat().st_ino
    reached, never = SPAWN.Event(), SPAWN.Event()
    swapping = SPAWN.Process(
        target=swap_workers.swap_until_killed, args=(str(state), point, reached, never)
    )
    swapping.start()
    try:
        assert reached.wait(DEADLINE), f"the swap never got to {point}"
        assert swapping.pid is not None
        os.kill(swapping.pid, signal.SIGKILL)
    finally:
        swapping.join(DEADLINE)
    assert swapping.exitcode == -signal.SIGKILL
    copies = [name for name in _beside(state) if name.endswith(".compact")]
    if point == "after-rename":
        assert state.stat().st_ino != inode and copies == []
    else:
        assert state.stat().st_ino == inode and len(copies) == 1
    if point != "copying":  # taken out of WAL mode, the old file left no WAL for the new one
        assert _beside(state) == sorted(["state.db", *copies])
    after = _dump(state)  # the commit that was only in the WAL is in the file
    assert [line for line in after if "in-the-wal" not in line] == dump
    assert len(after) == len(dump) + 1
    assert _pragmas(state)["integrity_check"] == "ok"
    with SessionDB(state) as store:
        assert store.check_search_index()
        assert store.get_session("in-the-wal") is not None
        store.append_message("s000", "user", "after the killed swap")
        assert store.search_messages("東京タワー")
    seed = SeedSessionDB(state)
    try:
        seed.append_message("s001", "user", "the original store after the killed swap")
    finally:
        seed.close()
    maintenance.vacuum_swap(state)  # the next run goes through
    assert _beside(state) == ["state.db"]  # and removed the killed run's copy
    assert _pragmas(state) == {
        "auto_vacuum": 2,
        "journal_mode": "wal",
        "freelist_count": 0,
        "integrity_check": "ok",
    }


def test_a_connection_opened_before_the_swap_cannot_write_into_the_old_file(
    state: Path,
) -> None:
    """Opened (not yet used) before the swap, it holds no lock, so the swap goes on; SQLite
    then refuses its writes (the file it has open was moved away) and, the old file having
    left WAL mode, it opens no -wal/-shm under the new file's names."""
    stale = sqlite3.connect(state, isolation_level=None)
    try:
        done = CliRunner().invoke(cli, ["--db", str(state), "db", "optimize", "--vacuum", "--swap"])
        assert done.exit_code == 0, done.output
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            stale.execute("INSERT INTO sessions (id, source, started_at) VALUES ('x', 'cli', 0)")
        assert _beside(state) == ["state.db"]
    finally:
        stale.close()
    with SessionDB(state) as store:
        assert store.get_session("x") is None
        store.create_session("y", "cli")
    assert _pragmas(state)["integrity_check"] == "ok"


def test_cli_vacuum_swap_reports_sizes_and_refusals(state: Path) -> None:
    runner = CliRunner()
    alone = runner.invoke(cli, ["--db", str(state), "db", "optimize", "--swap"])
    assert alone.exit_code == 2, alone.output
    assert "--swap goes with --vacuum" in alone.output

    done = runner.invoke(cli, ["--db", str(state), "db", "optimize", "--vacuum", "--swap"])
    assert done.exit_code == 0, done.output
    assert "compacted copy swapped in" in done.output
    sizes = re.search(r"([\d,]+) -> ([\d,]+) bytes", done.output)
    assert sizes is not None, done.output
    before, after = (int(size.replace(",", "")) for size in sizes.groups())
    assert after < before and state.stat().st_size == after

    again = runner.invoke(
        cli, ["--db", str(state), "db", "optimize", "--vacuum", "--swap", "--json"]
    )
    assert again.exit_code == 0, again.output
    report = json.loads(again.output)
    assert report == {"vacuum": True, "swap": True, "bytes_before": after, "bytes_after": after}

    opened, release = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=swap_workers.hold_open, args=(str(state), opened, release))
    holder.start()
    try:
        assert opened.wait(DEADLINE)
        locked = runner.invoke(cli, ["--db", str(state), "db", "optimize", "--vacuum", "--swap"])
    finally:
        release.set()
        holder.join(DEADLINE)
    assert locked.exit_code == 3, locked.output
    assert "open in another process" in locked.output
