"""Ctrl-C in a process whose threads write through group commit.

An interrupt (``KeyboardInterrupt``, or any ``BaseException``) raised in a group's leader after
its ``COMMIT`` returned never makes the group run again: every caller keeps its result and the
leader's caller gets the interrupt. One raised before the ``COMMIT`` rolls the group back: its
members run again alone and the leader's caller gets the interrupt, never swallowed. A caller
interrupted while its write waits for a group gets the interrupt and its write never runs.

In-process cases raise the interrupt at a chosen point (the main thread leads or waits, other
threads queue behind a foreign writer holding SQLite's lock); the slow case sends real SIGINTs
to a child process whose threads write without pause (``tests/support/interrupt_workers.py``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL, Connection

from hermes_store import HermesStoreError, SessionDB
from hermes_store.repo import postgresql as pg_statements
from hermes_store.uow.unit import driver_cursor
from tests.support.backends import sqlite_lock_is_free
from tests.support.interrupt_points import InterruptAtCall
from tests.support.pg_row_locks import queued_behind_a_locked_write
from tests.support.readable import readable
from tests.support.waiting import GUARD

INTERRUPTS = 120
THREADS = 2
ROOT = Path(__file__).resolve().parents[2]
ANSWER = 30.0  # seconds for the child's answer to an interrupt, which only a bug never gives


@pytest.fixture(params=["postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    """The PostgreSQL case's ``db_url``; the SQLite cases use files of their own."""
    return str(request.param)


class ForeignWriter:
    """SQLite's write lock held by a plain sqlite3 connection (a shell, the original store),
    let go from any thread."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=False)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("COMMIT")
        self.conn.close()


class Calls:
    """Appends to session "s" in threads; each outcome (an id, or what was raised) by name."""

    def __init__(self, db: SessionDB, names: list[str], outcomes: dict[str, Any]) -> None:
        self.outcomes = outcomes
        self.threads = [threading.Thread(target=self._append, args=(db, n)) for n in names]
        for thread in self.threads:
            thread.start()

    def _append(self, db: SessionDB, name: str) -> None:
        try:
            self.outcomes[name] = db.append_message("s", "user", name)
        except BaseException as error:
            self.outcomes[name] = error

    def join(self) -> None:
        for thread in self.threads:
            thread.join(GUARD)
            assert not thread.is_alive()


@contextmanager
def members_behind_the_main_thread(db: SessionDB, names: list[str]) -> Iterator[dict[str, Any]]:
    """The main thread's next write leads a group (a foreign writer holds SQLite's lock
    meanwhile); appends of ``names`` queue behind it, then the lock is let go: one group.
    Yields the members' outcomes by name (complete once the block is left)."""
    foreign = ForeignWriter(Path(db.engine.url.database or ""))
    outcomes: dict[str, Any] = {}
    members: list[Calls] = []

    def stage() -> None:
        try:
            assert db.uow.wait_for_queued_units(1, GUARD)  # the main thread leads, waiting
            members.append(Calls(db, names, outcomes))
            assert db.uow.wait_for_queued_units(1 + len(names), GUARD)
        finally:
            foreign.release()

    stager = threading.Thread(target=stage)
    stager.start()
    try:
        yield outcomes
    finally:
        stager.join(GUARD)
        assert not stager.is_alive()
        for calls in members:
            calls.join()


def _stored(db: SessionDB) -> dict[int, str]:
    return {m["id"]: str(m["content"]) for m in db.get_messages("s")}


@pytest.mark.unit
def test_an_interrupt_as_the_commit_returns_never_runs_the_group_again(
    db: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C lands in the leader (the main thread) just after its group's COMMIT: every
    member keeps its result, nothing runs twice, and the leader's caller gets the interrupt."""
    record = db.uow.counters.record_group
    fired: list[int] = []

    def interrupted_once(size: int, *, lost: bool) -> None:
        if not lost and not fired:
            fired.append(size)
            raise KeyboardInterrupt  # the first thing after COMMIT returned
        record(size, lost=lost)

    monkeypatch.setattr(db.uow.counters, "record_group", interrupted_once)
    names = [f"member {n}" for n in range(3)]
    with (
        members_behind_the_main_thread(db, names) as outcomes,
        pytest.raises(KeyboardInterrupt),
    ):
        db.append_message("s", "user", "leader")
    assert fired == [4]
    stored = _stored(db)
    assert Counter(stored.values()) == Counter(["leader", *names])  # each exactly once
    assert {stored[outcomes[name]] for name in names} == set(names)
    assert db.stats().group_reruns == 0


@pytest.mark.unit
def test_an_interrupt_before_the_commit_reaches_the_leader_and_its_group_runs_again(
    db: SessionDB,
) -> None:
    """Ctrl-C lands while the leader runs its own unit: the group rolls back (nothing
    landed), its members run again alone and land once, and the interrupt is not swallowed
    (the leader's unit is not run again in its place)."""
    runs: list[int] = []

    def titled_then_interrupted(conn: Connection) -> None:
        runs.append(1)
        driver_cursor(conn).execute("UPDATE sessions SET title = 'leader' WHERE id = 's'")
        if len(runs) == 1:
            raise KeyboardInterrupt

    names = [f"member {n}" for n in range(3)]
    with (
        members_behind_the_main_thread(db, names) as outcomes,
        pytest.raises(KeyboardInterrupt),
    ):
        db.uow.run(titled_then_interrupted, driver_only=True)
    assert runs == [1]
    session = db.get_session("s")
    assert session is not None and session["title"] is None
    stored = _stored(db)
    assert Counter(stored.values()) == Counter(names)
    assert {stored[outcomes[name]] for name in names} == set(names)
    assert db.stats().group_reruns == len(names)


@pytest.mark.unit
def test_a_caller_interrupted_while_its_write_waits_for_a_group_never_writes(
    db: SessionDB,
) -> None:
    """SIGINT reaches the main thread while its append waits behind another thread's group:
    the interrupt is raised to it, and its write is withdrawn (it never lands later)."""
    path = Path(db.engine.url.database or "")
    foreign = ForeignWriter(path)
    try:
        leader = Calls(db, ["leader"], {})
        assert db.uow.wait_for_queued_units(1, GUARD)  # the thread leads, waiting for BEGIN
        main = threading.main_thread().ident
        assert main == threading.get_ident()

        def interrupt_once_queued() -> None:
            assert db.uow.wait_for_queued_units(2, GUARD)
            signal.pthread_kill(main, signal.SIGINT)

        sender = threading.Thread(target=interrupt_once_queued)
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            db.append_message("s", "user", "interrupted")
        sender.join(GUARD)
    finally:
        foreign.release()
    leader.join()
    db.append_message("s", "user", "after")  # a later group takes whatever is still queued
    # The leader lands unless a loaded machine made it give up waiting for the lock.
    landed = ["leader"] if isinstance(leader.outcomes["leader"], int) else []
    assert list(_stored(db).values()) == [*landed, "after"], leader.outcomes


def test_an_interrupt_after_a_postgresql_group_committed_never_runs_it_again(
    db_url: URL, admin: Connection, pg_worker_url: URL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's twin: Ctrl-C lands in a leader while it reads its committed group's
    results: no write runs again; a caller whose result was not read is told it committed."""
    real = pg_statements.message_id
    reads: list[int] = []

    def read(cursor: Any) -> int:
        reads.append(1)
        if len(reads) == 3:  # the second result of the group queued behind the first write
            raise KeyboardInterrupt
        return real(cursor)

    monkeypatch.setattr(pg_statements, "message_id", read)

    def kept(name: str) -> Callable[[SessionDB], Any]:
        def call(db: SessionDB) -> Any:
            try:
                return db.append_message("s", "user", name)
            except BaseException as error:  # the leader's interrupt, as an outcome
                return error

        return call

    names = [f"queued {n}" for n in range(3)]
    with queued_behind_a_locked_write(
        db_url, admin, pg_worker_url, {name: kept(name) for name in names}
    ) as scene:
        db = scene.finish()
        outcomes = [scene.outcomes[name] for name in names]
        assert sum(isinstance(o, KeyboardInterrupt) for o in outcomes) == 1, outcomes
        told = [o for o in outcomes if isinstance(o, HermesStoreError)]
        assert all("committed" in str(o) for o in told), told
        stored = Counter(m["content"] for m in db.get_messages("s"))
        assert stored == Counter(["first", *names])  # each exactly once
        s = db.get_session("s")
        assert s is not None and s["message_count"] == 4


class Child:
    """The writer process and a line reader on its stdout that never blocks past a bound."""

    def __init__(self, path: Path) -> None:
        env = {**os.environ, "HERMES_STORE_GROUP_COMMIT": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.interrupt_workers", str(path), str(THREADS)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._buffer = b""

    def line(self, what: str) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + ANSWER
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ended = self.proc.poll() is not None
            if left <= 0 or (ended and not readable(self.proc.stdout, 0)):
                self.dump_stacks()
                self.kill()
                raise AssertionError(f"no answer from the writer process ({what}): {self.err()}")
            if readable(self.proc.stdout, left):
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    continue
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def err(self) -> str:
        assert self.proc.stderr is not None
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")[-12000:]

    def dump_stacks(self) -> None:
        """A hung writer prints every thread's stack (faulthandler on SIGUSR1) before it is
        killed, so the failure shows where it stopped."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)  # not a synchronisation: the dump is best effort

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.slow
def test_ctrl_c_never_duplicates_an_acknowledged_write_and_always_reaches_main(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    child = Child(path)
    try:
        assert child.line("start") == "interrupt 0"
        rng = random.Random(6)
        for sent in range(1, INTERRUPTS + 1):
            # Not a wait for anything: a random pause, so interrupts land in every phase of
            # a write (queued, leading, committing, waking the group).
            time.sleep(rng.uniform(0, 0.03))
            child.proc.send_signal(signal.SIGINT)
            answer = child.line(f"interrupt {sent}")
            assert answer == f"interrupt {sent}", answer
        assert child.proc.stdin is not None
        child.proc.stdin.write(b"stop\n")
        child.proc.stdin.flush()
        report = json.loads(child.line("the report"))
        assert child.proc.wait(timeout=GUARD) == 0, child.err()
    finally:
        child.kill()
    assert report["interrupts"] == INTERRUPTS

    conn = sqlite3.connect(path)
    try:
        stored = conn.execute("SELECT id, content FROM messages").fetchall()
    finally:
        conn.close()
    twice = {content: n for content, n in Counter(c for _, c in stored).items() if n > 1}
    assert not twice, f"stored more than once: {sorted(twice)[:10]} ({len(twice)} in all)"
    by_id = dict(stored)
    acked = [entry for entries in report["acked"].values() for entry in entries]
    missing = [(mid, content) for mid, content in acked if by_id.get(mid) != content]
    assert not missing, f"acknowledged but not stored: {missing[:10]}"
    assert len(acked) > INTERRUPTS  # the threads did write while the interrupts came


def test_an_interrupt_between_the_waits_release_and_its_wait_leaves_the_queue_sound(
    db: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPython may raise a pending interrupt after ``Condition.wait()`` released its lock and
    before it waits (so before it takes the lock back): the waiter must still raise the
    interrupt, never "cannot release un-acquired lock", and withdraw its write."""
    group = db.uow.group
    assert group is not None
    group._leading = object()  # type: ignore[assignment]  # another caller leads
    lock = group._lock

    def released_then_interrupted(timeout: float | None = None) -> bool:
        lock.release()  # what the wait does first
        raise KeyboardInterrupt

    monkeypatch.setattr(group._cond, "wait", released_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        db.append_message("s", "user", "interrupted")
    assert not group._queue  # withdrawn: no later group writes it
    assert not lock._is_owned()  # type: ignore[attr-defined]  # and this thread holds none
    group._leading = None
    monkeypatch.undo()
    db.append_message("s", "user", "after")
    assert list(_stored(db).values()) == ["after"]


def test_a_transaction_left_open_by_an_interrupted_begin_is_rolled_back_by_the_next_unit(
    db: SessionDB, caplog: pytest.LogCaptureFixture
) -> None:
    """CPython can raise Ctrl-C's KeyboardInterrupt as the C call running ``BEGIN IMMEDIATE``
    returns, before any ``try`` could roll it back: the writer's connection is left in a
    transaction holding the file's write lock. The next unit rolls that leftover back (it was
    never acknowledged) instead of failing with "cannot start a transaction within a
    transaction" for good."""
    writer = db.uow.backend.writer  # type: ignore[attr-defined]
    db.append_message("s", "user", "before")
    writer.connect()
    driver = writer.driver
    driver.execute("BEGIN IMMEDIATE")  # what the interrupted unit had done
    driver.execute(
        "INSERT INTO messages (session_id, role, content, timestamp) VALUES ('s', 'user', "
        "'never acknowledged', 0)"
    )
    assert driver.in_transaction
    with caplog.at_level("WARNING", logger="hermes_store.engine.factory"):
        db.append_message("s", "user", "after")
    assert "left a transaction open: rolled back" in caplog.text
    assert sorted(_stored(db).values()) == ["after", "before"]


# -- Ctrl-C inside SQLAlchemy's frames -----------------------------------------------------------


def test_an_interrupt_as_the_writer_connects_leaves_a_usable_writer(
    db: SessionDB, tmp_path: Path
) -> None:
    """Ctrl-C as the writer's new connection was asked for its DB-API connection: the writer
    kept the connection without its driver, and every later write of the process raised a raw
    AttributeError ('NoneType' object has no attribute 'in_transaction'). The writer's state
    now changes in one step: the next write opens a fresh connection."""
    writer = db.uow.backend.writer  # type: ignore[attr-defined]
    writer.drop(invalidate=False)  # the next write opens the writer connection
    with (
        InterruptAtCall("connection", called_from="/uow/writer.py") as point,
        pytest.raises(KeyboardInterrupt),
    ):
        db.append_message("s", "user", "interrupted")
    assert point.hit
    assert (writer.connection is None) == (writer.driver is None)
    db.append_message("s", "user", "after")
    with db.transaction():
        db.append_message("s", "user", "in a block")
    assert sqlite_lock_is_free(tmp_path / "state.db")
    assert sorted(_stored(db).values()) == ["after", "in a block"]


@pytest.mark.parametrize(
    "where",
    ["rollback", "_do_rollback", "_close_impl", "_connection_rollback_impl", "_rollback_impl"],
)
def test_an_interrupt_in_a_failed_blocks_rollback_reaches_the_caller_and_frees_the_lock(
    db: SessionDB, tmp_path: Path, where: str
) -> None:
    """Ctrl-C inside SQLAlchemy's rollback of a block that raised: the caller got a raw
    AssertionError (SQLAlchemy's ``finally: assert``) in place of the interrupt, the idle
    process kept SQLite's write lock (other processes met DatabaseLockedError), and the next
    block raised a raw InvalidRequestError. The cut-short connection is now closed (SQLite
    rolls it back and frees the lock) and the interrupt goes on to the caller."""
    point = InterruptAtCall(where)
    try:
        with pytest.raises(KeyboardInterrupt), db.transaction():
            db.append_message("s", "user", "rolled back")
            point.__enter__()  # only the block's end is watched
            raise ValueError("the block fails")
    finally:
        point.__exit__()
    assert point.hit
    assert sqlite_lock_is_free(tmp_path / "state.db")
    with db.transaction():
        db.append_message("s", "user", "next block")
    db.append_message("s", "user", "next write")
    assert sorted(_stored(db).values()) == ["next block", "next write"]


@pytest.mark.parametrize("where", ["commit", "_do_commit", "_commit_impl"])
def test_an_interrupt_as_sqlalchemy_commits_a_block_reaches_the_caller(
    db: SessionDB, tmp_path: Path, where: str
) -> None:
    """Ctrl-C as SQLAlchemy starts a block's COMMIT: the caller got a raw AssertionError. The
    interrupt now reaches it, the block rolled back (its COMMIT was never sent), the lock
    free and the next block lands."""
    point = InterruptAtCall(where)
    try:
        with pytest.raises(KeyboardInterrupt), db.transaction():
            db.append_message("s", "user", "never committed")
            point.__enter__()
    finally:
        point.__exit__()
    assert point.hit
    assert sqlite_lock_is_free(tmp_path / "state.db")
    with db.transaction():
        db.append_message("s", "user", "next block")
    assert sorted(_stored(db).values()) == ["next block"]


def test_an_interrupt_in_a_read_units_rollback_reaches_the_caller(db: SessionDB) -> None:
    """The same in a read unit's rollback (a pooled connection): the interrupt goes on, the
    connection is discarded, never pooled half rolled back, and reads go on."""
    point = InterruptAtCall("_do_rollback")
    try:
        with pytest.raises(KeyboardInterrupt), db.uow.connect(write=False):
            db.get_session("s")
            point.__enter__()
            raise ValueError("the unit fails")
    finally:
        point.__exit__()
    assert point.hit
    for _ in range(3):
        with db.uow.connect(write=False):
            assert db.get_session("s") is not None
