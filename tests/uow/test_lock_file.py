"""The writer queue's lock file cannot stop a write or damage a file, whatever is at its path.

A symbolic or hard link planted at ``state.db-writer.lock`` (a shared folder, a restored backup),
a FIFO or a folder there, a file of another user, garbage in its header, a foreign process
holding locks on its bytes: the writes land, the file the link names keeps its bytes, and the
queue either repairs what it reads or runs without the lock file, saying so once. Files are
real, in ``tmp_path``; a foreign lock holder is a real process driven over a pipe.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import random
import sqlite3
import struct
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

from hermes_store import SessionDB
from hermes_store.uow import writequeue
from tests.support import lock_file_workers

CTX = mp.get_context("spawn")
#: Generous bound for a write that meets a foreign lock, on a loaded machine (a guard: the
#: fallback takes milliseconds to a few bounded waits).
BOUND_S = 30.0
NOBODY = 65534


@pytest.fixture
def db(tmp_path: Path) -> str:
    """A store file whose lock file does not exist yet (no write has been made)."""
    path = str(tmp_path / "state.db")
    SessionDB(path).close()
    assert not Path(f"{path}-writer.lock").exists()
    return path


@pytest.fixture
def procs() -> Iterator[list[BaseProcess]]:
    """Processes to kill if a test fails midway."""
    started: list[BaseProcess] = []
    yield started
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def start(
    procs: list[BaseProcess], target: Callable[..., None], *args: Any
) -> tuple[BaseProcess, Connection]:
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    procs.append(proc)
    return proc, ours


def expect(conn: Connection, within: float = 90.0) -> Any:
    assert conn.poll(within), f"a worker did not answer within {within} s"
    return conn.recv()


def lock_of(db: str) -> Path:
    return Path(f"{db}-writer.lock")


def write_some(db: str, count: int = 5) -> writequeue.WriteQueue:
    """``count`` writes through one store (each its own unit); returns the file's queue."""
    store = SessionDB(db)
    try:
        store.create_session("q", "cli")
        for n in range(count):
            store.append_message("q", "user", f"m{n}")
        queue = store.uow.write_queue
        assert queue is not None
        return queue
    finally:
        store.close()


def landed(db: str) -> list[str]:
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = raw.execute("SELECT content FROM messages WHERE session_id = 'q' ORDER BY id")
        return [row[0] for row in rows]
    finally:
        raw.close()


def said_off(caplog: pytest.LogCaptureFixture, db: str, why: str) -> None:
    """The queue said once, at WARNING, that it is off for this file, naming the path and why."""
    said = [r for r in caplog.records if "fair writer queue off" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].levelno == logging.WARNING
    assert str(lock_of(db)) in said[0].getMessage() and why in said[0].getMessage()


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="hermes_store.uow.writequeue")
    return caplog


# -- what is at the path -----------------------------------------------------------------------


def test_a_symlink_to_another_file_leaves_that_file_alone(
    db: str, tmp_path: Path, warnings: pytest.LogCaptureFixture
) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"the user's own notes\n" * 4)
    before = victim.read_bytes()
    lock_of(db).symlink_to(victim)
    queue = write_some(db)
    assert victim.read_bytes() == before
    assert landed(db) == [f"m{n}" for n in range(5)]
    assert not queue.enabled and queue.stats().turns == 0
    said_off(warnings, db, "symbolic link")


def test_a_symlink_to_the_database_itself_leaves_it_intact(
    db: str, warnings: pytest.LogCaptureFixture
) -> None:
    lock_of(db).symlink_to(Path(db).name)  # relative, as a restored backup would hold it
    write_some(db)
    assert landed(db) == [f"m{n}" for n in range(5)]
    store = SessionDB(db)  # and it still opens as a store
    assert store.message_count("q") == 5
    store.close()
    said_off(warnings, db, "symbolic link")


def test_a_hard_link_to_the_database_leaves_it_intact(
    db: str, warnings: pytest.LogCaptureFixture
) -> None:
    os.link(db, lock_of(db))
    write_some(db)
    assert landed(db) == [f"m{n}" for n in range(5)]
    said_off(warnings, db, "hard links")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_not_a_regular_file_turns_the_queue_off_once(
    db: str, kind: str, warnings: pytest.LogCaptureFixture
) -> None:
    if kind == "fifo":
        os.mkfifo(lock_of(db))
    else:
        os.mkdir(lock_of(db))
    queue = write_some(db, count=8)
    assert landed(db) == [f"m{n}" for n in range(8)]
    assert not queue.enabled
    assert queue.progress() == b""  # a waiter outside the line reads no movement, never hangs
    said_off(warnings, db, "not a regular file" if kind == "fifo" else "Is a directory")
    assert not [r for r in warnings.records if "write queue error" in r.getMessage()]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_lock_file_of_another_user_is_not_used(
    db: str, warnings: pytest.LogCaptureFixture
) -> None:
    lock = lock_of(db)
    lock.write_bytes(b"")
    os.chown(lock, NOBODY, NOBODY)
    queue = write_some(db)
    assert landed(db) == [f"m{n}" for n in range(5)]
    assert lock.read_bytes() == b""  # not written: its owner controls what it says
    assert not queue.enabled
    said_off(warnings, db, f"belongs to uid {NOBODY}")


# -- what is in the header ---------------------------------------------------------------------


def _random_header() -> bytes:
    raw = random.Random(20261205).randbytes(32)
    issued, _ = struct.unpack_from("<QQ", raw)
    assert issued >= writequeue.TICKET_LIMIT  # the seed gives an out-of-range counter
    return raw


HEADERS = {
    "counter at 2**64 - 1": struct.pack("<QQ", 2**64 - 1, 0),
    "counter at 2**64 - 2, served ahead": struct.pack("<QQ", 2**64 - 2, 2**64 - 1),
    "counter at the limit": struct.pack("<QQ", 1 << 62, (1 << 62) - 1),
    "all bits set": b"\xff" * 32,
    "random bytes": _random_header(),
}


@pytest.mark.parametrize("garbage", list(HEADERS), ids=list(HEADERS))
def test_a_damaged_header_is_repaired_and_writes_land(
    db: str, garbage: str, warnings: pytest.LogCaptureFixture
) -> None:
    write_some(db, count=0)  # the lock file exists, this process holds descriptors on it
    with open(lock_of(db), "r+b") as handle:
        handle.write(HEADERS[garbage])
    store = SessionDB(db)
    for n in range(6):  # transaction() blocks: a queue turn each (a lone hot write takes none)
        with store.transaction():
            store.append_message("q", "user", f"after {n}")
    queue = store.uow.write_queue
    store.close()
    assert landed(db) == [f"after {n}" for n in range(6)]
    assert queue is not None and queue.enabled
    stats = queue.stats()
    assert stats.fallbacks == 0 and stats.turns >= 6
    assert stats.max_depth < writequeue.SLOTS  # depth read from a sane header
    issued, served = queue.tickets()
    assert issued < writequeue.TICKET_LIMIT and 0 <= issued - served <= writequeue.SLOTS
    repaired = [r for r in warnings.records if "damaged header" in r.getMessage()]
    assert len(repaired) == 1 and str(lock_of(db)) in repaired[0].getMessage()
    with queue.turn() as turn:  # and the queue works on from there
        assert turn.queued


def test_a_lock_file_that_takes_no_more_writes_fails_no_write(
    db: str, warnings: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line's marks of progress (the byte a turn released, the head's heartbeat) cannot
    be written (a full copy-on-write file system): each write still lands and is answered. A
    failed mark raised after the turn's commit: an OSError for a write that had landed."""
    write_some(db, count=0)
    lock_file = str(lock_of(db))
    real_pwrite = os.pwrite

    def full(fd: int, data: bytes, offset: int) -> int:
        if offset in (16, 24) and os.readlink(f"/proc/self/fd/{fd}") == lock_file:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    store = SessionDB(db)
    for n in range(4):  # transaction() blocks: a queue turn each
        with store.transaction():
            store.append_message("q", "user", f"kept {n}")
    queue = store.uow.write_queue
    store.close()
    assert landed(db) == [f"kept {n}" for n in range(4)]
    assert queue is not None and queue.stats().turns >= 4
    assert any("mark of progress" in r.getMessage() for r in warnings.records)


# -- a foreign process holding locks on the file -----------------------------------------------

RANGES = {
    # every ticket slot: a new ticket finds no free one
    "slots": (writequeue.SLOTS_AT, writequeue.SLOTS),
    # from the first slot to the end of any file
    "slots and beyond": (writequeue.SLOTS_AT, 0),
    # the whole file, the ticket mutex too: each write waits the bounded wait, asleep
    "whole file": (0, 0),
}


@pytest.mark.parametrize("held", list(RANGES), ids=list(RANGES))
def test_a_foreign_lock_on_the_file_costs_a_bounded_sleeping_wait(
    db: str, held: str, procs: list[BaseProcess]
) -> None:
    write_some(db, count=0)
    start_at, length = RANGES[held]
    holder, holder_conn = start(
        procs, lock_file_workers.hold_range, str(lock_of(db)), start_at, length
    )
    assert expect(holder_conn) == "holding"
    writer, writer_conn = start(procs, lock_file_workers.timed_appends, db, 3, "0.3")
    assert expect(writer_conn) == "ready"
    writer_conn.send("go")
    assert writer_conn.poll(BOUND_S), f"3 writes did not return within {BOUND_S} s"
    wall, cpu, stats = writer_conn.recv()
    writer.join(30)
    # Waiting sleeps: the writer's CPU over the three writes stays far below its wall time
    # (today's fallbacks after a 0.3 s wait each; a spin would burn the whole wall time).
    assert cpu < 1.0 and cpu < 0.5 * max(wall, 0.3), (wall, cpu)
    mark = writequeue.STARVING_AT
    if start_at <= mark and (length == 0 or mark < start_at + length):
        # The starving mark reads as held: each write queues, meets the lock, falls back.
        assert stats.turns == 0 and stats.fallbacks == 3
    else:  # no head starves: each write tries SQLite's lock first and goes straight in
        assert stats.turns == 0 and stats.fallbacks == 0
    assert landed(db) == [f"foreign-lock {n}" for n in range(3)]
    holder_conn.send("release")
    assert expect(holder_conn) == "released"
    holder.join(30)
    queue = writequeue.WriteQueue(db)  # the lock file works on once the foreign lock is gone
    with queue.turn() as turn:
        assert turn.queued
    issued, served = queue.tickets()
    assert issued < writequeue.TICKET_LIMIT and 0 <= issued - served <= writequeue.SLOTS


# -- other files the package writes by name ----------------------------------------------------


class _FixedToken:
    """The "random" part of a temporary file's name, known in advance: stands for an attacker
    who guessed it (or won a race) and planted a link there first."""

    @staticmethod
    def token_hex(nbytes: int) -> str:
        return "ab" * nbytes


def _other_database(path: Path) -> None:
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE mine (note TEXT)")
    raw.execute("INSERT INTO mine VALUES ('another application keeps this')")
    raw.commit()
    raw.close()


def _still_other_database(path: Path) -> None:
    raw = sqlite3.connect(path)
    try:
        tables = [r[0] for r in raw.execute("SELECT name FROM sqlite_master")]
        assert tables == ["mine"]
        assert raw.execute("SELECT note FROM mine").fetchall() == [
            ("another application keeps this",)
        ]
    finally:
        raw.close()


def test_a_backup_never_writes_through_a_planted_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hermes_store import UnsafePathError
    from hermes_store.engine import files

    path = tmp_path / "state.db"
    store = SessionDB(path)
    store.create_session("q", "cli")
    victim = tmp_path / "app.db"
    _other_database(victim)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(files, "secrets", _FixedToken)  # the private name's random part
    (out / f".copy.db.{os.getpid()}.{'ab' * 8}.backup").symlink_to(victim)
    try:
        with pytest.raises(UnsafePathError, match="exists already"):
            store.backup(out / "copy.db")
    finally:
        store.close()
    _still_other_database(victim)
    assert not (out / "copy.db").exists()


def test_a_new_database_is_never_built_through_a_planted_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hermes_store import UnsafePathError
    from hermes_store.engine import files

    elsewhere = tmp_path / "autostart"
    elsewhere.mkdir()
    wanted = elsewhere / "run-me"  # where the link's owner wants a file of ours created
    path = tmp_path / "state.db"
    monkeypatch.setattr(files, "secrets", _FixedToken)  # the private name's random part
    (tmp_path / f".state.db.{os.getpid()}.{'ab' * 8}.new").symlink_to(wanted)
    with pytest.raises(UnsafePathError, match="exists already"):
        SessionDB(path)
    assert not os.path.lexists(wanted) and not os.path.lexists(path)


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _saved_nowhere(caplog: pytest.LogCaptureFixture, why: str) -> None:
    said = [r for r in caplog.records if "could not save the trajectory" in r.getMessage()]
    assert len(said) == 1 and why in said[0].getMessage(), [r.getMessage() for r in said]


def test_a_trajectory_is_not_appended_through_a_planted_link(
    in_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from hermes_store import save_trajectory

    victim = in_tmp / "authorized_keys"
    victim.write_bytes(b"ssh-ed25519 AAAA... me@host\n")
    (in_tmp / "trajectory_samples.jsonl").symlink_to(victim)  # a checked-out project's
    with caplog.at_level(logging.WARNING, logger="hermes_store.trajectory"):
        save_trajectory([{"from": "human", "value": "hi"}], "m", True)  # logs, never raises
    assert victim.read_bytes() == b"ssh-ed25519 AAAA... me@host\n"
    _saved_nowhere(caplog, "symbolic link")
    save_trajectory([], "m", False)  # the other default file, a plain one: written
    assert len((in_tmp / "failed_trajectories.jsonl").read_text().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_trajectory_is_not_appended_to_another_users_file(
    in_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from hermes_store import save_trajectory

    planted = in_tmp / "trajectory_samples.jsonl"
    planted.write_bytes(b"")
    planted.chmod(0o666)
    os.chown(planted, NOBODY, NOBODY)  # a file left in a shared folder to collect samples
    with caplog.at_level(logging.WARNING, logger="hermes_store.trajectory"):
        save_trajectory([{"from": "human", "value": "a secret plan"}], "m", True)
    assert planted.read_bytes() == b""
    _saved_nowhere(caplog, f"uid {NOBODY}")


def test_a_trajectory_fifo_is_refused_without_blocking(
    in_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    from hermes_store import save_trajectory

    fifo = in_tmp / "trajectory_samples.jsonl"
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING, logger="hermes_store.trajectory"):
        saver = threading.Thread(target=save_trajectory, args=([], "m", True), daemon=True)
        saver.start()
        saver.join(BOUND_S)
        blocked = saver.is_alive()
        if blocked:  # let it go: a reader makes its open return
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            saver.join(BOUND_S)
    assert not blocked, "save_trajectory blocked on a FIFO (no reader)"
    _saved_nowhere(caplog, "")  # no reader: the non-blocking open fails (ENXIO)
