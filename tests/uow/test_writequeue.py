"""The fair writer queue: FIFO across processes and threads, the kernel freeing the places of
killed writers, a bounded wait past stopped ones, foreign writers, fork, and no OFD locks.

Processes are real (``spawn``); they report through pipes and act on the test's word. "Queued"
is read from the lock file's ticket counter, never inferred from a pause.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

from hermes_store import SessionDB
from hermes_store.uow import writequeue
from tests.support import queue_workers

CTX = mp.get_context("spawn")
GUARD = 90.0  # deadlock guard for any single wait; never a speed expectation


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "state.db")
    store = SessionDB(path)
    store.create_session("q", "cli")
    store.close()
    return path


def start(target: Callable[..., None], *args: Any) -> tuple[BaseProcess, Connection]:
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    return proc, ours


def expect(conn: Connection) -> Any:
    assert conn.poll(GUARD), "a worker did not answer"
    return conn.recv()


def wait_for_tickets(queue: writequeue.WriteQueue, issued: int) -> None:
    """Until ``issued`` tickets were handed out (read from the lock file itself)."""
    deadline = time.monotonic() + GUARD
    while queue.tickets()[0] < issued:
        assert time.monotonic() < deadline, f"tickets stuck at {queue.tickets()}"
        time.sleep(0.002)


def contents(db: str) -> list[str]:
    """Messages of session "q" in commit order (ids are assigned under the write lock)."""
    raw = sqlite3.connect(db)
    try:
        rows = raw.execute("SELECT content FROM messages WHERE session_id = 'q' ORDER BY id")
        return [row[0] for row in rows]
    finally:
        raw.close()


def check_totals(db: str, messages: int, increments: int) -> None:
    store = SessionDB(db)
    try:
        session = store.get_session("q")
        assert session is not None
        assert session["message_count"] == store.message_count("q") == messages
        assert session["input_tokens"] == increments
        assert session["output_tokens"] == 2 * increments
        assert store.check_search_index()
    finally:
        store.close()
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        raw.close()


@pytest.fixture
def reap() -> Iterator[list[BaseProcess]]:
    """Processes to resume and kill if a test fails midway (stopped ones would linger)."""
    procs: list[BaseProcess] = []
    yield procs
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(10)


# -- in one process ----------------------------------------------------------------------------


def test_lock_file_is_private_and_beside_the_database(db: str) -> None:
    old = os.umask(0)
    try:
        store = SessionDB(db)
        store.append_message("q", "user", "hello")
        queue = store.uow.write_queue
        store.close()
    finally:
        os.umask(old)
    lock = Path(f"{db}-writer.lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert queue is not None and queue.lock_path == lock


def test_threads_of_one_process_take_turns_in_arrival_order(db: str) -> None:
    queue = writequeue.for_database(db)
    store = SessionDB(db)
    threads = []

    def write(text: str) -> None:  # a transaction() block: never grouped, one turn each
        with store.transaction():
            store.append_message("q", "user", text)

    with queue.turn() as turn:
        assert turn.queued
        issued = queue.tickets()[0]
        for index in range(4):
            thread = threading.Thread(target=write, args=(f"thread {index}",))
            thread.start()
            threads.append(thread)
            wait_for_tickets(queue, issued + index + 1)
    for thread in threads:
        thread.join(GUARD)
    store.close()
    assert contents(db) == [f"thread {index}" for index in range(4)]
    stats = queue.stats()
    assert stats.enabled and stats.turns >= 5 and stats.waits >= 4 and stats.fallbacks == 0
    assert stats.max_depth >= 2 and stats.wait_seconds > 0 and stats.hold_seconds > 0


def test_a_waiter_gives_up_when_the_line_does_not_move(db: str) -> None:
    queue = writequeue.for_database(db)
    impatient = writequeue.WriteQueue(db, wait_timeout=0.2)
    with queue.turn() as first, impatient.turn() as second:
        assert first.queued and not second.queued
        assert second.reason == "wait timed out"
    with impatient.turn() as third:  # the line is free again: queued at once
        assert third.queued
    stats = impatient.stats()
    assert stats.fallbacks == 1 and stats.fallback_reasons == {"wait timed out": 1}
    assert stats.turns == 1 and stats.max_wait_seconds >= 0.2


def test_without_ofd_locks_writers_fall_back_and_it_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = str(tmp_path / "state.db")
    # A directory where the lock file should be: opening it fails for real (EISDIR).
    os.mkdir(f"{db}-writer.lock")
    caplog.set_level(logging.WARNING, logger="hermes_store.uow.writequeue")
    store = SessionDB(db)
    store.create_session("q", "cli")

    def work(thread: int) -> None:
        for op in range(10):
            store.append_message("q", "user", f"t{thread} o{op}")
            store.update_token_counts("q", input_tokens=1, output_tokens=2)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(GUARD)
    queue = store.uow.write_queue
    store.close()
    assert queue is not None and not queue.enabled
    assert queue.stats().turns == 0
    check_totals(db, 40, 40)
    said = [r for r in caplog.records if "fair writer queue off" in r.getMessage()]
    assert len(said) == 1 and "Is a directory" in said[0].getMessage()


def test_a_lock_file_that_cannot_exist_turns_the_queue_off(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    queue = writequeue.WriteQueue(tmp_path / "x.db", lock_path=blocker / "x.db-writer.lock")
    with queue.turn() as turn:
        assert not turn.queued
    assert not queue.enabled


def test_progress_marks_move_with_the_line_and_read_empty_without_a_lock_file(
    tmp_path: Path,
) -> None:
    """What a waiter outside the line watches: the marks change when a turn ends or the head
    beats, and a lock file that is not there reads as no movement (never an error)."""
    queue = writequeue.WriteQueue(tmp_path / "state.db")
    assert queue.progress() == b""
    with queue.turn() as turn:
        assert turn.queued
        before = queue.progress()
        turn.still_trying()
        beating = queue.progress()
    assert beating != before and queue.progress() != beating


def test_switched_off_by_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(writequeue.ENV_SWITCH, "0")
    db = tmp_path / "off.db"
    with writequeue.WriteQueue(db).turn() as turn:
        assert not turn.queued and turn.reason == "disabled"
    store = SessionDB(db)
    store.create_session("q", "cli")
    store.append_message("q", "user", "no queue")
    store.close()
    assert not Path(f"{db}-writer.lock").exists()


def test_a_forked_child_queues_on_descriptors_of_its_own(db: str) -> None:
    store = SessionDB(db)
    with store.transaction():  # a turn: the pool now holds a descriptor
        store.append_message("q", "user", "parent before fork")
    queue = writequeue.for_database(db)
    assert queue.stats().turns >= 1 and queue.descriptors >= 1
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: take a turn, hold it until the parent has tried its own
        code = 1
        try:
            # The very object the parent used (as a store opened before the fork would).
            with queue.turn() as turn:
                os.write(to_parent_w, b"Q" if turn.queued else b"F")
                os.read(to_child_r, 1)
            child = SessionDB(db)
            child.append_message("q", "user", "child after fork")
            child.close()
            code = 0
        finally:
            os._exit(code)
    try:
        assert os.read(to_parent_r, 1) == b"Q"
        # Sharing an open file description with the child would make its locks ours: the
        # parent would get a turn at once. With descriptors of its own it waits (and gives up).
        patience = queue.wait_timeout
        queue.wait_timeout = 0.3
        with queue.turn() as turn:
            pass
        queue.wait_timeout = patience
    finally:
        os.write(to_child_w, b"x")
        _, status = os.waitpid(pid, 0)
    assert not turn.queued and turn.reason == "wait timed out"
    assert os.waitstatus_to_exitcode(status) == 0
    assert writequeue.for_database(db) is queue  # the registry is per process
    store.append_message("q", "user", "parent after fork")
    store.close()
    assert contents(db) == ["parent before fork", "child after fork", "parent after fork"]


# -- across processes ----------------------------------------------------------------------------


@pytest.mark.slow
def test_processes_take_turns_in_the_order_they_queued(
    db: str, monkeypatch: pytest.MonkeyPatch, reap: list[BaseProcess]
) -> None:
    monkeypatch.setenv(writequeue.ENV_WAIT, "60")  # no fallback: only the queue lets them in
    queue = writequeue.for_database(db)
    workers = [start(queue_workers.append_on_go, db, f"p{index}") for index in range(5)]
    reap.extend(proc for proc, _ in workers)
    for _, conn in workers:
        assert expect(conn) == "ready"
    with queue.turn() as turn:
        assert turn.queued
        turn.mark_starving()  # newcomers queue behind, in the order they came
        issued = queue.tickets()[0]
        for index, (_, conn) in enumerate(workers):
            conn.send("go")
            wait_for_tickets(queue, issued + index + 1)
    for _, conn in workers:
        assert expect(conn) == "done"
    assert contents(db) == [f"p{index}" for index in range(5)]


@pytest.mark.slow
def test_a_killed_waiter_frees_its_place(
    db: str, monkeypatch: pytest.MonkeyPatch, reap: list[BaseProcess]
) -> None:
    monkeypatch.setenv(writequeue.ENV_WAIT, "60")  # only the kernel's release can free them
    queue = writequeue.for_database(db)
    (victim, victim_conn), (survivor, survivor_conn) = (
        start(queue_workers.append_on_go, db, label) for label in ("victim", "survivor")
    )
    reap.extend((victim, survivor))
    assert expect(victim_conn) == expect(survivor_conn) == "ready"
    with queue.turn() as turn:
        turn.mark_starving()  # newcomers queue behind it
        issued = queue.tickets()[0]
        victim_conn.send("go")
        wait_for_tickets(queue, issued + 1)
        survivor_conn.send("go")
        wait_for_tickets(queue, issued + 2)
        victim.kill()
        victim.join(GUARD)
    assert expect(survivor_conn) == "done"
    assert contents(db) == ["survivor"]


@pytest.mark.slow
def test_a_killed_turn_holder_frees_the_line_and_loses_nothing_committed(
    db: str, monkeypatch: pytest.MonkeyPatch, reap: list[BaseProcess]
) -> None:
    monkeypatch.setenv(writequeue.ENV_WAIT, "60")
    queue = writequeue.for_database(db)
    holder, holder_conn = start(queue_workers.hold_turn, db)
    waiter, waiter_conn = start(queue_workers.append_on_go, db, "next in line")
    reap.extend((holder, waiter))
    assert expect(holder_conn) == ("holding", True)
    assert expect(waiter_conn) == "ready"
    issued = queue.tickets()[0]
    waiter_conn.send("go")
    wait_for_tickets(queue, issued + 1)
    holder.kill()
    holder.join(GUARD)
    assert expect(waiter_conn) == "done"
    assert contents(db) == ["holder committed", "next in line"]
    check_totals(db, 2, 0)


def _others_write_past(
    db: str, stuck: BaseProcess, reap: list[BaseProcess], *, processes: int = 2
) -> list[Any]:
    """Writers (2 threads x 5 ops each) started after ``stuck`` queued; all finish."""
    writers = [start(queue_workers.writer_threads, db, "ours", w, 2, 5) for w in range(processes)]
    reap.extend(proc for proc, _ in writers)
    for _, conn in writers:
        assert expect(conn) == "ready"
    for _, conn in writers:
        conn.send("go")
    reports = [expect(conn) for _, conn in writers]
    assert stuck.is_alive()
    for errors, _ in reports:
        assert errors == []
    return [stats for _, stats in reports]


@pytest.mark.slow
def test_a_stopped_waiter_costs_the_others_one_bounded_wait(
    db: str, monkeypatch: pytest.MonkeyPatch, reap: list[BaseProcess]
) -> None:
    monkeypatch.setenv(writequeue.ENV_WAIT, "0.3")
    queue = writequeue.WriteQueue(db, wait_timeout=60)
    stopped, stopped_conn = start(queue_workers.append_on_go, db, "stopped")
    reap.append(stopped)
    assert expect(stopped_conn) == "ready"
    assert stopped.pid is not None
    with queue.turn() as turn:
        turn.mark_starving()  # the stopped writer queues behind it
        issued = queue.tickets()[0]
        stopped_conn.send("go")
        wait_for_tickets(queue, issued + 1)
        os.kill(stopped.pid, signal.SIGSTOP)
    stats = _others_write_past(db, stopped, reap)
    # The stopped writer is the head now but never marks the line starving: the others try
    # SQLite's lock first and go past it; whoever queued right behind it waited, gave up, and
    # wrote anyway. Nothing else made anyone fall back.
    assert all(set(s.fallback_reasons) <= {"wait timed out"} for s in stats)
    os.kill(stopped.pid, signal.SIGCONT)
    assert expect(stopped_conn) == "done"
    check_totals(db, 1 + 20, 20)


@pytest.mark.slow
def test_a_stopped_turn_holder_outside_sqlite_costs_one_bounded_wait(
    db: str, monkeypatch: pytest.MonkeyPatch, reap: list[BaseProcess]
) -> None:
    monkeypatch.setenv(writequeue.ENV_WAIT, "0.3")
    holder, holder_conn = start(queue_workers.hold_turn, db)
    reap.append(holder)
    assert expect(holder_conn) == ("holding", True)
    assert holder.pid is not None
    os.kill(holder.pid, signal.SIGSTOP)
    stats = _others_write_past(db, holder, reap)
    assert sum(s.fallbacks for s in stats) >= 1
    os.kill(holder.pid, signal.SIGCONT)
    holder_conn.send("let go")
    assert expect(holder_conn) == "released"
    check_totals(db, 1 + 20, 20)


@pytest.mark.slow
def heartbeat(db: str) -> bytes:
    """The queue head's heartbeat (bytes 24..31 of the lock file)."""
    with open(f"{db}-writer.lock", "rb") as lock:  # the lock file, never the database
        lock.seek(24)
        return lock.read(8)


def test_a_foreign_writer_holding_the_lock_is_waited_out(db: str, reap: list[BaseProcess]) -> None:
    queue = writequeue.for_database(db)
    writers = [start(queue_workers.writer_threads, db, "ours", w, 2, 5) for w in range(2)]
    reap.extend(proc for proc, _ in writers)
    for _, conn in writers:
        assert expect(conn) == "ready"
    foreign = sqlite3.connect(db, isolation_level=None)
    try:
        foreign.execute("BEGIN IMMEDIATE")
        foreign.execute("UPDATE sessions SET title = 'foreign' WHERE id = 'q'")
        issued = queue.tickets()[0]
        for _, conn in writers:
            conn.send("go")
        # The head meets the foreign lock and keeps its place, retrying with its short busy
        # timeout and beating; the other process waits behind it in the kernel.
        wait_for_tickets(queue, issued + 2)
        beat = heartbeat(db)
        deadline = time.monotonic() + GUARD
        while heartbeat(db) == beat:
            assert time.monotonic() < deadline, "the head never beat"
            time.sleep(0.01)
        foreign.execute("COMMIT")
    finally:
        foreign.close()
    for _, conn in writers:
        errors, stats = expect(conn)
        assert errors == [] and stats.turns > 0 and stats.fallbacks == 0
    check_totals(db, 20, 20)
    store = SessionDB(db)
    assert (store.get_session("q") or {})["title"] == "foreign"
    store.close()


@pytest.mark.slow
def test_original_store_processes_alongside_ours(db: str, reap: list[BaseProcess]) -> None:
    kinds = ["original", "original", "ours", "ours", "ours"]
    writers = [
        start(queue_workers.writer_threads, db, kind, w, 2, 6) for w, kind in enumerate(kinds)
    ]
    reap.extend(proc for proc, _ in writers)
    for _, conn in writers:
        assert expect(conn) == "ready"
    for _, conn in writers:
        conn.send("go")
    for _, conn in writers:
        errors, _ = expect(conn)
        assert errors == []
    total = len(kinds) * 2 * 6
    check_totals(db, total, total)
    assert len(set(contents(db))) == total


@pytest.mark.slow
def test_eight_processes_of_four_threads_land_every_write_once(
    db: str, reap: list[BaseProcess]
) -> None:
    writers = [start(queue_workers.writer_threads, db, "ours", w, 4, 4) for w in range(8)]
    reap.extend(proc for proc, _ in writers)
    for _, conn in writers:
        assert expect(conn) == "ready"
    for _, conn in writers:
        conn.send("go")
    reports = [expect(conn) for _, conn in writers]
    for errors, stats in reports:
        assert errors == [] and stats.enabled and stats.turns > 0
    total = 8 * 4 * 4
    check_totals(db, total, total)
    assert len(set(contents(db))) == total
