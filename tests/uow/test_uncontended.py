"""The uncontended write: a single-call write that finds no one else writing goes straight in
(no queue turn, no group); one that meets a writer joins the line, and a newcomer never goes
past a head that marked the line starving.

Real SQLite files and threads; "in line" is read from the lock file's ticket counter and the
store's own counters, never inferred from a pause.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hermes_store import SessionDB
from hermes_store.uow import uncontended, writequeue

GUARD = 120.0  # a bound on waits that only a bug reaches


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SessionDB]:
    store = SessionDB(tmp_path / "state.db")
    store.create_session("s", "cli")
    yield store
    store.close()


def _path(store: SessionDB) -> Path:
    return Path(store.engine.url.database or "")


def _queue(store: SessionDB) -> writequeue.WriteQueue:
    queue = store.uow.write_queue
    assert queue is not None and queue.enabled
    return queue


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _in_thread(call: Callable[[], Any]) -> tuple[list[Any], threading.Thread]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("ok", call()))
        except BaseException as error:
            outcome.append(("error", error))

    thread = threading.Thread(target=run)
    thread.start()
    return outcome, thread


def _contents(store: SessionDB) -> list[str]:
    return [m["content"] for m in store.get_messages("s")]


@pytest.mark.unit
def test_a_lone_writer_takes_no_queue_turn_and_forms_no_group(db: SessionDB) -> None:
    queue = _queue(db)
    before, tickets, turns = db.stats(), queue.tickets(), queue.stats().turns
    for index in range(10):
        db.append_message("s", "user", f"m{index}")
        db.update_token_counts("s", input_tokens=1)
    db.append_messages("s", [{"role": "user", "content": "batch"}] * 3)
    after = db.stats()
    assert after.uncontended_writes - before.uncontended_writes == 21
    assert after.write_units - before.write_units == 21
    assert (after.queue_turns, after.groups) == (before.queue_turns, before.groups)
    assert queue.tickets() == tickets and queue.stats().turns == turns  # not one ticket taken
    session = db.get_session("s")
    assert session is not None
    assert (session["message_count"], session["input_tokens"]) == (13, 10)


def test_a_newcomer_tries_the_lock_before_a_head_that_has_not_starved(db: SessionDB) -> None:
    """Another member of the line (its own descriptors: as another process) holds a turn
    without SQLite's lock and has not marked the line starving: a newcomer finds SQLite's lock
    free and goes straight in, taking no ticket (the original store's barging, which keeps
    writers that meet as fast as one alone)."""
    queue = _queue(db)
    other = writequeue.WriteQueue(_path(db))
    before = db.stats()
    with other.turn() as turn:
        assert turn.queued and not queue.empty() and not queue.starving()
        issued = queue.tickets()[0]
        db.append_message("s", "user", "past the head")
        assert queue.tickets()[0] == issued  # not one ticket taken
    after = db.stats()
    assert after.uncontended_writes == before.uncontended_writes + 1
    assert after.queue_turns == before.queue_turns
    assert _contents(db) == ["past the head"]


def test_a_starving_head_is_never_overtaken(db: SessionDB) -> None:
    """The head of the line has waited its share and marked the line starving: a newcomer
    joins the line behind it instead of trying SQLite's lock, and lands once the head lets go;
    with the mark gone (it goes with the turn), writes go straight in again."""
    queue = _queue(db)
    db.append_message("s", "user", "alone before")
    other = writequeue.WriteQueue(_path(db))
    before = db.stats()
    with other.turn() as turn:
        assert turn.queued
        turn.mark_starving()
        assert queue.starving()
        issued = queue.tickets()[0]
        outcome, thread = _in_thread(lambda: db.append_message("s", "user", "behind"))
        _wait_until(lambda: queue.tickets()[0] > issued, "the write to take a ticket")
        assert thread.is_alive() and not outcome  # waiting in line, not written
        assert _contents(db) == ["alone before"]
    assert not queue.starving()
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    after = db.stats()
    assert after.uncontended_writes == before.uncontended_writes
    assert after.queue_turns == before.queue_turns + 1 and after.groups == before.groups + 1
    db.append_message("s", "user", "alone after")
    assert db.stats().uncontended_writes == after.uncontended_writes + 1
    assert _contents(db) == ["alone before", "behind", "alone after"]


def test_threads_that_meet_group_rather_than_go_past_a_line(db: SessionDB) -> None:
    """Threads of this process met (a group took two units): while anyone stands in line, a
    write waits for its process's next group instead of going straight in (one commit for the
    threads that pile up behind it, not one more for it); with the line empty it goes straight
    in again."""
    queue = _queue(db)
    other = writequeue.WriteQueue(_path(db))
    with other.turn() as turn:  # a starving head: both writes queue, in one group
        turn.mark_starving()
        issued = queue.tickets()[0]
        first = _in_thread(lambda: db.append_message("s", "user", "one"))
        _wait_until(lambda: queue.tickets()[0] > issued, "the leader to take a ticket")
        second = _in_thread(lambda: db.append_message("s", "user", "two"))
        assert db.uow.wait_for_queued_units(1, GUARD)
    for outcome, thread in (first, second):
        thread.join(GUARD)
        assert outcome and outcome[0][0] == "ok", outcome
    assert db.stats().max_group == 2
    before = db.stats()
    with other.turn() as turn:  # not starving, SQLite's lock free: still, the write queues
        assert turn.queued and not queue.starving()
        issued = queue.tickets()[0]
        outcome, thread = _in_thread(lambda: db.append_message("s", "user", "three"))
        _wait_until(lambda: queue.tickets()[0] > issued, "the write to take a ticket")
        assert thread.is_alive() and not outcome
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    after = db.stats()
    assert after.uncontended_writes == before.uncontended_writes
    assert after.queue_turns == before.queue_turns + 1
    db.append_message("s", "user", "four")  # the line is empty: straight in
    assert db.stats().uncontended_writes == after.uncontended_writes + 1
    assert sorted(_contents(db)) == ["four", "one", "three", "two"]


def test_a_head_that_waits_marks_the_line_starving(db: SessionDB) -> None:
    """The head meets SQLite's lock held by a writer outside the line (here a raw sqlite3
    connection, as a newcomer of another process would): it polls, marks the line starving
    once it has waited its share, and the mark goes with its turn."""
    queue = _queue(db)
    starved = queue.stats().starved
    foreign = sqlite3.connect(_path(db), timeout=0, isolation_level=None, check_same_thread=False)
    try:
        foreign.execute("BEGIN IMMEDIATE")
        outcome, thread = _in_thread(lambda: db.update_token_counts("s", input_tokens=5))
        _wait_until(queue.starving, "the head to mark the line starving")
        assert thread.is_alive() and not outcome
        foreign.execute("COMMIT")
    finally:
        foreign.close()
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    assert not queue.starving()
    assert queue.stats().starved == starved + 1


def test_a_foreign_writer_holding_the_lock_sends_the_write_to_the_line(db: SessionDB) -> None:
    """The original store (a raw sqlite3 connection) holds SQLite's write lock: the write does
    not fail or spin; it joins the line and waits there as its head until the lock is free."""
    queue = _queue(db)
    before = db.stats()
    foreign = sqlite3.connect(_path(db), timeout=0, isolation_level=None, check_same_thread=False)
    try:
        foreign.execute("BEGIN IMMEDIATE")
        issued = queue.tickets()[0]
        outcome, thread = _in_thread(lambda: db.update_token_counts("s", input_tokens=5))
        _wait_until(lambda: queue.tickets()[0] > issued, "the write to join the line")
        assert thread.is_alive() and not outcome
        foreign.execute("COMMIT")
    finally:
        foreign.close()
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    after = db.stats()
    assert after.uncontended_writes == before.uncontended_writes
    assert after.queue_turns == before.queue_turns + 1
    session = db.get_session("s")
    assert session is not None and session["input_tokens"] == 5


def test_another_thread_writing_sends_the_write_to_its_group(db: SessionDB) -> None:
    """A thread of the same process holds the writer (an open transaction() block): a hot
    write of another thread waits for a group instead of going straight in."""
    before = db.stats()
    opened, release = threading.Event(), threading.Event()

    def block() -> None:
        with db.transaction():
            db.append_message("s", "user", "in the block")
            opened.set()
            assert release.wait(GUARD)

    holder = threading.Thread(target=block)
    holder.start()
    try:
        assert opened.wait(GUARD)
        outcome, thread = _in_thread(lambda: db.append_message("s", "user", "after the block"))
        assert db.uow.wait_for_queued_units(1, GUARD)  # queued for a group, not written
    finally:
        release.set()
        holder.join(GUARD)
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    after = db.stats()
    assert after.uncontended_writes == before.uncontended_writes
    assert after.groups == before.groups + 1
    assert _contents(db) == ["in the block", "after the block"]


def test_a_lock_met_after_the_begin_runs_the_write_again_in_the_line(db: SessionDB) -> None:
    """A unit that meets SQLITE_BUSY midway on the straight path (which waits for nothing) is
    rolled back whole and runs again, once, in the line."""
    runs: list[int] = []
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]

    def unit(conn: Any) -> int:
        runs.append(1)
        cursor = conn.connection.driver_connection.cursor()
        cursor.execute("UPDATE sessions SET title = 'once' WHERE id = 's'")
        if len(runs) == 1:
            raise busy
        return len(runs)

    before = db.stats()
    assert db.uow.run(unit, driver_only=True) == 2
    after = db.stats()
    assert after.rollbacks == before.rollbacks + 1
    assert after.uncontended_writes == before.uncontended_writes
    assert after.write_units == before.write_units + 1
    session = db.get_session("s")
    assert session is not None and session["title"] == "once"


def test_switched_off_every_write_takes_its_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(uncontended.ENV_SWITCH, "0")
    store = SessionDB(tmp_path / "state.db")
    try:
        store.create_session("s", "cli")
        before = store.stats()
        store.append_message("s", "user", "in line")
        after = store.stats()
        assert after.uncontended_writes == 0
        assert after.queue_turns == before.queue_turns + 1
    finally:
        store.close()
