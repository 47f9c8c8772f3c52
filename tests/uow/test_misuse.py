"""Misuse gets a clear error at once, never a hang, a held lock or a raw error.

A transaction belongs to the thread that opened it: a generator that opened one and is
resumed in another thread is refused (and its block rolled back); an AsyncSessionDB call inside
a sync block on the same file, and a sync write inside an async block, are refused instead of
waiting for themselves; an event loop closed with an async block open releases SQLite's write
lock (another process writes afterwards); AsyncSessionDB's sync store on PostgreSQL outside
``run_sync`` says what to do instead of MissingGreenlet; a write through a second store on the
same PostgreSQL database from the thread running another store's open block is refused (it
cannot join the block, and waited for its row forever). A nested ``transaction()`` is a
SAVEPOINT; blocks ended out of order (an outer one before a nested one still open inside it)
commit nothing and say so. Folders the package creates are owner-only whatever the umask.

The would-be hangs run in a thread joined with a generous timeout: a regression fails.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import URL

from hermes_store import (
    AsyncSessionDB,
    HermesStoreError,
    RetryPolicy,
    SessionDB,
    StoreMisuseError,
    TransactionMisuseError,
)
from hermes_store.cli import cli
from hermes_store.engine.factory import to_url
from hermes_store.uow import shared
from tests.support.backends import is_sqlite, sqlite_lock_is_free, url_string

#: A deadlock guard only: the calls under test answer at once.
STUCK = 60.0
#: What the refusal of an async call inside a sync block tells the caller to use.
ASYNC_BLOCK = r"async with adb\.transaction\(\)"


def _outcome(work: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """Run ``work`` in a thread; its result or error once it ended (fails if it hangs)."""
    box: list[Any] = []

    def body() -> None:
        try:
            box.append((work(), None))
        except BaseException as error:  # handed to the test
            box.append((None, error))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(STUCK)
    assert not thread.is_alive(), f"still waiting after {STUCK} s: a hang, not an error"
    return box[0]  # type: ignore[no-any-return]


def _committed(url: URL | Path, sql: str) -> list[Any]:
    engine = sa.create_engine(url_string(to_url(url)), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.scalars(sa.text(sql)))
    finally:
        engine.dispose()


def _messages(url: URL | Path) -> list[str]:
    return _committed(url, "SELECT content FROM messages ORDER BY id")


def _sessions(url: URL | Path) -> list[str]:
    return _committed(url, "SELECT id FROM sessions ORDER BY id")


# -- a transaction belongs to the thread that opened it ----------------------------------------


@pytest.mark.parametrize("resumed", ["calls the store", "only ends the block"])
def test_a_generator_resumed_in_another_thread_is_refused_at_once(
    db_url: URL, resumed: str
) -> None:
    db = SessionDB(url_string(db_url))  # closed only on success: a hang must not hang teardown
    db.create_session("other", "cli")

    def rows() -> Iterator[int]:
        with db.transaction():
            db.create_session("opened", "cli")
            yield 1
            if resumed == "calls the store":
                db.append_message("other", "user", "from the resumed generator")
            yield 2

    generator = rows()
    assert next(generator) == 1  # the block is open, in this thread
    result, error = _outcome(lambda: list(generator))
    assert result is None and isinstance(error, TransactionMisuseError), error
    assert "belongs to the thread that opened it" in str(error)
    # The block was rolled back, nothing of it landed and no lock is left held: this
    # thread (whose context still named the block) and the file go on working.
    assert _sessions(db_url) == ["other"]
    db.append_message("other", "user", "after")
    assert _messages(db_url) == ["after"]
    with db.transaction():
        db.create_session("later", "cli")
    assert _sessions(db_url) == ["later", "other"]
    db.close()


def test_the_thread_running_an_open_blocks_body_is_refused_a_write(db_url: URL) -> None:
    """Two asyncio tasks of one thread: one holds a sync block across an await, the other's
    sync write would wait for the writer (SQLite) or the session row's lock (PostgreSQL) its
    own thread holds, freezing the loop for good."""
    db = SessionDB(url_string(db_url))
    db.create_session("s", "cli")

    async def scenario() -> BaseException | None:
        inside = asyncio.Event()
        leave = asyncio.Event()

        async def holder() -> None:
            with db.transaction():
                db.append_message("s", "user", "held")
                inside.set()
                await leave.wait()

        task = asyncio.create_task(holder())
        await inside.wait()
        try:
            db.append_message("s", "user", "refused")
        except TransactionMisuseError as error:
            return error
        finally:
            leave.set()
            await task
        return None

    result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None and isinstance(result, TransactionMisuseError), (result, error)
    assert _messages(db_url) == ["held"]
    db.close()


# -- AsyncSessionDB and sync blocks of the same file --------------------------------------------


def test_an_async_call_inside_a_sync_block_of_the_same_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    db = SessionDB(path)
    db.create_session("s", "cli")

    async def scenario() -> list[str]:
        refused: list[str] = []
        async with AsyncSessionDB(path) as adb:
            await adb.message_count("s")
            with db.transaction():
                db.append_message("s", "user", "sync")
                for attempt in (
                    lambda: adb.append_message("s", "user", "async"),
                    lambda: asyncio.wait_for(adb.get_session("s"), STUCK),
                    lambda: adb.run_sync(lambda store: store.message_count("s")),
                ):
                    with pytest.raises(TransactionMisuseError, match=ASYNC_BLOCK):
                        await attempt()
                    refused.append("call")
                with pytest.raises(TransactionMisuseError):
                    async with adb.transaction():
                        pass
                refused.append("block")
            await adb.append_message("s", "user", "after the block")  # then it works
        return refused

    result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    assert result == ["call", "call", "call", "block"]
    assert _messages(path) == ["sync", "after the block"]
    db.close()


def test_a_sync_write_inside_an_async_block_of_the_same_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    db = SessionDB(path)
    db.create_session("s", "cli")

    async def scenario() -> None:
        async with AsyncSessionDB(path) as adb:
            async with adb.transaction():
                await adb.append_message("s", "user", "async")
                with pytest.raises(TransactionMisuseError, match="wait for itself"):
                    db.append_message("s", "user", "sync")
                with pytest.raises(TransactionMisuseError), db.transaction():
                    pass
            db.append_message("s", "user", "after the block")

    _result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    assert _messages(path) == ["async", "after the block"]
    db.close()


def test_the_sync_store_of_a_postgresql_adb_says_what_to_do(pg_url: URL) -> None:
    async def scenario() -> list[str]:
        seen: list[str] = []
        async with AsyncSessionDB(url_string(pg_url)) as adb:
            await adb.create_session("s", "cli")
            for call in (
                lambda: adb.sync.append_message("s", "user", "raw"),
                lambda: adb.sync.get_session("s"),
                lambda: adb.sync.message_count("s"),
                adb.sync.transaction().__enter__,
            ):
                with pytest.raises(StoreMisuseError, match="run_sync") as refused:
                    call()
                seen.append(type(refused.value).__name__)
            # Inside run_sync the same store works (SQLAlchemy's greenlet is there).
            await adb.run_sync(lambda db: db.append_message("s", "user", "in run_sync"))
            seen.append(str(await adb.message_count("s")))
        return seen

    result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    assert result == ["StoreMisuseError"] * 4 + ["1"]
    assert _messages(pg_url) == ["in run_sync"]


# -- two stores on one PostgreSQL database --------------------------------------------------------

SECOND_STORE = "second store on the same PostgreSQL database"


def test_a_second_postgresql_store_is_refused_a_write_inside_a_block_of_the_first(
    pg_url: URL,
) -> None:
    """On SQLite the stores of a file share one Unit of Work, so the second store's write
    joins the block; on PostgreSQL it cannot (another connection) and waited for the
    session row the block had changed, forever. It is refused before it waits."""
    first, second = SessionDB(url_string(pg_url)), SessionDB(url_string(pg_url))
    first.create_session("s", "cli")

    def scenario() -> BaseException | None:
        refused: BaseException | None = None
        with first.transaction():
            first.append_message("s", "user", "first")
            try:
                second.append_message("s", "user", "never")
            except TransactionMisuseError as error:
                refused = error
            first.append_message("s", "user", "the block goes on")
        second.append_message("s", "user", "after the block")
        return refused

    result, error = _outcome(scenario)
    assert error is None, error
    assert isinstance(result, TransactionMisuseError) and SECOND_STORE in str(result)
    assert _messages(pg_url) == ["first", "the block goes on", "after the block"]
    first.close()
    second.close()


def test_the_same_database_is_known_however_its_address_is_spelled(pg_url: URL) -> None:
    """The tables are identified by the server itself: ``localhost`` without a port is the
    same database as ``127.0.0.1:5432`` (a key made of the URL missed it, and waited)."""
    other_spelling = pg_url.set(host="localhost", port=None)
    assert other_spelling.render_as_string() != pg_url.render_as_string()
    first, second = SessionDB(url_string(pg_url)), SessionDB(url_string(other_spelling))
    first.create_session("s", "cli")

    def scenario() -> BaseException | None:
        with first.transaction():
            first.append_message("s", "user", "first")
            try:
                second.append_message("s", "user", "never")
            except TransactionMisuseError as error:
                return error
        return None

    result, error = _outcome(scenario)
    assert error is None, error
    assert isinstance(result, TransactionMisuseError) and SECOND_STORE in str(result)
    assert _messages(pg_url) == ["first"]
    first.close()
    second.close()


def test_a_second_async_store_awaited_inside_a_block_of_its_own_task_is_refused(
    pg_url: URL,
) -> None:
    """The task that holds a block (of a sync store or of another async store) and awaits a
    write of the same row through a second async store waits for itself: refused."""
    db = SessionDB(url_string(pg_url))
    db.create_session("s", "cli")

    async def scenario() -> list[str]:
        seen: list[str] = []
        async with (
            AsyncSessionDB(url_string(pg_url)) as first,
            AsyncSessionDB(url_string(pg_url)) as second,
        ):
            async with first.transaction():
                await first.append_message("s", "user", "async block")
                with pytest.raises(TransactionMisuseError, match=SECOND_STORE):
                    await second.append_message("s", "user", "never")
                seen.append("refused in an async block")
            with db.transaction():
                db.append_message("s", "user", "sync block")
                with pytest.raises(TransactionMisuseError, match=SECOND_STORE):
                    await second.append_message("s", "user", "never")
                seen.append("refused in a sync block")
            await second.append_message("s", "user", "after the blocks")
        return seen

    result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    assert result == ["refused in an async block", "refused in a sync block"]
    assert _messages(pg_url) == ["async block", "sync block", "after the blocks"]
    db.close()


def test_another_threads_write_through_a_second_store_waits_for_the_block(pg_url: URL) -> None:
    """Only the thread running the block is refused: another thread's write is an ordinary
    wait for the row's lock, and lands once the block commits."""
    first, second = SessionDB(url_string(pg_url)), SessionDB(url_string(pg_url))
    first.create_session("s", "cli")
    inside = threading.Event()

    def other_thread() -> None:
        inside.wait()
        second.append_message("s", "user", "other thread")

    def scenario() -> None:
        writer = threading.Thread(target=other_thread)
        with first.transaction():
            first.append_message("s", "user", "block")
            writer.start()
            inside.set()
        writer.join()

    _result, error = _outcome(scenario)
    assert error is None, error
    assert sorted(_messages(pg_url)) == ["block", "other thread"]
    first.close()
    second.close()


def test_a_sync_write_from_the_loop_of_another_stores_async_block_is_refused(pg_url: URL) -> None:
    db = SessionDB(url_string(pg_url))
    db.create_session("s", "cli")

    async def scenario() -> None:
        async with AsyncSessionDB(url_string(pg_url)) as adb:
            async with adb.transaction():
                await adb.append_message("s", "user", "async")
                with pytest.raises(TransactionMisuseError, match=SECOND_STORE):
                    db.append_message("s", "user", "sync")
            db.append_message("s", "user", "after the block")

    _result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    assert _messages(pg_url) == ["async", "after the block"]
    db.close()


def test_two_async_stores_tasks_wait_for_each_others_blocks(pg_url: URL) -> None:
    """An ``AsyncSessionDB`` write waits without blocking its loop: a task writing through a
    second async store while another task's block holds the row waits, then lands."""

    async def scenario() -> None:
        async with (
            AsyncSessionDB(url_string(pg_url)) as first,
            AsyncSessionDB(url_string(pg_url)) as second,
        ):
            await first.create_session("s", "cli")
            inside = asyncio.Event()

            async def holder() -> None:
                async with first.transaction():
                    await first.append_message("s", "user", "block")
                    inside.set()
                    await asyncio.sleep(0)  # the other task's write starts meanwhile

            async def writer() -> None:
                await inside.wait()
                await second.append_message("s", "user", "other task")

            await asyncio.gather(holder(), writer())

    _result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    assert sorted(_messages(pg_url)) == ["block", "other task"]


# -- an event loop closed with a block open -----------------------------------------------------

_OTHER_WRITER = """
import sys
from hermes_store import SessionDB
db = SessionDB(sys.argv[1])
db.append_message("s", "user", "another process")
db.close()
"""


def test_a_loop_closed_with_an_open_block_releases_its_locks(db_url: URL) -> None:
    """SQLite's write lock, PostgreSQL's row locks (the block updated the session's row)."""
    url = url_string(db_url)
    with SessionDB(url) as setup:
        setup.create_session("s", "cli")
    adb = AsyncSessionDB(url)
    loop = asyncio.new_event_loop()
    inside = asyncio.Event()

    async def holder() -> None:
        async with adb.transaction():
            await adb.append_message("s", "user", "abandoned")
            inside.set()
            await asyncio.Event().wait()  # never set: the block stays open

    pending = loop.create_task(holder())
    loop.run_until_complete(inside.wait())
    loop.close()  # the holder is never cancelled, never resumed
    # Another process can write: the abandoned block no longer holds the lock (the other
    # waits its whole retry budget, or on PostgreSQL for the row, far longer than the
    # release takes).
    other = subprocess.run(
        [sys.executable, "-c", _OTHER_WRITER, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 0, other.stderr[-2000:]
    assert _messages(db_url) == ["another process"]  # the abandoned write was rolled back
    with SessionDB(url) as db:  # and this process writes again too
        db.append_message("s", "user", "this process")
    assert _messages(db_url) == ["another process", "this process"]
    del pending
    asyncio.run(adb.close())


# -- nested transaction(): a SAVEPOINT ----------------------------------------------------------


def test_a_nested_block_that_raises_rolls_back_only_itself(db_url: URL) -> None:
    with SessionDB(url_string(db_url)) as db:
        db.create_session("s", "cli")
        with db.transaction():
            db.append_message("s", "user", "outer before")
            with pytest.raises(RuntimeError, match="inner fails"), db.transaction():
                db.append_message("s", "user", "inner")
                db.update_token_counts("s", input_tokens=5)
                db.create_session("inner-only", "cli")
                raise RuntimeError("inner fails")
            with db.transaction():  # a nested block that succeeds is kept
                db.append_message("s", "user", "inner kept")
            db.append_message("s", "user", "outer after")
            assert _messages(db_url) == []  # nothing commits before the outer block ends
        assert _messages(db_url) == ["outer before", "inner kept", "outer after"]
        assert _sessions(db_url) == ["s"]
        session = db.get_session("s")
        assert session is not None
        assert session["message_count"] == 3 and session["input_tokens"] == 0


def test_a_database_error_in_a_nested_block_leaves_the_outer_one_usable(db_url: URL) -> None:
    """PostgreSQL aborts the whole transaction on a failed statement; the savepoint undoes
    just the nested block, so the outer one goes on and commits."""
    with SessionDB(url_string(db_url)) as db:
        db.create_session("s", "cli")
        with db.transaction():
            with pytest.raises(sa.exc.IntegrityError), db.transaction() as conn:
                db.append_message("s", "user", "inner")
                conn.execute(
                    sa.text("INSERT INTO sessions (id, source, started_at) VALUES ('s', 'x', 1)")
                )
            db.append_message("s", "user", "outer")
        assert _messages(db_url) == ["outer"]
        session = db.get_session("s")
        assert session is not None and session["message_count"] == 1


def test_a_nested_async_block_that_raises_rolls_back_only_itself(db_url: URL) -> None:
    async def scenario() -> None:
        async with AsyncSessionDB(url_string(db_url)) as adb:
            await adb.create_session("s", "cli")
            async with adb.transaction():
                await adb.append_message("s", "user", "outer")
                with pytest.raises(KeyError):
                    async with adb.transaction():
                        await adb.append_message("s", "user", "inner")
                        raise KeyError("inner fails")
                await adb.append_message("s", "user", "outer after")

    _result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    assert _messages(db_url) == ["outer", "outer after"]


def _lock_is_free(url: URL) -> bool:
    """No one holds the database's write lock: on SQLite a foreign connection takes it at
    once (PostgreSQL has no such lock: True)."""
    return not is_sqlite(url) or sqlite_lock_is_free(to_url(url).database or "")


def _opened_in_order(db: SessionDB, later: str) -> tuple[Iterator[None], Iterator[None]]:
    """Two generators, the second's block nested in the first's, both suspended inside."""

    def outer() -> Iterator[None]:
        with db.transaction():
            db.append_message("s", "user", "outer")
            yield

    def inner() -> Iterator[None]:
        with db.transaction():  # a SAVEPOINT in outer's block
            db.append_message("s", "user", "inner draft")
            db.create_session("inner-only", "cli")
            yield
            if later == "raises":
                raise ValueError("take the draft back")

    g1, g2 = outer(), inner()
    next(g1)
    next(g2)
    return g1, g2


@pytest.mark.parametrize("later", ["raises", "exits cleanly"])
def test_an_outer_block_ended_before_its_nested_one_commits_nothing(
    db_url: URL, later: str
) -> None:
    """Before: the outer block committed the nested block's writes with its own, even those of
    a nested block that then raised (or whose clean exit raised SQLAlchemy's "This nested
    transaction is inactive")."""
    db = SessionDB(url_string(db_url))  # closed only on success: a hang must not hang teardown
    db.create_session("s", "cli")
    g1, g2 = _opened_in_order(db, later)
    with pytest.raises(TransactionMisuseError, match="innermost first"):
        next(g1, None)  # the outer block ends first: the whole unit is rolled back
    assert _messages(db_url) == [] and _sessions(db_url) == ["s"]
    assert db.uow.current() is None and _lock_is_free(db_url)
    if later == "raises":  # what the nested block asked for happened: its error goes on
        with pytest.raises(ValueError, match="take the draft back") as raised:
            next(g2, None)
        assert type(raised.value) is ValueError
    else:  # the writes it meant to keep are gone
        with pytest.raises(TransactionMisuseError, match="after the block it was opened in"):
            next(g2, None)
    assert _messages(db_url) == [] and _sessions(db_url) == ["s"]
    # Nothing left open or held: a new block, another store, a foreign connection all write.
    assert db.uow.current() is None and _lock_is_free(db_url)
    with db.transaction(), db.transaction():  # nested, as ever
        db.append_message("s", "user", "later block")
    with SessionDB(url_string(db_url)) as other:
        _result, error = _outcome(lambda: other.append_message("s", "user", "other store"))
    assert error is None, error
    assert _messages(db_url) == ["later block", "other store"]
    assert _lock_is_free(db_url)
    db.close()


@pytest.mark.parametrize("later", ["raises", "exits cleanly"])
def test_async_blocks_ended_out_of_order_commit_nothing_and_never_hang(
    db_url: URL, later: str
) -> None:
    """``AsyncSessionDB``: the inner block's later exit went to the outer block's thread,
    gone with the outer block, and waited for it forever. It now ends where it is, as the
    sync block does."""
    url = url_string(db_url)

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        adb = AsyncSessionDB(url)
        try:
            await adb.create_session("s", "cli")

            async def outer() -> AsyncIterator[None]:
                async with adb.transaction():
                    await adb.append_message("s", "user", "outer")
                    yield

            async def inner() -> AsyncIterator[None]:
                async with adb.transaction():
                    await adb.append_message("s", "user", "inner draft")
                    yield
                    if later == "raises":
                        raise ValueError("take the draft back")

            g1, g2 = outer(), inner()
            await anext(g1)
            await anext(g2)
            ended: list[BaseException | None] = []
            for gen in (g1, g2):
                try:
                    await anext(gen, None)
                except Exception as error:  # each told apart below
                    ended.append(error)
                else:
                    ended.append(None)
            await adb.append_message("s", "user", "after")
            return ended[0], ended[1]
        finally:
            await adb.close()

    result, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    first, second = result
    assert isinstance(first, TransactionMisuseError), first
    if later == "raises":
        assert type(second) is ValueError, second
    else:
        assert isinstance(second, TransactionMisuseError), second
    assert _messages(db_url) == ["after"]


def test_a_connect_block_ended_before_its_nested_transaction_commits_nothing(
    db_url: URL,
) -> None:
    db = SessionDB(url_string(db_url))
    db.create_session("s", "cli")

    def outer() -> Iterator[None]:
        with db.uow.connect():
            db.append_message("s", "user", "outer")
            yield

    g1 = outer()
    next(g1)
    block = db.transaction()
    block.__enter__()
    db.append_message("s", "user", "inner")
    with pytest.raises(TransactionMisuseError, match="innermost first"):
        next(g1, None)
    with pytest.raises(TransactionMisuseError, match="after the block it was opened in"):
        block.__exit__(None, None, None)
    assert _messages(db_url) == [] and _lock_is_free(db_url)
    db.append_message("s", "user", "after")
    assert _messages(db_url) == ["after"]
    db.close()


def test_a_run_unit_that_returns_with_a_nested_block_open_commits_nothing(db_url: URL) -> None:
    db = SessionDB(url_string(db_url))
    db.create_session("s", "cli")
    left_open: list[AbstractContextManager[Any]] = []

    def unit(_conn: sa.Connection) -> None:
        db.append_message("s", "user", "in the unit")
        left_open.append(block := db.transaction())
        block.__enter__()
        db.append_message("s", "user", "in the nested block")

    with pytest.raises(TransactionMisuseError, match="innermost first"):
        db.uow.run(unit)
    with pytest.raises(TransactionMisuseError, match="after the block it was opened in"):
        left_open[0].__exit__(None, None, None)
    assert _messages(db_url) == [] and _lock_is_free(db_url)
    db.append_message("s", "user", "after")
    assert _messages(db_url) == ["after"]
    db.close()


def test_a_nested_block_ended_before_one_inside_it_fails_the_whole_transaction(
    db_url: URL,
) -> None:
    """Three levels: the middle block ends first. It raises at once (both rolled back to its
    savepoint, SQLAlchemy's bookkeeping kept in order), and the outer block, even when it
    caught that and went on, commits nothing: the code is broken."""
    db = SessionDB(url_string(db_url))
    db.create_session("s", "cli")

    def block(content: str) -> Iterator[None]:
        with db.transaction():
            db.append_message("s", "user", content)
            yield

    with pytest.raises(TransactionMisuseError, match="a nested transaction"), db.transaction():
        db.append_message("s", "user", "outer")
        middle, inner = block("middle"), block("inner")
        next(middle)
        next(inner)
        with pytest.raises(TransactionMisuseError, match="innermost first"):
            next(middle, None)
        with pytest.raises(TransactionMisuseError, match="after the block it was opened"):
            next(inner, None)
        with db.transaction():  # the unit still works, but will not commit
            db.append_message("s", "user", "nested after")
        db.append_message("s", "user", "outer after")
    assert _messages(db_url) == [] and _lock_is_free(db_url)
    db.append_message("s", "user", "after")
    assert _messages(db_url) == ["after"]
    db.close()


def test_blocks_of_generators_ended_innermost_first_commit_as_before(db_url: URL) -> None:
    """The same generators, ended in order: the nested block is a savepoint as ever."""
    with SessionDB(url_string(db_url)) as db:
        db.create_session("s", "cli")
        for later in ("exits cleanly", "raises"):
            g1, g2 = _opened_in_order(db, later)
            if later == "raises":
                with pytest.raises(ValueError, match="take the draft back"):
                    next(g2, None)
            else:
                next(g2, None)
            next(g1, None)
        assert _messages(db_url) == ["outer", "inner draft", "outer"]
        assert _sessions(db_url) == ["inner-only", "s"]
        with ExitStack() as stack:  # an ExitStack ends them innermost first
            stack.enter_context(db.transaction())
            db.append_message("s", "user", "stack outer")
            stack.enter_context(db.transaction())
            db.append_message("s", "user", "stack inner")
        assert _messages(db_url)[-2:] == ["stack outer", "stack inner"]


# -- folders the package creates are owner-only ------------------------------------------------


@pytest.fixture
def open_umask() -> Iterator[None]:
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("open_umask")
def test_export_split_creates_owner_only_folders(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("s1", "cli")
        db.set_session_title("s1", "Private plans")
        db.append_message("s1", "user", "hello")
    existing = tmp_path / "existing"
    existing.mkdir()
    existing.chmod(0o755)
    out = existing / "new" / "deeper"
    result = CliRunner(env={"HERMES_STORE_URL": None}).invoke(
        cli,
        ["--db", str(path), "export", "--format", "md", "--split", "-o", str(out)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert _mode(out) == 0o700 and _mode(out.parent) == 0o700
    assert _mode(existing) == 0o755  # a folder that existed keeps its mode
    written = list(out.iterdir())
    assert written and all(_mode(file) == 0o600 for file in written)


@pytest.mark.usefixtures("open_umask")
def test_a_new_database_creates_owner_only_parent_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home" / ".hermes"
    monkeypatch.setenv("HERMES_HOME", str(home))
    with SessionDB() as db:
        db.create_session("s", "cli")
    assert _mode(home) == 0o700 and _mode(home.parent) == 0o700
    with SessionDB(tmp_path / "a" / "b" / "state.db") as db:
        db.create_session("s", "cli")
    assert _mode(tmp_path / "a") == 0o700 and _mode(tmp_path / "a" / "b") == 0o700


def test_closing_while_blocks_wait_for_the_writer_leaves_it_free(tmp_path: Path) -> None:
    """close() while other tasks' transaction() blocks waited for the writer: the first of
    them began (BEGIN IMMEDIATE) once the holder's block ended, then failed on the closed
    store and was never ended, so SQLite's lock stayed held (another process failed after its
    24 s of retries) and the waiters behind it, close() among them, waited for good. Each
    block now fails saying the store is closed, and the file is free at once."""
    path = tmp_path / "state.db"

    async def scenario() -> list[str]:
        adb = AsyncSessionDB(path, max_threads=4)
        await adb.create_session("s", "cli")
        uow = adb.sync.uow
        inside, leave = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with adb.transaction():
                await adb.append_message("s", "user", "held")
                inside.set()
                await leave.wait()

        async def waiter(n: int) -> str:
            await inside.wait()
            try:
                async with adb.transaction():
                    await adb.append_message("s", "user", f"waiter {n}")
            except HermesStoreError as error:
                return str(error)
            return "landed"

        held = asyncio.create_task(holder())
        await inside.wait()
        waiting = [asyncio.create_task(waiter(n)) for n in range(2)]
        assert await asyncio.to_thread(uow.wait_for_waiting_writers, 2, STUCK)
        closing = asyncio.create_task(adb.close())  # the blocks are other tasks'
        # close() lets go of the writer in its turn, behind the two blocks: all three wait.
        assert await asyncio.to_thread(uow.wait_for_waiting_writers, 3, STUCK / 2)
        leave.set()
        await asyncio.wait_for(asyncio.gather(held, closing), STUCK / 2)
        return list(await asyncio.wait_for(asyncio.gather(*waiting), STUCK / 2))

    outcomes, error = _outcome(lambda: asyncio.run(scenario()))
    assert error is None, error
    assert len(outcomes) == 2
    assert all("this SessionDB is closed" in outcome for outcome in outcomes), outcomes
    other = SessionDB(path, retry=RetryPolicy(attempts=1))  # no patience: the lock is free
    try:
        other.append_message("s", "user", "after")
        assert [m["content"] for m in other.get_messages("s")] == ["held", "after"]
    finally:
        other.close()


def test_a_closed_store_refuses_every_call(db_url: URL) -> None:
    """A store used after close() kept working: its calls became a second writer of the file
    beside a store opened since, and a block of one waited on the other (23 s, then
    DatabaseLockedError). Every call now says the store is closed; close() inside a block is
    refused before anything is let go of."""
    first = SessionDB(url_string(db_url))
    first.create_session("s", "cli")
    first.close()
    first.close()  # twice is fine
    calls: list[Callable[[], object]] = [
        lambda: first.append_message("s", "user", "after close"),
        lambda: first.get_messages("s"),
        lambda: first.transaction().__enter__(),
        first.stats,
    ]
    for call in calls:
        with pytest.raises(StoreMisuseError, match="this SessionDB is closed"):
            call()
    with SessionDB(url_string(db_url)) as second:
        with second.transaction():
            with pytest.raises(StoreMisuseError, match="inside an open unit"):
                second.close()
            second.append_message("s", "user", "in the block")
        assert [m["content"] for m in second.get_messages("s")] == ["in the block"]


# -- work that goes on past close() ------------------------------------------------------------

needs_proc = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd"
)


def _open_on(path: Path) -> list[str]:
    """What this process holds open of the database's files (the file, its WAL and shared
    memory, the writer queue's lock file)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            held.append(target)
    return held


@needs_proc
def test_an_export_going_on_after_close_ends_at_its_next_page(tmp_path: Path) -> None:
    """An export iterator read past close() went on reading every page on a connection the
    closed store opened again, and left it (the file, its WAL and shared memory) open. Its
    next page now raises StoreMisuseError, and nothing stays open."""
    path = tmp_path / "state.db"
    db = SessionDB(path)
    for n in range(5):
        db.create_session(f"s{n}", "cli")
    records = db.iter_export(page_size=2)
    assert next(records)["id"] == "s4"
    db.close()
    rest: list[str] = []
    with pytest.raises(StoreMisuseError, match="this store is closed"):
        rest.extend(record["id"] for record in records)
    assert rest == ["s3"]  # the page read before close(), not one more
    del records
    gc.collect()
    assert _open_on(path) == []
    assert not os.path.exists(f"{path}-wal")  # the last connection checkpointed it away


@needs_proc
def test_calls_that_looked_the_store_up_before_close_open_nothing_again(tmp_path: Path) -> None:
    """A call that had looked up the store's Unit of Work before close() (another thread's)
    opened the writer, a reader and the writer queue again after it, none of them closed
    afterwards. Each is now refused, and nothing stays open."""
    path = tmp_path / "state.db"
    db = SessionDB(path)
    db.create_session("s", "cli")
    uow = db.uow
    db.close()
    one = sa.select(sa.literal(1))
    calls: list[Callable[[], object]] = [
        lambda: uow.run_on_driver(lambda driver: driver.execute("SELECT 1")),
        lambda: uow.run(lambda conn: conn.execute(one).scalar()),
        lambda: uow.read_scalar(one),
        lambda: uow.read_rows(one),
        lambda: uow.read(lambda conn: conn.execute(one).scalar()),
        lambda: uow.transaction().__enter__(),
        lambda: uow.write_queue,
    ]
    for call in calls:
        with pytest.raises(StoreMisuseError, match="this store is closed"):
            call()
    assert not uow.checkpoint()
    assert _open_on(path) == []


@needs_proc
def test_writes_racing_close_leave_nothing_open(tmp_path: Path) -> None:
    """Threads writing while the store closes: each ends with StoreMisuseError, every write
    acknowledged is stored, and no connection or lock file stays open."""
    path = tmp_path / "state.db"
    acked = 0
    for round_ in range(20):
        db = SessionDB(path)
        db.create_session("s", "cli")
        counts: list[int] = []
        errors: list[BaseException] = []
        go = threading.Event()

        def write(
            db: SessionDB = db,
            counts: list[int] = counts,
            errors: list[BaseException] = errors,
            go: threading.Event = go,
        ) -> None:
            go.wait()
            n = 0
            try:
                while True:
                    db.append_message("s", "user", "racing")
                    n += 1
            except StoreMisuseError:
                counts.append(n)
            except BaseException as error:  # handed to the test
                errors.append(error)

        threads = [threading.Thread(target=write) for _ in range(3)]
        for thread in threads:
            thread.start()
        go.set()
        deadline = time.monotonic() + STUCK
        while round_ % 2 and not db.uow.stats.write_units and time.monotonic() < deadline:
            time.sleep(0.0002)  # on odd rounds, close once a write landed
        db.close()
        for thread in threads:
            thread.join(STUCK)
        assert not any(thread.is_alive() for thread in threads)
        assert not errors, errors
        acked += sum(counts)
    gc.collect()
    assert _open_on(path) == []
    with SessionDB(path) as db:
        assert db.message_count() == acked


@needs_proc
def test_a_store_dropped_without_close_gives_its_share_back(tmp_path: Path) -> None:
    """A store dropped without close() kept its share of the file's writer for good: the
    last close() on the file was not the last, so it never checkpointed nor let go of the
    connections. Its share is now given back at the registry's next look."""
    path = tmp_path / "state.db"
    kept = SessionDB(path)
    kept.create_session("s", "cli")
    dropped = SessionDB(path)
    dropped.append_message("s", "user", "through the dropped store")
    del dropped
    gc.collect()
    kept.close()
    assert _open_on(path) == []
    assert not os.path.exists(f"{path}-wal")
    alone = SessionDB(path)
    alone.append_message("s", "user", "through a store never closed")
    del alone
    gc.collect()
    shared.open_files()  # the registry's next look: the dropped store's writer closes
    assert _open_on(path) == []
    assert _messages(path) == ["through the dropped store", "through a store never closed"]


def test_a_block_of_a_store_dropped_at_once_is_joined_by_a_store_opened_in_it(
    tmp_path: Path,
) -> None:
    """``with SessionDB(path).transaction():`` drops its store at once: the block keeps the
    file's writer, so a store opened inside it joins the block as before."""
    path = tmp_path / "state.db"
    SessionDB(path).close()
    with SessionDB(path).transaction():
        gc.collect()
        inner = SessionDB(path)
        inner.create_session("s", "cli")
        inner.append_message("s", "user", "in the block")
    inner.close()
    assert _messages(path) == ["in the block"]


def test_a_closed_async_store_raises_store_misuse(tmp_path: Path) -> None:
    """A closed AsyncSessionDB raised a plain HermesStoreError where SessionDB raises
    StoreMisuseError."""
    path = tmp_path / "state.db"

    async def scenario() -> None:
        adb = AsyncSessionDB(path)
        with pytest.raises(StoreMisuseError, match="not open yet"):
            _ = adb.sync
        await adb.create_session("s", "cli")
        async with adb.transaction():
            with pytest.raises(StoreMisuseError, match="close\\(\\) inside an open"):
                await adb.close()
        await adb.close()
        with pytest.raises(StoreMisuseError, match="this AsyncSessionDB is closed"):
            await adb.get_session("s")
        with pytest.raises(StoreMisuseError, match="this AsyncSessionDB is closed"):
            async with adb.transaction():
                pass

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["SessionDB", "AsyncSessionDB"])
def test_a_store_cannot_be_pickled_and_says_what_to_pass_instead(tmp_path: Path, kind: str) -> None:
    """Pickling a store (a multiprocessing.Pool argument) raised a raw AttributeError
    ("Can't pickle local object") or TypeError; it now says to pass the path or URL."""
    path = tmp_path / "state.db"
    store: SessionDB | AsyncSessionDB = (
        SessionDB(path) if kind == "SessionDB" else AsyncSessionDB(path)
    )
    try:
        with pytest.raises(StoreMisuseError, match="pass its path or URL"):
            pickle.dumps(store)
    finally:
        if isinstance(store, SessionDB):
            store.close()
