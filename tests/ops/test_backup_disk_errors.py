"""Backup and restore on a disk that refuses writes: the package's own error (the command
line's one line and exit 3), nothing left beside the target, the live database as it was.

A full disk is stood in for by ``RLIMIT_FSIZE`` in a child process (with ``SIGXFSZ``
ignored, so a write past the limit fails with ``EFBIG`` instead of killing the process): the
copy's writes fail the way they fail on a full disk, on real files, without mounting anything.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from hermes_store import SessionDB
from hermes_store.errors import StorageFullError, StorageIOError
from hermes_store.ops import backup
from tests.support.cli_process import RUN_CLI

TIMEOUT = 120  # a hang guard only
#: Bytes any file of the child may grow to: room for a -shm (32 KiB) and a small live
#: database, not for a copy of a large one.
LIMIT = 256 * 1024
#: Error classes a refused write may be named by (which one depends on SQLite's code).
DISK_ERRORS = {StorageFullError.__name__, StorageIOError.__name__}


def _seed(path: Path, sessions: int, messages: int = 30) -> None:
    """A store of ``sessions`` sessions of ``messages`` 1.6 KB messages each."""
    with SessionDB(path) as db:
        for n in range(sessions):
            db.create_session(f"s{n}", "cli")
            db.append_messages(
                f"s{n}",
                [{"role": "user", "content": f"word{n}-{i} " * 200} for i in range(messages)],
            )


def _content(path: Path) -> tuple[list[object], int, int]:
    """The integrity check, the message count and the content's length of a database file."""
    connection = sqlite3.connect(path)
    try:
        check = [row[0] for row in connection.execute("PRAGMA integrity_check")]
        count, length = connection.execute(
            "SELECT count(*), coalesce(sum(length(content)), 0) FROM messages"
        ).fetchone()
    finally:
        connection.close()
    return check, int(count), int(length)


def _limited() -> None:
    """In the child, before it runs: files stop growing at LIMIT, and a write past it fails
    (EFBIG) instead of killing the process."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


#: Runs one call of :mod:`hermes_store.ops.backup` and prints what it raised, as JSON.
_CALL = """
import json, sys
import sqlalchemy as sa
from hermes_store.ops import backup
what, live, other, method = sys.argv[1:5]
try:
    if what == "backup":
        backup.backup(sa.create_engine(f"sqlite:///{live}"), other, method=method)
    else:
        backup.restore(live, other)
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
else:
    print(json.dumps({"error": None, "message": ""}))
"""


def _run_limited(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -c argv...`` in a child whose files stop growing at LIMIT."""
    return subprocess.run(
        [sys.executable, "-c", *argv],
        preexec_fn=_limited,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def _call_limited(what: str, live: Path, other: Path, method: str = "backup") -> dict[str, str]:
    done = _run_limited(_CALL, what, str(live), str(other), method)
    assert done.returncode == 0, done.stderr
    result: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def large_live(tmp_path: Path) -> Path:
    """A live store of about 2 MB, far past LIMIT, in its own folder."""
    path = tmp_path / "live" / "state.db"
    path.parent.mkdir()
    _seed(path, 40)
    assert path.stat().st_size > 4 * LIMIT
    return path


@pytest.mark.parametrize("method", ["backup", "vacuum"])
def test_a_backup_onto_a_full_disk_raises_the_package_error_and_leaves_nothing(
    large_live: Path, tmp_path: Path, method: str
) -> None:
    before = _content(large_live)
    folder = tmp_path / "backups"
    folder.mkdir()

    result = _call_limited("backup", large_live, folder / "copy.db", method)

    assert result["error"] in DISK_ERRORS, result
    assert "copy.db" in result["message"]
    assert sorted(os.listdir(folder)) == []  # no copy, no .partial, no -journal/-wal/-shm
    assert _content(large_live) == before
    assert before[0] == ["ok"]


@pytest.mark.parametrize("method", ["backup", "vacuum"])
def test_the_backup_command_on_a_full_disk_is_one_line_exit_3(
    large_live: Path, tmp_path: Path, method: str
) -> None:
    before = _content(large_live)
    folder = tmp_path / "backups"
    folder.mkdir()

    argv = ["--db", str(large_live), "backup", str(folder / "copy.db"), "--method", method]
    done = _run_limited(RUN_CLI, *argv)

    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "backup to" in errors[0], done.stderr
    assert sorted(os.listdir(folder)) == []
    assert _content(large_live) == before


def test_a_restore_onto_a_full_disk_raises_the_package_error_and_changes_nothing(
    tmp_path: Path,
) -> None:
    live = tmp_path / "live" / "state.db"
    live.parent.mkdir()
    _seed(live, 1, messages=3)
    snapshot = tmp_path / "snapshots" / "big.db"
    snapshot.parent.mkdir()
    _seed(snapshot, 40)  # restoring it writes far past LIMIT into the live file's WAL
    before = _content(live)
    listed = sorted(os.listdir(live.parent))  # the database (and its store's writer lock)
    assert live.stat().st_size < LIMIT < snapshot.stat().st_size

    result = _call_limited("restore", live, snapshot)

    assert result["error"] in DISK_ERRORS, result
    assert str(snapshot) in result["message"]
    assert _content(live) == before
    assert sorted(os.listdir(live.parent)) == listed  # no -wal, -shm or -journal left
    with SessionDB(live) as db:  # the store opens it and finds what it held
        assert db.message_count() == before[1]
        assert db.check_search_index()


@pytest.mark.parametrize("method", ["backup", "vacuum"])
def test_a_failed_flush_of_the_copy_is_a_storage_error_not_a_lost_one(
    large_live: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: backup.Method
) -> None:
    """A disk that fails at fsync (EIO, or ENOSPC on file systems that allocate late): the
    flush's error is the one raised, not the OSError bare nor VACUUM INTO's ``interrupted``
    (the copy outgrows SQLite's cache, so its progress handler sees it grow and flushes)."""
    live = large_live
    before = _content(live)

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", failing)
    monkeypatch.setattr(backup, "VACUUM_CHECK_OPS", 100)  # the handler runs during the copy
    folder = tmp_path / "backups"
    folder.mkdir()
    engine = sa.create_engine(f"sqlite:///{live}")
    try:
        with pytest.raises(StorageIOError, match="flush the copy"):
            backup.backup(
                engine, folder / "copy.db", method=method, sync_bytes=4096, pages_per_step=4
            )
    finally:
        engine.dispose()
    assert sorted(os.listdir(folder)) == []
    assert _content(live) == before
