"""The patient head: a writer that writes back to back, at the head of the line behind one that
goes on writing straight in, lets that holder keep SQLite's lock for a share instead of
catching it between two of its writes; a writer that pauses between writes never waits so.

Real SQLite files, real lock-file turns (another ``WriteQueue`` on the file stands in line as
another process would). Commits are seen through ``PRAGMA data_version``; where a test needs
commits to keep landing for as long as it likes, it counts them itself (a stand-in for the
look), and the share is stretched so that no slowness of the machine decides the outcome.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from hermes_store import SessionDB
from hermes_store.engine.factory import begin_on_driver
from hermes_store.uow import writequeue, writer
from hermes_store.uow.backends import SqliteBackend
from hermes_store.uow.writer import PATIENT_AFTER, SqliteWriter
from tests.support.clock import FakeClock
from tests.support.waiting import GUARD, in_thread, wait_until


def _writer(store: SessionDB) -> SqliteWriter:
    backend = store.uow.backend
    assert isinstance(backend, SqliteBackend)
    return backend.writer


def _path(store: SessionDB) -> Path:
    return Path(store.engine.url.database or "")


def _helpers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("hermes-writequeue-")}


def _wait_blocked(before: set[threading.Thread]) -> None:
    """A writer of this process blocked in line behind its predecessor: a descriptor's helper
    thread starts only once the lock it waits for could not be had at once."""
    wait_until(lambda: bool(_helpers() - before), "a writer to block in line")


def _contents(store: SessionDB) -> list[str]:
    return [str(m["content"]) for m in store.get_messages("s")]


@pytest.mark.unit
def test_back_to_back_writes_make_a_back_to_back_writer_and_pauses_undo_it(
    db: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes that follow each other within BACK_TO_BACK_S build the streak; one slow gap halves
    it (a busy machine), so a writer that pauses between writes (the CLI, cron, a sub-agent)
    never counts as back to back, however many writes it makes."""
    clock = FakeClock(start=1_000_000.0, tick=0.0)
    monkeypatch.setattr(writer, "_monotonic", clock)
    found = _writer(db)
    for index in range(PATIENT_AFTER + 1):
        db.append_message("s", "user", f"quick {index}")
        clock.advance(writer.BACK_TO_BACK_S / 2)
    assert found.back_to_back
    clock.advance(1.0)
    db.append_message("s", "user", "after a pause")
    assert not found.back_to_back
    for _ in range(5 * PATIENT_AFTER):
        clock.advance(0.05)  # an occasional writer: 50 ms between writes
        db.update_token_counts("s", input_tokens=1)
    assert found.streak == 0 and not found.back_to_back


def _followed(path: Path, goes_on: bool) -> tuple[bool, bool]:
    """A member of the line that waited for a holder's turn, which said ``goes_on`` as it
    ended: whether it followed, and what it read of its holder (in its own turn)."""
    holder, follower = writequeue.WriteQueue(path), writequeue.WriteQueue(path)
    given: list[tuple[bool, bool]] = []
    taken = threading.Event()

    def follow() -> None:
        with follower.turn() as turn:
            assert turn.queued
            given.append((turn.followed >= 0, turn.holder_goes_on()))
        taken.set()

    with holder.turn() as turn:
        assert turn.queued
        helpers = _helpers()
        thread = threading.Thread(target=follow)
        thread.start()
        _wait_blocked(helpers)
        if goes_on:
            turn.say_goes_on()
    assert taken.wait(GUARD)
    thread.join(GUARD)
    return given[0]


def test_the_next_head_reads_whether_the_writer_it_followed_goes_on(tmp_path: Path) -> None:
    """The word names the writer that said it: once it is in the file, a head that followed
    another writer, one that said nothing, is not told "goes on"."""
    path = tmp_path / "state.db"
    sqlite3.connect(path).close()
    assert _followed(path, goes_on=True) == (True, True)
    assert _followed(path, goes_on=False) == (True, False)


def test_a_head_that_found_the_line_empty_knows_nothing_of_the_holder(tmp_path: Path) -> None:
    """It did not wait for anyone in line: whoever holds SQLite's lock went straight in
    without saying anything, and the last word in the lock file is not about it."""
    path = tmp_path / "state.db"
    sqlite3.connect(path).close()
    _followed(path, goes_on=True)  # the last word in the file: "goes on"
    with writequeue.WriteQueue(path).turn() as turn:
        assert turn.queued and turn.followed == -1
        assert not turn.holder_goes_on()


@pytest.mark.unit
def test_a_process_whose_threads_met_does_not_go_on_past_a_line(db: SessionDB) -> None:
    """Once threads of a process met (a group of two), its writes wait for the next group
    while anyone is in line: it never says it goes on straight in."""
    found = _writer(db)
    assert found.goes_straight_in()
    backend = db.uow.backend
    assert isinstance(backend, SqliteBackend) and backend.group is not None
    backend.group.met = True
    assert not found.goes_straight_in()


@pytest.mark.unit
def test_only_a_hot_write_says_it_goes_on(db: SessionDB, monkeypatch: pytest.MonkeyPatch) -> None:
    """A back-to-back writer's ``transaction()`` block (a job's unit: a prune or merge step)
    never tells the next head it goes on, so no head waits patiently behind it; the turn of a
    hot single-call write, taken the same way, does."""
    clock = FakeClock(start=1_000_000.0, tick=0.0)  # every unit right after the one before
    monkeypatch.setattr(writer, "_monotonic", clock)
    said: list[bool] = []
    monkeypatch.setattr(writequeue.Turn, "say_goes_on", lambda turn: said.append(turn.queued))
    found = _writer(db)
    db.append_message("s", "user", "before")
    found.streak = PATIENT_AFTER
    with db.transaction():
        db.append_message("s", "user", "in a block")
    assert found.back_to_back and not found.hot
    assert said == []
    found.run_alone(lambda conn: None, found.waits())  # a hot write's turn
    assert found.back_to_back and found.hot
    assert len(said) == 1
    assert _contents(db) == ["before", "in a block"]


class _Commits:
    """The head's look at the holder, counted: each look sees one more commit while
    ``landing`` is set (a holder writing back to back), none once it is cleared."""

    def __init__(self) -> None:
        self.landing = threading.Event()
        self.landing.set()
        self.version = 0
        self.looks = 0

    def __call__(self) -> int:
        self.looks += 1
        if self.landing.is_set():
            self.version += 1
        return self.version


def _patient_head_behind_a_holder(
    db: SessionDB, monkeypatch: pytest.MonkeyPatch, *, share: float
) -> tuple[
    _Commits, list[int], sqlite3.Connection, writequeue.WriteQueue, list[Any], threading.Thread
]:
    """A back-to-back writer's write joins the line while a straight-in holder (a raw
    connection) holds SQLite's lock, behind a member that says it goes on; that member lets
    go, and the write is the head: patient, looking at ``_Commits``, with ``share``."""
    found = _writer(db)
    commits = _Commits()
    monkeypatch.setattr(found, "data_version", commits)
    monkeypatch.setattr(writer, "PATIENT_SHARE_S", share)
    monkeypatch.setattr(writer, "PATIENT_WAIT_S", share)
    attempts = [0]
    real_begin = begin_on_driver

    def counted(*args: Any, **kwargs: Any) -> None:
        attempts[0] += 1
        real_begin(*args, **kwargs)

    monkeypatch.setattr(writer, "begin_on_driver", counted)
    db.append_message("s", "user", "before")  # the writer connection is open
    found.streak = PATIENT_AFTER
    holder = sqlite3.connect(_path(db), timeout=0, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    member = writequeue.WriteQueue(_path(db))
    queue = db.uow.write_queue
    assert queue is not None
    with member.turn() as turn:
        helpers = _helpers()
        outcome, thread = in_thread(lambda: db.append_message("s", "user", "patient"))
        _wait_blocked(helpers)
        turn.say_goes_on()
    wait_until(lambda: db.stats().patient_heads == 1, "the write to be a patient head")
    return commits, attempts, holder, queue, outcome, thread


def test_a_patient_head_asks_nothing_while_commits_land_and_asks_once_they_stop(
    db: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    commits, attempts, holder, queue, outcome, thread = _patient_head_behind_a_holder(
        db, monkeypatch, share=GUARD
    )
    try:
        wait_until(lambda: commits.looks >= 10, "the head to look ten times")
        assert attempts[0] == 0  # not one BEGIN while the holder commits
        assert thread.is_alive() and not outcome and not queue.starving()
        holder.execute("COMMIT")
        commits.landing.clear()  # the holder stopped
    finally:
        holder.close()
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    assert attempts[0] >= 1
    assert queue.stats().starved == 0  # it took the lock without asking anyone to queue
    assert _contents(db) == ["before", "patient"]


def test_a_patient_head_marks_the_line_starving_when_its_share_is_over(
    db: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commits never stop landing: once the share is over the head marks the line starving
    (newcomers then queue behind it), and it takes the lock when the holder lets go."""
    commits, _, holder, queue, outcome, thread = _patient_head_behind_a_holder(
        db, monkeypatch, share=0.05
    )
    try:
        wait_until(queue.starving, "the head to mark the line starving")
        assert thread.is_alive() and not outcome and commits.landing.is_set()
        holder.execute("COMMIT")
    finally:
        holder.close()
    thread.join(GUARD)
    assert outcome and outcome[0][0] == "ok", outcome
    assert _contents(db) == ["before", "patient"]
