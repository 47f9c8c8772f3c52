"""Group commit of the hot writes, and the writer queue's head meeting a foreign writer.

Real SQLite files and real threads. A group is made deterministic by a foreign writer (a raw
``sqlite3`` connection, as the original store or a shell would hold it) keeping SQLite's write
lock while the test's threads queue up behind it; the test waits on the store's own counters,
never on a sleep, then lets go and everything queued lands in one group.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

import hermes_store
from hermes_store import (
    InvalidInputError,
    SessionDB,
    StorageFullError,
    UnknownSessionError,
)
from hermes_store.uow import writequeue
from hermes_store.uow.groupcommit import MAX_GROUP
from tests.support import disks, legacy
from tests.support.queue_workers import starve
from tests.support.waiting import GUARD, wait_until


def _path(store: SessionDB) -> Path:
    return Path(store.engine.url.database or "")


class ForeignWriter:
    """SQLite's write lock held by a plain sqlite3 connection (the original store's way)."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, timeout=0, isolation_level=None)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self.conn.execute("COMMIT")
        self.conn.close()


def _run_threads(calls: list[Callable[[], Any]]) -> tuple[list[Any], list[threading.Thread]]:
    outcomes: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            outcomes[index] = ("ok", calls[index]())
        except Exception as error:
            outcomes[index] = ("error", error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    return outcomes, threads


def _grouped(store: SessionDB, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads while a foreign writer holds the lock; once all are queued
    for a group, let go: they commit together."""
    foreign = ForeignWriter(_path(store))
    try:
        outcomes, threads = _run_threads(calls)
        assert store.uow.wait_for_queued_units(len(calls), GUARD), store.uow.queued_units()
    finally:
        foreign.release()
    for thread in threads:
        thread.join(GUARD)
        assert not thread.is_alive()
    return outcomes


def _contents(store: SessionDB, session_id: str = "s") -> list[str]:
    return [m["content"] for m in store.get_messages(session_id)]


def test_queued_hot_writes_commit_as_one_group(db: SessionDB) -> None:
    before = db.stats()
    calls: list[Callable[[], Any]] = [
        (lambda i=i: db.append_message("s", "user", f"m{i}")) for i in range(6)
    ]
    calls.append(lambda: db.update_token_counts("s", input_tokens=5, output_tokens=7))
    calls.append(lambda: db.append_messages("s", [{"role": "user", "content": "batch"}] * 3))
    outcomes = _grouped(db, calls)
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    after = db.stats()
    assert after.groups - before.groups == 1
    assert after.grouped_units - before.grouped_units == len(calls)
    assert after.max_group == len(calls)
    assert after.lost_groups == 0 and after.group_reruns == 0
    assert after.write_units - before.write_units == len(calls)
    ids = [value for _, value in outcomes[:6]] + outcomes[7][1]
    stored = {m["id"]: m["content"] for m in db.get_messages("s")}
    assert sorted(ids) == sorted(stored) and len(set(ids)) == 9
    assert all(stored[outcomes[i][1]] == f"m{i}" for i in range(6))
    session = db.get_session("s")
    assert session is not None
    assert (session["message_count"], session["input_tokens"], session["output_tokens"]) == (
        9,
        5,
        7,
    )


def test_a_units_error_rolls_back_only_that_unit(db: SessionDB) -> None:
    """A Python-level error (unknown session) and a database error inside the unit (a counter
    overflow SQLite refuses) each undo only their own unit; only their callers see them."""
    top = 2**63 - 1
    db.create_session("big", "cli")
    db.update_token_counts("big", input_tokens=top - 1, absolute=True)
    calls: list[Callable[[], Any]] = [
        lambda: db.append_message("s", "user", "first"),
        lambda: db.append_message("nobody", "user", "lost"),
        lambda: db.update_token_counts("big", input_tokens=2),  # overflows: refused
        lambda: db.append_message("s", "user", "second"),
        lambda: db.update_token_counts("big", input_tokens=1),  # reaches the top exactly
        lambda: db.append_messages("nobody", [{"role": "user", "content": "x"}]),
        lambda: db.update_token_counts("s", output_tokens=3),
    ]
    outcomes = _grouped(db, calls)
    kinds = [kind for kind, _ in outcomes]
    assert kinds == ["ok", "error", "error", "ok", "ok", "error", "ok"], outcomes
    assert isinstance(outcomes[1][1], UnknownSessionError)
    assert isinstance(outcomes[2][1], InvalidInputError)
    assert isinstance(outcomes[5][1], UnknownSessionError)
    stats = db.stats()
    assert stats.groups >= 1 and stats.max_group == len(calls) and stats.lost_groups == 0
    assert sorted(_contents(db)) == ["first", "second"]
    session, big = db.get_session("s"), db.get_session("big")
    assert session is not None and big is not None
    assert session["message_count"] == 2 and session["output_tokens"] == 3
    assert big["input_tokens"] == top
    assert db.get_session("nobody") is None


@pytest.fixture
def other_in_line(db: SessionDB) -> Iterator[Callable[[], None]]:
    """Another writer of the file holds a turn in the fair line (a member of its own, as another
    process would be) and has marked it starving: every write meanwhile queues behind it.
    Calling the yielded function lets it go (once the test saw what it waits for)."""
    queue = writequeue.WriteQueue(_path(db))  # its own descriptors: another member of the line
    turn = queue.turn()
    entered = turn.__enter__()
    assert entered.queued
    starve(entered)
    left: list[bool] = []

    def let_go() -> None:
        if not left:
            left.append(True)
            turn.__exit__(None, None, None)

    yield let_go
    let_go()


def _half_then_fail(conn: Any) -> None:
    cursor = conn.connection.driver_connection.cursor()
    cursor.execute("UPDATE sessions SET title = 'half' WHERE id = 's'")
    raise RuntimeError("the unit failed after writing")


def test_a_unit_alone_that_fails_midway_leaves_nothing(db: SessionDB) -> None:
    """A unit alone goes straight in (no one else writes): a unit that wrote and then raised
    is rolled back whole, only its caller sees the error, and the writer goes on."""
    before = db.stats()
    with pytest.raises(RuntimeError, match="after writing"):
        db.uow.run(_half_then_fail, driver_only=True)
    after = db.stats()
    assert after.groups == before.groups and after.queue_turns == before.queue_turns
    assert after.rollbacks == before.rollbacks + 1
    assert after.write_units == before.write_units
    session = db.get_session("s")
    assert session is not None and session["title"] is None
    db.append_message("s", "user", "after")
    assert _contents(db) == ["after"]


def test_a_group_of_one_that_fails_midway_leaves_nothing(
    db: SessionDB, other_in_line: Callable[[], None]
) -> None:
    """Behind another writer the unit joins the line and runs as a group of one, without a
    savepoint: rolled back whole all the same, only its caller sees the error."""
    queue = db.uow.write_queue
    assert queue is not None
    before = db.stats()
    issued = queue.tickets()[0]
    outcomes, threads = _run_threads([lambda: db.uow.run(_half_then_fail, driver_only=True)])
    wait_until(lambda: queue.tickets()[0] > issued, "the unit to join the line")
    assert threads[0].is_alive()  # in line behind the other writer
    other_in_line()
    threads[0].join(GUARD)
    kind, error = outcomes[0]
    assert kind == "error" and isinstance(error, RuntimeError), outcomes
    after = db.stats()
    assert after.groups - before.groups == 1 and after.max_group == 1
    assert after.lost_groups == 0 and after.write_units == before.write_units
    session = db.get_session("s")
    assert session is not None and session["title"] is None
    db.append_message("s", "user", "after")
    assert _contents(db) == ["after"]


def _refuse_commits(engine: sa.Engine, armed: list[int]) -> None:
    """An authorizer on every real connection of ``engine`` that refuses the next ``armed[0]``
    COMMIT statements (SQLite then keeps the transaction open and returns SQLITE_AUTH)."""

    def authorizer(action: int, arg1: Any, *_: Any) -> int:
        if action == sqlite3.SQLITE_TRANSACTION and arg1 == "COMMIT" and armed[0] > 0:
            armed[0] -= 1
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        dbapi_connection.set_authorizer(authorizer)


def test_a_lost_group_is_never_acknowledged_and_every_unit_runs_again(tmp_path: Path) -> None:
    """The group's COMMIT fails: nothing of it is on disk, so no caller may be told it is;
    each unit runs again alone and lands exactly once."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'state.db'}")
    armed = [0]
    _refuse_commits(engine, armed)
    db = SessionDB(engine)
    try:
        db.create_session("s", "cli")
        count = 6
        calls: list[Callable[[], Any]] = [
            (lambda i=i: db.append_message("s", "user", f"m{i}")) for i in range(count)
        ]
        calls.append(lambda: db.update_token_counts("s", input_tokens=4))
        foreign = ForeignWriter(_path(db))
        try:
            outcomes, threads = _run_threads(calls)
            assert db.uow.wait_for_queued_units(len(calls), GUARD)
            armed[0] = 1  # the group's COMMIT, and only it
        finally:
            foreign.release()
        for thread in threads:
            thread.join(GUARD)
        assert all(kind == "ok" for kind, _ in outcomes), outcomes
        assert armed[0] == 0
        stats = db.stats()
        assert stats.lost_groups == 1 and stats.group_reruns == len(calls)
        stored = {m["id"]: m["content"] for m in db.get_messages("s")}
        assert sorted(stored.values()) == sorted(f"m{i}" for i in range(count))
        assert {outcomes[i][1] for i in range(count)} == set(stored)
        session = db.get_session("s")
        assert session is not None
        assert session["message_count"] == count and session["input_tokens"] == 4
    finally:
        db.close()
        engine.dispose()


def test_exact_counts_from_many_threads_and_stores(tmp_path: Path) -> None:
    """16 threads on 4 stores sharing the file's writer: every acknowledged write lands once,
    every hot write went through a group or straight in (no one else writing), and the
    counters add up."""
    path = tmp_path / "state.db"
    stores = [SessionDB(path) for _ in range(4)]
    stores[0].create_session("s", "cli")
    threads_n, ops = 16, 25
    ids: list[list[int]] = [[] for _ in range(threads_n)]
    start = threading.Barrier(threads_n)
    failures: list[BaseException] = []

    def work(index: int) -> None:
        store = stores[index % len(stores)]
        start.wait(GUARD)
        try:
            for op in range(ops):
                ids[index].append(store.append_message("s", "user", f"t{index} {op}"))
                store.update_token_counts("s", input_tokens=1, output_tokens=2)
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    before = stores[0].stats()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD)
    assert not failures, failures
    total = threads_n * ops
    flat = [i for mine in ids for i in mine]
    assert len(set(flat)) == total
    db = stores[0]
    stored = {m["id"]: m["content"] for m in db.get_messages("s")}
    assert set(stored) == set(flat)
    assert sorted(stored.values()) == sorted(
        f"t{t} {op}" for t in range(threads_n) for op in range(ops)
    )
    session = db.get_session("s")
    assert session is not None
    assert session["message_count"] == total
    assert (session["input_tokens"], session["output_tokens"]) == (total, 2 * total)
    after = db.stats()  # shared by every store on the file in this process
    straight = after.uncontended_writes - before.uncontended_writes
    assert after.grouped_units - before.grouped_units + straight == 2 * total
    assert after.groups - before.groups <= 2 * total
    assert after.max_group <= MAX_GROUP and after.lost_groups == 0
    for store in stores:
        store.close()


def test_a_group_holds_at_most_max_group_units(db: SessionDB) -> None:
    count = MAX_GROUP + 5
    calls: list[Callable[[], Any]] = [
        (lambda i=i: db.append_message("s", "user", f"m{i}")) for i in range(count)
    ]
    outcomes = _grouped(db, calls)
    assert all(kind == "ok" for kind, _ in outcomes)
    stats = db.stats()
    assert stats.max_group == MAX_GROUP and stats.groups >= 2
    assert sorted(_contents(db)) == sorted(f"m{i}" for i in range(count))


def test_a_transaction_block_is_never_grouped(db: SessionDB) -> None:
    before = db.stats()
    with db.transaction():
        db.append_message("s", "user", "inside")
        db.update_token_counts("s", input_tokens=1)
    after = db.stats()
    assert after.grouped_units == before.grouped_units
    assert after.transactions == before.transactions + 1


def test_group_commit_can_be_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERMES_STORE_GROUP_COMMIT", "0")
    store = SessionDB(tmp_path / "state.db")
    try:
        store.create_session("s", "cli")
        store.append_message("s", "user", "alone")
        assert store.uow.group is None and store.stats().groups == 0
        assert _contents(store) == ["alone"]
    finally:
        store.close()


# -- the queue's head and a foreign writer ------------------------------------------------------


def test_the_head_keeps_its_place_while_a_foreign_writer_holds_the_lock(
    tmp_path: Path,
) -> None:
    """A foreign writer keeps SQLite's lock for longer than the queue's bounded wait: the head
    retries with its short busy timeout and beats, so the writers behind it stay in line (no
    fallback to SQLite's busy handler) and all land, in order, once it lets go."""
    path = tmp_path / "state.db"
    store = SessionDB(path)
    store.create_session("q", "cli")
    queue = store.uow.write_queue
    assert queue is not None and queue.enabled
    waiters = 4

    def write(text: str) -> None:  # transaction() blocks: one queue turn each
        with store.transaction():
            store.append_message("q", "user", text)

    before = queue.stats()
    retries_before = store.stats().retries
    foreign = ForeignWriter(path)
    try:
        issued = queue.tickets()[0]
        lists: list[list[Any]] = []
        threads: list[threading.Thread] = []
        for index in range(waiters):
            outcome, started = _run_threads([lambda i=index: write(f"w{i}")])
            lists.append(outcome)
            threads += started
            wait_until(lambda i=index: queue.tickets()[0] >= issued + i + 1, "a ticket")
        # Hold the lock until the head has retried for well past the queue's bounded wait.
        needed = int(queue.wait_timeout / 0.2) * 3 + 2
        wait_until(lambda: store.stats().retries - retries_before >= needed, "the head's retries")
    finally:
        foreign.release()
    for thread in threads:
        thread.join(GUARD)
    outcomes = [outcome for mine in lists for outcome in mine]
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    after = queue.stats()
    assert after.fallbacks == before.fallbacks, after.fallback_reasons
    assert after.turns - before.turns >= waiters
    assert _contents(store, "q") == [f"w{i}" for i in range(waiters)]
    store.close()


def test_the_heartbeat_counts_as_the_line_moving(tmp_path: Path) -> None:
    """A waiter behind a head that only beats (it holds its turn far past the bounded wait)
    stays queued and gets its turn once the head is done."""
    db_path = tmp_path / "state.db"
    head_queue = writequeue.WriteQueue(db_path)
    waiter_queue = writequeue.WriteQueue(db_path, wait_timeout=1.0)
    entered = threading.Event()
    result: list[writequeue.Turn] = []

    def wait_in_line() -> None:
        entered.set()
        with waiter_queue.turn() as turn:
            result.append(turn)

    with head_queue.turn() as head:
        assert head.queued
        waiter = threading.Thread(target=wait_in_line)
        waiter.start()
        assert entered.wait(GUARD)
        wait_until(lambda: head_queue.tickets()[0] >= 2, "the waiter's ticket")
        beats = 0
        deadline_beats = int(waiter_queue.wait_timeout / 0.05) * 3
        while beats < deadline_beats and not result:
            head.still_trying()
            beats += 1
            time.sleep(0.05)
        assert not result, "the waiter fell back although the head was beating"
    waiter.join(GUARD)
    assert result and result[0].queued
    assert waiter_queue.stats().fallbacks == 0


# -- a real full disk inside a group ------------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_loses_the_group_and_each_unit_gets_its_own_outcome(
    tiny_disk: Path,
) -> None:
    """On a real, nearly full tmpfs one unit is too big for the space left: SQLite cannot
    write the group's transaction (SQLITE_FULL), so none of it is acknowledged; every unit
    runs again alone, the small ones land once and only the big one's caller hears "full"."""
    store = SessionDB(tiny_disk / "state.db")
    try:
        store.create_session("s", "cli")
        store.append_message("s", "user", "warm up")  # the WAL and -shm exist
        reserve = tiny_disk / "reserve"
        reserve.write_bytes(b"\0" * (768 * 1024))
        disks.fill(tiny_disk)
        reserve.unlink()  # about 768 KB left
        small = 5
        calls: list[Callable[[], Any]] = [
            (lambda i=i: store.append_message("s", "user", f"small {i}")) for i in range(small)
        ]
        calls.append(lambda: store.append_message("s", "user", "big " + "x" * (3 << 20)))
        outcomes = _grouped(store, calls)
        kinds = [kind for kind, _ in outcomes]
        assert kinds == ["ok"] * small + ["error"], outcomes
        assert isinstance(outcomes[-1][1], StorageFullError)
        stats = store.stats()
        assert stats.lost_groups >= 1 and stats.group_reruns >= len(calls)
        stored = {m["id"]: m["content"] for m in store.get_messages("s")}
        assert sorted(stored.values()) == sorted(["warm up", *(f"small {i}" for i in range(small))])
        assert {outcomes[i][1] for i in range(small)} <= set(stored)
    finally:
        store.close()


# -- opening takes a turn in the same queue -----------------------------------------------------


def test_adopting_a_legacy_file_waits_for_its_turn_in_the_writer_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer holds the queue's turn (not SQLite's lock): opening a legacy file lines up
    behind it instead of overtaking it, then adopts the file once the turn is passed on."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 5)
    monkeypatch.setenv(writequeue.ENV_WAIT, str(GUARD))  # this file's queue: a long bound
    holder = writequeue.WriteQueue(path)  # another member of the line (its own descriptors)
    queue = writequeue.for_database(path)  # the opener's (its counters outlive the migration)
    opened: list[Any] = []
    with holder.turn() as turn:
        assert turn.queued
        issued = holder.tickets()[0]
        outcome, threads = _run_threads([lambda: opened.append(SessionDB(path))])
        wait_until(lambda: holder.tickets()[0] > issued, "the opener's ticket")
        assert threads[0].is_alive() and not opened
        with sqlite3.connect(path) as raw:  # not adopted yet: it really waits in line
            tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master")}
        assert "alembic_version" not in tables
    threads[0].join(GUARD)
    assert outcome[0] is not None and outcome[0][0] == "ok", outcome
    store = opened[0]
    try:
        stats = queue.stats()
        assert stats.turns >= 1 and stats.waits >= 1 and stats.fallbacks == 0
        store.create_session("after", "cli")
        assert store.get_session("after") is not None
    finally:
        store.close()
    assert hermes_store.current(path) is not None
