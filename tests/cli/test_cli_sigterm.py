"""Stopping a command with a signal: SIGTERM (systemd's stop, ``timeout``, ``kill``) ends a
backup or an import as Ctrl-C does (its cleanup runs, it says what it had committed, exit
143), and Ctrl-C during ``doctor --rebuild-index`` is an interrupt (exit 130), not a database
error. Real processes, real signals, real files."""

from __future__ import annotations

import os
import random
import re
import signal
import sqlite3
import struct
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

import hermes_store
from hermes_store import SessionDB
from hermes_store.ops import maintenance
from hermes_store.schema import ddl
from tests.support.backends import sqlite_lock_is_free
from tests.support.cli_process import RUN_CLI
from tests.support.import_workers import export_records, write_export
from tests.support.leftover_workers import held_backup
from tests.support.waiting import GUARD, wait_until

#: One session per batch: thousands of commits, so the import is stopped midway.
BATCH = ("--batch-size", "1")


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "COLUMNS")}
    return env | extra


def _database(path: Path, messages: int) -> Path:
    """A database at head holding one session of ``messages`` messages of 40 words, written
    through plain sqlite3 (the store's triggers index them)."""
    hermes_store.upgrade(str(path))
    words = [f"w{number}x" for number in range(5000)]
    draw = random.Random(1)
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO sessions (id, source, started_at) VALUES ('s', 'cli', 0)")
        conn.executemany(
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "VALUES ('s', 'user', ?, 0)",
            ((" ".join(draw.choices(words, k=40)),) for _ in range(messages)),
        )
        conn.execute("UPDATE sessions SET message_count = ?", (messages,))
        conn.execute("COMMIT")
    return path


def _committed_sessions(path: Path) -> int:
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT count(*) FROM sessions").fetchone()[0])


@pytest.mark.parametrize("method", ["backup", "vacuum"])
def test_sigterm_during_a_backup_leaves_no_partial_and_exits_143(
    tmp_path: Path, method: str
) -> None:
    database = _database(tmp_path / "state.db", 5000)
    folder = tmp_path / "backups"
    folder.mkdir()
    target = folder / "state-2026-12-07.db"
    with held_backup(database, target, method) as child:
        wait_until(
            lambda: any(p.name.endswith(".backup") for p in folder.iterdir()),
            "the backup's private file",
        )
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=GUARD)
    assert child.returncode == 143, (out, err)
    lines = err.strip().splitlines()
    assert lines == ["Terminated. Nothing was written."], err
    assert sorted(p.name for p in folder.iterdir()) == []  # no copy, no partial, no journal
    with SessionDB(database) as store:
        assert store.message_count("s") == 5000


def test_sigterm_during_an_import_into_an_existing_file_exits_143_saying_what_landed(
    tmp_path: Path,
) -> None:
    database = _database(tmp_path / "state.db", 10)
    export = tmp_path / "big.jsonl"
    sessions = 3000
    write_export(export, export_records(sessions=sessions, per_session=2))
    child = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, "--db", str(database), "import", str(export), *BATCH],
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: _committed_sessions(database) > 3, "the import's first batches")
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=GUARD)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Terminated. "), err
    said = re.search(r"Terminated\. (\d+) session\(s\)", lines[0])
    assert said is not None, lines[0]
    landed = _committed_sessions(database) - 1
    # What it says landed did (a signal right after a batch's commit, before the import
    # counted it, leaves the count one batch short: transfer's accounting, not the signal's).
    assert int(said.group(1)) <= landed <= int(said.group(1)) + 1
    assert 3 <= landed < sessions  # stopped midway, with whole batches kept
    # The import's cleanup ran: FTS5's merging inside writes is back on (a killed import
    # leaves it off, and doctor warns).
    engine = sa.create_engine(f"sqlite:///{database}", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            settings = maintenance.fts5_settings(conn, ddl.FTS_TABLE)
    finally:
        engine.dispose()
    assert settings != maintenance.JOB_FTS5_SETTINGS


def _beats(database: Path, pid: int) -> bool:
    """Whether process ``pid`` has marked its heartbeat in the writer queue's lock file, as
    a migration's progress handler does while a statement runs (``writequeue.Turn.beat``:
    bytes 24..31, the pid shifted left 24 bits, xor the count). The lock file only: never
    the database or its sidecars."""
    try:
        mark = Path(f"{database}-writer.lock").read_bytes()[24:32]
    except FileNotFoundError:
        return False
    return len(mark) == 8 and struct.unpack("<Q", mark)[0] >> 24 == pid


@pytest.fixture(scope="module")
def large_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file whose full-text rebuild takes about a second: 100,000 messages."""
    return _database(tmp_path_factory.mktemp("large") / "state.db", 100_000)


def test_ctrl_c_during_rebuild_index_exits_130_as_an_interrupt(
    tmp_path: Path, large_database: Path
) -> None:
    database = tmp_path / "state.db"
    with (
        closing(sqlite3.connect(large_database)) as source,
        closing(sqlite3.connect(database)) as copy,
    ):
        source.backup(copy)
    child = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, "--db", str(database), "doctor", "--rebuild-index"],
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Inside the rebuild's statements (a second or so), SQLite's progress handler beats
        # for the writers queued behind, every 0.2 s: the first beat says the rebuild runs.
        wait_until(lambda: _beats(database, child.pid), "the rebuild's first heartbeat")
        assert not sqlite_lock_is_free(database)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=GUARD)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["Interrupted. Nothing was written."], err
    assert "Rebuilt" not in err
    assert sqlite_lock_is_free(database)
