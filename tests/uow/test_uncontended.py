"""The uncontended write: a single-call write that finds no one else writing goes straight in
(no queue turn, no group); one that meets a writer joins the line, and a newcomer never goes
past a head that marked the line starving.

Real SQLite files and threads; "in line" is read from the lock file's ticket counter and the
store's own counters, never inferred from a pause.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from hermes_store import SessionDB
from hermes_store.uow import uncontended, writequeue
from hermes_store.uow.writer import STARVE_AFTER_S
from tests.support.clock import FakeClock
from tests.support.queue_workers import starve
from tests.support.waiting import GUARD, in_thread, wait_until


def _path(store: SessionDB) -> Path:
    return Path(store.engine.url.database or "")


def _queue(store: SessionDB) -> writequeue.WriteQueue:
    queue = store.uow.write_queue
    assert queue is not None and queue.enabled
    return queue


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


@pytest.mark.unit
def test_a_lone_writer_checkpoints_on_its_own_idle_connection(tmp_path: Path) -> None:
    """The checkpoint every ``checkpoint_every`` writes runs on the writer connection the
    straight-in write holds idle, as the original store's runs on its one connection: no
    pooled connection is checked out for it (a checkout and return cost ~100 µs of CPU)."""
    store = SessionDB(tmp_path / "state.db", checkpoint_every=5)
    try:
        store.create_session("s", "cli")
        store.append_message("s", "user", "warm")  # opens the writer connection
        checkouts: list[object] = []
        event.listen(store.engine, "checkout", lambda *args: checkouts.append(args))
        before = store.stats()
        for index in range(10):
            store.append_message("s", "user", f"m{index}")
        after = store.stats()
        assert after.uncontended_writes - before.uncontended_writes == 10
        assert after.checkpoints - before.checkpoints == 2  # both succeeded
        assert checkouts == []
    finally:
        store.close()


@pytest.mark.unit
def test_writes_straight_in_and_in_units_share_one_checkpoint_cadence(tmp_path: Path) -> None:
    """Writes that went straight in are counted apart from the locked counters; the checkpoint
    cadence and ``write_units`` still count every write of the file, whichever path it took."""
    store = SessionDB(tmp_path / "state.db", checkpoint_every=4)
    try:
        store.create_session("s", "cli")  # write 1
        before = store.stats()
        for index in range(3):  # writes 2, 3: straight in; 4: in a block (checkpoint)
            if index == 2:
                with store.transaction():
                    store.append_message("s", "user", f"m{index}")
            else:
                store.append_message("s", "user", f"m{index}")
        middle = store.stats()
        for index in range(4):  # writes 5-7 straight in, 8 straight in (checkpoint)
            store.append_message("s", "user", f"n{index}")
        after = store.stats()
        assert middle.write_units - before.write_units == 3
        assert middle.uncontended_writes - before.uncontended_writes == 2
        assert middle.checkpoints - before.checkpoints == 1
        assert after.write_units - before.write_units == 7
        assert after.checkpoints - before.checkpoints == 2
    finally:
        store.close()


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
        starve(turn)
        assert queue.starving()
        issued = queue.tickets()[0]
        outcome, thread = in_thread(lambda: db.append_message("s", "user", "behind"))
        wait_until(lambda: queue.tickets()[0] > issued, "the write to take a ticket")
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
        starve(turn)
        issued = queue.tickets()[0]
        first = in_thread(lambda: db.append_message("s", "user", "one"))
        wait_until(lambda: queue.tickets()[0] > issued, "the leader to take a ticket")
        second = in_thread(lambda: db.append_message("s", "user", "two"))
        assert db.uow.wait_for_queued_units(1, GUARD)
    for outcome, thread in (first, second):
        thread.join(GUARD)
        assert outcome and outcome[0][0] == "ok", outcome
    assert db.stats().max_group == 2
    before = db.stats()
    with other.turn() as turn:  # not starving, SQLite's lock free: still, the write queues
        assert turn.queued and not queue.starving()
        issued = queue.tickets()[0]
        outcome, thread = in_thread(lambda: db.append_message("s", "user", "three"))
        wait_until(lambda: queue.tickets()[0] > issued, "the write to take a ticket")
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
        outcome, thread = in_thread(lambda: db.update_token_counts("s", input_tokens=5))
        wait_until(queue.starving, "the head to mark the line starving")
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
        outcome, thread = in_thread(lambda: db.update_token_counts("s", input_tokens=5))
        wait_until(lambda: queue.tickets()[0] > issued, "the write to join the line")
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
        outcome, thread = in_thread(lambda: db.append_message("s", "user", "after the block"))
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


@pytest.mark.parametrize("given", ["connection", "driver"])
def test_a_lock_met_after_the_begin_runs_the_write_again_in_the_line(
    db: SessionDB, given: str
) -> None:
    """A unit that meets SQLITE_BUSY midway on the straight path (which waits for nothing) is
    rolled back whole and runs again, once, in the line: a unit given the Connection
    (``run(fn, driver_only=True)``) or the DB-API connection itself (``run_on_driver``)."""
    runs: list[int] = []
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]

    def on_driver(driver: Any) -> int:
        runs.append(1)
        driver.execute("UPDATE sessions SET title = 'once' WHERE id = 's'")
        if len(runs) == 1:
            raise busy
        return len(runs)

    before = db.stats()
    if given == "driver":
        assert db.uow.run_on_driver(on_driver) == 2
    else:
        assert db.uow.run(lambda conn: on_driver(conn.connection.driver_connection),
                          driver_only=True) == 2  # fmt: skip
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


# -- the look at the line: once per QUIET_S while it is empty, every write while it is not -------


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The straight path's clock (when it looks at the line again), moved only by the test;
    far past any look taken before it was put in."""
    fake = FakeClock(start=time.monotonic() + 3600.0, tick=0.0)
    monkeypatch.setattr(uncontended, "_monotonic", fake)
    return fake


def _asked(queue: writequeue.WriteQueue, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the straight path asks the lock file each question (counted, then asked)."""
    asked = dict.fromkeys(("quiet", "starving", "empty"), 0)
    for name in asked:
        real = getattr(queue, name)

        def spy(real: Callable[[], bool] = real, name: str = name) -> bool:
            asked[name] += 1
            return real()

        monkeypatch.setattr(queue, name, spy)
    return asked


def test_the_head_needs_longer_to_starve_than_a_look_at_an_empty_line_lasts() -> None:
    """What the skipped questions rest on: a head that forms after a writer found the line empty
    marks it only after its share at the head, and by then the writer looks again."""
    assert 0 < uncontended.QUIET_S < STARVE_AFTER_S


def test_a_lone_writer_asks_the_lock_file_once_per_quiet_interval(
    db: SessionDB, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _asked(_queue(db), monkeypatch)
    before = db.stats()
    for index in range(5):
        db.append_message("s", "user", f"m{index}")
        db.update_token_counts("s", input_tokens=1)
    assert asked == {"quiet": 1, "starving": 0, "empty": 0}
    clock.advance(uncontended.QUIET_S)
    db.append_message("s", "user", "later")
    assert asked == {"quiet": 2, "starving": 0, "empty": 0}
    assert db.stats().uncontended_writes == before.uncontended_writes + 11


def test_a_head_that_waited_its_share_is_seen_by_a_writer_that_found_the_line_empty(
    db: SessionDB, clock: FakeClock
) -> None:
    """The writer found the line empty just before another writer took its turn; that head
    marks the line starving after its share at the head: the writer's next write queues
    behind it, never past it."""
    queue = _queue(db)
    db.append_message("s", "user", "alone")  # the line is empty: the next look is in QUIET_S
    with writequeue.WriteQueue(_path(db)).turn() as turn:
        assert turn.queued
        clock.advance(STARVE_AFTER_S)  # the head waited its share at the head
        turn.mark_starving()
        issued = queue.tickets()[0]
        outcome, thread = in_thread(lambda: db.append_message("s", "user", "behind"))
        wait_until(lambda: queue.tickets()[0] > issued, "the write to take a ticket")
        assert thread.is_alive() and not outcome
        assert _contents(db) == ["alone"]
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    assert _contents(db) == ["alone", "behind"]


def test_while_anyone_is_in_line_every_write_asks_whether_its_head_starves(
    db: SessionDB, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member of the line that has not starved: writes go straight in, each asking whether
    the head starves (the clock does not move, so no skipped question explains it); a mark
    made even at once is seen by the very next write."""
    queue = _queue(db)
    asked = _asked(queue, monkeypatch)
    before = db.stats()
    with writequeue.WriteQueue(_path(db)).turn() as turn:
        assert turn.queued
        for index in range(3):
            db.append_message("s", "user", f"past {index}")
        assert asked == {"quiet": 1, "starving": 3, "empty": 0}
        assert db.stats().uncontended_writes == before.uncontended_writes + 3
        turn.mark_starving()
        issued = queue.tickets()[0]
        outcome, thread = in_thread(lambda: db.append_message("s", "user", "behind"))
        wait_until(lambda: queue.tickets()[0] > issued, "the write to take a ticket")
        assert thread.is_alive() and not outcome
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    assert _contents(db) == ["past 0", "past 1", "past 2", "behind"]


def test_a_head_that_died_starving_sends_no_one_to_the_line(
    db: SessionDB, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock is the truth: a head of another process held a ticket's byte and the starving
    mark, then died (the kernel drops the locks of its descriptors); the next writer finds the
    line empty and goes straight in, taking no ticket."""
    queue = _queue(db)
    head = os.open(queue.lock_path, os.O_RDWR | os.O_CLOEXEC)  # the other process's descriptor
    try:
        assert writequeue._lock(head, queue._slot(queue.tickets()[0]), 1, wait=False)
        assert writequeue._lock(head, writequeue.STARVING_AT, 1, wait=False)
        assert queue.starving() and not queue.quiet() and not queue.empty()
    finally:
        os.close(head)  # it dies
    asked = _asked(queue, monkeypatch)
    before, issued = db.stats(), queue.tickets()[0]
    db.append_message("s", "user", "past the dead head")
    assert asked == {"quiet": 1, "starving": 0, "empty": 0}
    assert queue.tickets()[0] == issued
    assert db.stats().uncontended_writes == before.uncontended_writes + 1
    assert _contents(db) == ["past the dead head"]
