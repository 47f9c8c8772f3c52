"""Idempotency keys: an append or a token increment sent again with the same key lands once,
on every backend (SQLite, PostgreSQL, PostgreSQL behind PgBouncer) and through both APIs;
bad keys are refused before anything is written; keys go with their sessions and expire; the
original store keeps using a file that holds keys."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import InvalidInputError, SessionDB, UnknownSessionError
from hermes_store.ops import retention
from hermes_store.uow import groupcommit
from hermes_store.validate import MAX_IDEMPOTENCY_KEY_LENGTH
from tests.support.backends import CONTRACT_BACKENDS, FLAVORS, url_string
from tests.support.clock import FakeClock
from tests.support.pg_row_locks import GUARD, waiting_writer
from tests.support.seed_store import SeedSessionDB


@pytest.fixture(params=FLAVORS)
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=CONTRACT_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def key_rows(db: SessionDB) -> list[tuple[str, str, int | None]]:
    """The write_keys table, read in a read unit of the store's engine."""
    with db.uow.connect(write=False) as conn:
        rows = conn.exec_driver_sql(
            "SELECT key, session_id, message_id FROM write_keys ORDER BY key"
        ).all()
    return [(row[0], row[1], row[2]) for row in rows]


def test_resent_append_lands_once_and_returns_the_first_id(store: SessionDB) -> None:
    store.create_session("s", "cli")
    first = store.append_message("s", "user", "hello", idempotency_key="turn-1")
    again = store.append_message("s", "user", "hello", idempotency_key="turn-1")
    other = store.append_message("s", "user", "hello", idempotency_key="turn-2")
    plain = store.append_message("s", "user", "hello")
    assert again == first
    assert len({first, other, plain}) == 3
    assert [m["id"] for m in store.get_messages("s")] == [first, other, plain]
    assert store.get_session("s")["message_count"] == 3  # type: ignore[index]


def test_resent_increment_lands_once(store: SessionDB) -> None:
    store.create_session("s", "cli")
    for _ in range(3):
        store.update_token_counts(
            "s", input_tokens=10, estimated_cost_usd=0.5, idempotency_key="usage-1"
        )
    store.update_token_counts("s", input_tokens=1, idempotency_key="usage-2")
    store.update_token_counts("s", input_tokens=1)
    session = store.get_session("s")
    assert session is not None
    assert session["input_tokens"] == 12
    assert session["estimated_cost_usd"] == pytest.approx(0.5)
    # An absolute set is idempotent by itself: it records no key (and sets every time).
    store.update_token_counts("s", input_tokens=7, absolute=True, idempotency_key="set")
    store.update_token_counts("s", input_tokens=9, absolute=True, idempotency_key="set")
    assert store.get_session("s")["input_tokens"] == 9  # type: ignore[index]


def test_a_key_names_one_write(store: SessionDB) -> None:
    """Reusing a key for another session's append, or a token key for an append, is refused
    and writes nothing."""
    store.create_session("a", "cli")
    store.create_session("b", "cli")
    store.append_message("a", "user", "x", idempotency_key="k")
    store.update_token_counts("a", input_tokens=1, idempotency_key="t")
    with pytest.raises(InvalidInputError, match="to session 'a'"):
        store.append_message("b", "user", "x", idempotency_key="k")
    with pytest.raises(InvalidInputError, match="token update"):
        store.append_message("a", "user", "x", idempotency_key="t")
    assert store.message_count("a") == 1
    assert store.message_count("b") == 0


def test_a_token_key_names_one_write(store: SessionDB) -> None:
    """A key recorded for another session's token update, or for an append, is refused by a
    token increment (naming what the key was used for) and adds nothing; a re-send of the
    same session's increment still adds nothing and raises nothing."""
    store.create_session("a", "cli")
    store.create_session("b", "cli")
    store.update_token_counts("a", input_tokens=5, idempotency_key="turn-1/usage")
    message = store.append_message("a", "user", "hi", idempotency_key="turn-2")
    with pytest.raises(InvalidInputError, match="used for a token update of session 'a'"):
        store.update_token_counts("b", input_tokens=7, idempotency_key="turn-1/usage")
    appended = re.escape(f"used for an append to session 'a' (message {message})")
    with pytest.raises(InvalidInputError, match=appended):
        store.update_token_counts("a", input_tokens=9, idempotency_key="turn-2")
    with pytest.raises(InvalidInputError, match="used for an append to session 'a'"):
        store.update_token_counts("b", input_tokens=9, idempotency_key="turn-2")
    store.update_token_counts("a", input_tokens=5, idempotency_key="turn-1/usage")  # a re-send
    assert store.get_session("a")["input_tokens"] == 5  # type: ignore[index]
    assert store.get_session("b")["input_tokens"] == 0  # type: ignore[index]
    assert key_rows(store) == [("turn-1/usage", "a", None), ("turn-2", "a", message)]


def test_a_token_key_names_one_write_inside_a_block(store: SessionDB) -> None:
    """Inside a block (PostgreSQL runs the same statement on the block's connection): refused,
    and the block rolls back; a re-send there adds nothing."""
    store.create_session("a", "cli")
    store.create_session("b", "cli")
    store.update_token_counts("a", input_tokens=5, idempotency_key="t")
    with pytest.raises(InvalidInputError, match="token update of session 'a'"), store.transaction():
        store.update_token_counts("b", input_tokens=1)
        store.update_token_counts("b", input_tokens=7, idempotency_key="t")
    assert store.get_session("b")["input_tokens"] == 0  # type: ignore[index]
    with store.transaction():
        store.update_token_counts("a", input_tokens=5, idempotency_key="t")  # a re-send
    assert store.get_session("a")["input_tokens"] == 5  # type: ignore[index]


def test_keyed_append_to_a_missing_session_records_nothing(store: SessionDB) -> None:
    with pytest.raises(UnknownSessionError):
        store.append_message("nobody", "user", "x", idempotency_key="k")
    store.update_token_counts("nobody", input_tokens=1, idempotency_key="t")
    store.create_session("nobody", "cli")
    # Neither key was recorded: both writes land now.
    assert store.append_message("nobody", "user", "x", idempotency_key="k") > 0
    store.update_token_counts("nobody", input_tokens=1, idempotency_key="t")
    assert store.get_session("nobody")["input_tokens"] == 1  # type: ignore[index]
    assert store.message_count("nobody") == 1


@pytest.mark.parametrize(
    "bad",
    [5, b"key", "", "k" * (MAX_IDEMPOTENCY_KEY_LENGTH + 1), "a\x00b", "\ud800", ["k"]],
    ids=["int", "bytes", "empty", "too-long", "nul", "surrogate", "list"],
)
def test_bad_keys_are_refused_before_anything_is_written(store: SessionDB, bad: object) -> None:
    store.create_session("s", "cli")
    with pytest.raises(InvalidInputError, match="idempotency_key"):
        store.append_message("s", "user", "x", idempotency_key=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="idempotency_key"):
        store.update_token_counts("s", input_tokens=1, idempotency_key=bad)  # type: ignore[arg-type]
    assert store.message_count("s") == 0
    assert store.get_session("s")["input_tokens"] == 0  # type: ignore[index]


def test_the_longest_key_is_accepted(store: SessionDB) -> None:
    store.create_session("s", "cli")
    key = "é" * MAX_IDEMPOTENCY_KEY_LENGTH
    first = store.append_message("s", "user", "x", idempotency_key=key)
    assert store.append_message("s", "user", "x", idempotency_key=key) == first


def test_keys_inside_a_transaction_block(store: SessionDB) -> None:
    store.create_session("s", "cli")
    with store.transaction():
        first = store.append_message("s", "user", "x", idempotency_key="k")
        assert store.append_message("s", "user", "x", idempotency_key="k") == first
        store.update_token_counts("s", input_tokens=2, idempotency_key="t")
        store.update_token_counts("s", input_tokens=2, idempotency_key="t")
    assert store.append_message("s", "user", "x", idempotency_key="k") == first
    assert store.message_count("s") == 1
    assert store.get_session("s")["input_tokens"] == 2  # type: ignore[index]


def test_a_block_rolled_back_records_no_key(store: SessionDB) -> None:
    store.create_session("s", "cli")
    with pytest.raises(RuntimeError), store.transaction():
        store.append_message("s", "user", "x", idempotency_key="k")
        raise RuntimeError("rolled back")
    assert store.message_count("s") == 0
    assert store.append_message("s", "user", "x", idempotency_key="k") > 0
    assert store.message_count("s") == 1


@pytest.fixture
def sync_store(db_url: URL, clock: FakeClock) -> Iterator[SessionDB]:
    db = SessionDB(url_string(db_url), clock=clock)
    yield db
    db.close()


@pytest.mark.parametrize("grouped", [True, False], ids=["group-commit", "alone"])
def test_eight_threads_resending_one_key_land_one_message(
    db_url: URL, clock: FakeClock, grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight threads send the same keyed append and the same keyed increment at once: one
    message, one increment, and every thread gets the same id. Without group commit the
    PostgreSQL statements race in transactions of their own (the losers' key inserts fail
    the primary key and their reruns find the key); with it they share groups."""
    monkeypatch.setenv(groupcommit.ENV_SWITCH, "1" if grouped else "0")
    with SessionDB(url_string(db_url), clock=clock) as sync_store:
        _eight_threads(sync_store)


def _eight_threads(sync_store: SessionDB) -> None:
    sync_store.create_session("s", "cli")
    threads = 8
    start = threading.Barrier(threads)
    ids: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def send() -> None:
        try:
            start.wait(timeout=30)
            message_id = sync_store.append_message("s", "user", "once", idempotency_key="same")
            sync_store.update_token_counts("s", input_tokens=3, idempotency_key="same-usage")
        except BaseException as error:  # reported below
            with lock:
                errors.append(error)
            return
        with lock:
            ids.append(message_id)

    workers = [threading.Thread(target=send) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert errors == []
    assert len(ids) == threads and len(set(ids)) == 1
    assert [m["id"] for m in sync_store.get_messages("s")] == ids[:1]
    session = sync_store.get_session("s")
    assert session is not None
    assert session["message_count"] == 1
    assert session["input_tokens"] == 3
    assert key_rows(sync_store) == [("same", "s", ids[0]), ("same-usage", "s", None)]


def test_keys_go_with_deleted_and_pruned_sessions(sync_store: SessionDB, clock: FakeClock) -> None:
    for session_id in ("gone", "pruned", "kept"):
        sync_store.create_session(session_id, "cli")
        sync_store.append_message(session_id, "user", "x", idempotency_key=f"{session_id}-m")
        sync_store.update_token_counts(
            session_id, input_tokens=1, idempotency_key=f"{session_id}-t"
        )
    sync_store.end_session("pruned", "done")
    assert sync_store.delete_session("gone")
    clock.advance(2 * 86400)
    assert sync_store.prune_sessions(older_than_days=1) == 1
    assert key_rows(sync_store) == [("kept-m", "kept", 3), ("kept-t", "kept", None)]


def test_old_keys_expire(sync_store: SessionDB, clock: FakeClock) -> None:
    sync_store.create_session("s", "cli")
    old = sync_store.append_message("s", "user", "x", idempotency_key="old")
    clock.advance(retention.WRITE_KEY_LIFETIME_S + 60)
    recent = sync_store.append_message("s", "user", "y", idempotency_key="recent")
    assert retention.expire_write_keys(sync_store.uow, now=clock()) == 1
    assert key_rows(sync_store) == [("recent", "s", recent)]
    # Past its lifetime a re-send lands anew; within it, it still lands once.
    assert sync_store.append_message("s", "user", "x", idempotency_key="old") != old
    assert sync_store.append_message("s", "user", "y", idempotency_key="recent") == recent


def test_the_original_store_uses_a_file_with_keys(tmp_path: Path) -> None:
    """The keys live in a table of their own: the original store opens the file, appends and
    deletes. A key whose message it deleted still answers with that message's id (the write
    landed once; it is not written again)."""
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("s", "cli")
        first = db.append_message("s", "user", "ours", idempotency_key="k")
    seed = SeedSessionDB(path)
    try:
        assert [m["content"] for m in seed.get_messages("s")] == ["ours"]
        theirs = seed.append_message("s", "assistant", "theirs")
        assert theirs > first
        assert seed.delete_session("s")
    finally:
        seed.close()
    with SessionDB(path) as db:
        db.create_session("s", "cli")
        assert db.append_message("s", "user", "ours", idempotency_key="k") == first
        assert db.message_count("s") == 0
        assert db.append_message("s", "user", "new", idempotency_key="k2") > theirs


def test_a_same_key_append_in_a_concurrent_block_returns_the_first_id(pg_url: URL) -> None:
    """PostgreSQL: two transaction() blocks append with one key; the second looked the key up
    before the first committed, so it writes in a savepoint, meets the key at its insert and
    answers with the first block's message."""
    admin_engine = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    first_in = threading.Event()
    let_first_commit = threading.Event()
    ids: dict[str, int] = {}
    errors: list[BaseException] = []
    with SessionDB(url_string(pg_url)) as db, admin_engine.connect() as admin:
        db.create_session("s", "cli")

        def first() -> None:
            try:
                with db.transaction():
                    ids["first"] = db.append_message("s", "user", "x", idempotency_key="k")
                    first_in.set()
                    assert let_first_commit.wait(timeout=GUARD)
            except BaseException as error:  # reported below
                errors.append(error)
                first_in.set()

        def second() -> None:
            try:
                assert first_in.wait(timeout=GUARD)
                with db.transaction():
                    ids["second"] = db.append_message("s", "user", "x", idempotency_key="k")
            except BaseException as error:  # reported below
                errors.append(error)

        workers = [threading.Thread(target=first), threading.Thread(target=second)]
        for worker in workers:
            worker.start()
        try:
            waiting_writer(admin, besides=0)  # the second block waits on the first's locks
        finally:
            let_first_commit.set()
            for worker in workers:
                worker.join(timeout=GUARD)
        assert errors == []
        assert ids["second"] == ids["first"]
        assert [m["id"] for m in db.get_messages("s")] == [ids["first"]]
        assert db.get_session("s")["message_count"] == 1  # type: ignore[index]
    admin_engine.dispose()


def test_a_token_key_taken_by_a_concurrent_block_is_refused(pg_url: URL) -> None:
    """PostgreSQL: a block records key "t" for session "a"'s increment and holds it; an
    increment of "b" with "t" waits on the key's index entry, and once the block commits
    finds it taken by a write its statement's snapshot cannot see: it looks again and is
    refused, instead of silently adding nothing."""
    admin_engine = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    block_in = threading.Event()
    let_block_commit = threading.Event()
    errors: dict[str, BaseException] = {}
    with SessionDB(url_string(pg_url)) as db, admin_engine.connect() as admin:
        db.create_session("a", "cli")
        db.create_session("b", "cli")

        def block() -> None:
            try:
                with db.transaction():
                    db.update_token_counts("a", input_tokens=5, idempotency_key="t")
                    block_in.set()
                    assert let_block_commit.wait(timeout=GUARD)
            except BaseException as error:  # reported below
                errors["block"] = error
                block_in.set()

        def other() -> None:
            try:
                assert block_in.wait(timeout=GUARD)
                db.update_token_counts("b", input_tokens=7, idempotency_key="t")
            except BaseException as error:  # expected: the key names the block's write
                errors["other"] = error

        workers = [threading.Thread(target=block), threading.Thread(target=other)]
        for worker in workers:
            worker.start()
        try:
            waiting_writer(admin, besides=0)  # the increment waits on the block's key
        finally:
            let_block_commit.set()
            for worker in workers:
                worker.join(timeout=GUARD)
        assert "block" not in errors
        assert isinstance(errors.get("other"), InvalidInputError)
        assert "token update of session 'a'" in str(errors["other"])
        assert db.get_session("a")["input_tokens"] == 5  # type: ignore[index]
        assert db.get_session("b")["input_tokens"] == 0  # type: ignore[index]
    admin_engine.dispose()
