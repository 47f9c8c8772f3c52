"""AsyncSessionDB beyond the contract: the API's shape, no I/O on construction, task-bound
transactions, cancellation (both outcomes, and 1,000 random ones), no deadlock with fewer
threads than transactions, and an event loop that keeps running while calls wait."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import AsyncSessionDB, InvalidInputError, SessionDB
from hermes_store.uow import retry
from hermes_store.uow.unit import RetryPolicy
from tests.support.backends import is_sqlite, url_string

#: Generous bound for waits that only end early when something is broken (a deadlock).
STUCK = 120.0


@pytest.fixture
def url(db_url: URL) -> str:
    return url_string(db_url)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- shape ----------------------------------------------------------------------------------


def test_every_public_method_is_a_coroutine_with_the_same_signature() -> None:
    for name, member in inspect.getmembers(SessionDB):
        if name.startswith("_") or not callable(member):
            continue
        mine = getattr(AsyncSessionDB, name)
        if name in ("sanitize_title",):  # pure text work, the same static method
            assert mine is SessionDB.sanitize_title or mine == SessionDB.sanitize_title
            continue
        if name == "transaction":
            continue  # an async context manager, checked by the tests below
        params = list(inspect.signature(member).parameters.values())
        own = list(inspect.signature(mine).parameters.values())
        if name == "from_url":
            assert [p.name for p in own] == [p.name for p in params]
            continue
        assert [(p.name, p.kind, p.default) for p in own] == [
            (p.name, p.kind, p.default) for p in params
        ], name
        if name.startswith("iter_"):
            assert inspect.isasyncgenfunction(mine), name
        else:
            assert inspect.iscoroutinefunction(mine), name


def _twins() -> list[str]:
    """The coroutines and streams derived from SessionDB's methods."""
    own = {"close", "from_url", "sanitize_title", "transaction"}
    return [
        name
        for name, member in inspect.getmembers(SessionDB)
        if not name.startswith("_") and callable(member) and name not in own
    ]


@pytest.mark.parametrize("name", _twins())
def test_each_twin_is_the_method_with_its_documentation(name: str) -> None:
    twin, method = getattr(AsyncSessionDB, name), getattr(SessionDB, name)
    assert twin.__qualname__ == f"AsyncSessionDB.{name}"
    assert twin.__doc__ == method.__doc__
    assert inspect.signature(twin).parameters == inspect.signature(method).parameters


def test_a_wrong_call_fails_when_it_is_made(tmp_path: Path) -> None:
    """As with a hand-written coroutine: before anything is awaited, nothing opened."""
    path = tmp_path / "state.db"
    db = AsyncSessionDB(path)
    with pytest.raises(TypeError, match="role"):
        db.append_message("s")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        db.get_messages("s", 10)  # type: ignore[misc]
    with pytest.raises(TypeError, match="modle"):
        db.create_session("s", "cli", modle="m")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="pag_size"):
        db.iter_messages("s", pag_size=10)  # type: ignore[call-arg]
    assert not path.exists()


def test_arguments_arrive_as_given(tmp_path: Path) -> None:
    """Positional, keyword, keyword-only and ``**options`` reach the sync method unchanged."""

    async def scenario() -> tuple[list[str | None], list[str | None], int, bool]:
        async with AsyncSessionDB(tmp_path / "state.db") as db:
            await db.create_session("s", "cli", system_prompt="p", model="m")
            first = await db.append_message("s", "user", "one")
            await db.append_message("s", role="assistant", content="two", token_count=3)
            later = [m["content"] for m in await db.get_messages("s", after_id=first)]
            streamed = [m["content"] async for m in db.iter_messages("s", page_size=1)]
            report = await db.backup(tmp_path / "copy.db", verify=True)
            session = await db.get_session("s")
            assert session is not None
            return later, streamed, session["message_count"], report.verified

    later, streamed, count, verified = run(scenario())
    assert later == ["two"] and streamed == ["one", "two"] and count == 2 and verified


def test_a_declaration_names_its_own_method() -> None:
    from hermes_store import aio

    with pytest.raises((TypeError, RuntimeError)) as caught:

        class Misnamed:
            get_sesion = aio._coroutine_of(SessionDB.get_session)

    error = caught.value if isinstance(caught.value, TypeError) else caught.value.__cause__
    assert "Misnamed.get_sesion is declared from SessionDB.get_session" in str(error)


#: An application using the async API; the marked lines are the only errors mypy may report.
ASYNC_APP = """\
from __future__ import annotations

from hermes_store import AsyncSessionDB
from hermes_store.rows import MessageRow


async def main() -> None:
    async with AsyncSessionDB("state.db") as db:
        await db.create_session("s", "cli", model="m")
        message_id: int = await db.append_message("s", "user", content="hi", token_count=2)
        rows: list[MessageRow] = await db.get_messages("s", limit=10, after_id=message_id)
        async for row in db.iter_messages("s", page_size=100):
            rows.append(row)
        await db.append_message("s", "user", contnt="typo")  # error: contnt
        title: int = await db.get_session_title("s")  # error: incompatible
        await db.iter_export(page_size=5)  # error: not awaitable
"""


@pytest.mark.slow
def test_type_checkers_see_the_methods_signatures(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is part of the test extra")
    app = tmp_path / "async_app.py"
    app.write_text(ASYNC_APP)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(app)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "MYPY_CACHE_DIR": str(tmp_path / "cache")},
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    expected = [
        number for number, line in enumerate(ASYNC_APP.splitlines(), 1) if "# error:" in line
    ]
    assert sorted({int(line.split(":")[1]) for line in errors}) == expected, done.stdout
    assert any('"contnt"' in line for line in errors), done.stdout


def test_constructing_does_no_io_and_bad_options_fail_first(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "state.db"
    db = AsyncSessionDB(path)
    assert not path.parent.exists()  # nothing opened yet
    with pytest.raises(InvalidInputError, match="max_threads"):
        AsyncSessionDB(path, max_threads=0)

    async def use() -> int:
        async with db:
            await db.create_session("s", "cli")
            return await db.session_count()

    assert run(use()) == 1
    assert path.exists()


# -- transactions ---------------------------------------------------------------------------


def test_transaction_is_bound_to_its_task(url: str) -> None:
    """Another task's write neither joins the block nor is lost when the block rolls back."""

    async def scenario() -> tuple[list[str | None], int]:
        async with AsyncSessionDB(url) as db:
            await db.create_session("s", "cli")
            other: asyncio.Task[int] | None = None
            with pytest.raises(RuntimeError):
                async with db.transaction():
                    await db.append_message("s", "user", "rolled back")
                    async with db.transaction():  # nested: joins
                        await db.append_message("s", "user", "also rolled back")
                    other = asyncio.create_task(db.append_message("s", "user", "other task"))
                    raise RuntimeError("boom")
            assert other is not None
            await other
            contents = [m["content"] for m in await db.get_messages("s")]
            return contents, (await db.get_session("s") or {}).get("message_count", -1)

    contents, count = run(scenario())
    assert contents == ["other task"] and count == 1


def test_tasks_each_in_a_block_of_their_own_all_commit(url: str) -> None:
    """Two tasks' blocks at once, on sessions of their own: on PostgreSQL the second was
    refused as a write that "could wait for itself forever" (every block's body runs on the
    loop's thread, whose calls await in SQLAlchemy's greenlet and never block the loop)."""

    async def block(db: AsyncSessionDB, session: str) -> str:
        async with db.transaction():
            await db.append_message(session, "user", "first")
            await asyncio.sleep(0)  # the other tasks' blocks open meanwhile
            await db.append_message(session, "user", "second")
        return "ok"

    async def scenario() -> tuple[list[object], list[int]]:
        async with AsyncSessionDB(url) as db:
            for session in ("tx-a", "tx-b", "tx-c"):
                await db.ensure_session(session, "cli")
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    *(block(db, s) for s in ("tx-a", "tx-b", "tx-c")), return_exceptions=True
                ),
                STUCK,
            )
            counts = [await db.message_count(s) for s in ("tx-a", "tx-b", "tx-c")]
            return outcomes, counts

    outcomes, counts = run(scenario())
    assert outcomes == ["ok", "ok", "ok"] and counts == [2, 2, 2], (outcomes, counts)


def test_a_block_awaiting_its_child_tasks_call_can_time_out(url: str) -> None:
    """A task started inside a block lands after it, so a block that awaits it cannot end:
    its call waits on the loop, where the block's timeout cancels it before it began. It
    waited for the block's writer (or its row locks) in a thread instead, where a
    cancellation waits for a started call to finish: ``wait_for`` never returned."""

    async def scenario() -> list[str | None]:
        async with AsyncSessionDB(url) as db:
            await db.create_session("s", "cli")
            with pytest.raises(TimeoutError):
                async with db.transaction():
                    await db.append_message("s", "user", "in the block")
                    child = asyncio.create_task(db.append_message("s", "user", "child"))
                    await asyncio.wait_for(child, 0.2)
            assert child.cancelled()
            return [m["content"] for m in await db.get_messages("s")]

    assert run(scenario()) == []


def test_a_child_tasks_block_cancelled_behind_its_parents_block(url: str) -> None:
    """The same for a child that opens a block of its own: cancelled while it waits for the
    parent's block, it never began."""

    async def scenario() -> list[str | None]:
        async with AsyncSessionDB(url) as db:
            await db.create_session("s", "cli")

            async def child() -> None:
                async with db.transaction():
                    await db.append_message("s", "user", "never")

            async with db.transaction():
                await db.append_message("s", "user", "parent")
                task = asyncio.create_task(child())
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(task, 0.2)
            return [m["content"] for m in await db.get_messages("s")]

    assert run(scenario()) == ["parent"]


def test_no_deadlock_with_fewer_threads_than_transactions(tmp_path: Path) -> None:
    """Two pool threads both wait for the writer while a transaction holds it: the block's
    next call runs on the block's own thread, so it ends and everyone lands."""
    path = tmp_path / "state.db"

    async def scenario() -> tuple[bool, int]:
        async with AsyncSessionDB(path, max_threads=2) as db:
            await db.create_session("s", "cli")
            uow = db.sync.uow
            queued: list[asyncio.Task[Any]] = []

            go = asyncio.Event()

            async def plain(n: int) -> None:
                await go.wait()
                await db.append_message("s", "user", f"plain{n}")

            async def transfer(n: int) -> None:
                await go.wait()
                async with db.transaction():
                    await db.append_message("s", "user", f"t{n}a")
                    await db.append_message("s", "user", f"t{n}b")

            # Tasks of their own, not the block's children (those wait on the loop for the
            # block to end): their calls take pool threads and wait there for the writer.
            queued = [asyncio.create_task(plain(n)) for n in range(4)]
            queued += [asyncio.create_task(transfer(n)) for n in range(4)]
            async with db.transaction():
                await db.append_message("s", "user", "first")
                go.set()
                # Both pool threads now wait for the writer this block holds.
                both = await asyncio.to_thread(uow.wait_for_waiting_writers, 2, STUCK)
                await db.append_message("s", "user", "second")
            await asyncio.wait_for(asyncio.gather(*queued), STUCK)
            return both, await db.message_count("s")

    both, count = run(scenario())
    assert both
    assert count == 2 + 4 + 8


# -- cancellation ---------------------------------------------------------------------------


def test_cancelled_before_it_started_never_runs(tmp_path: Path) -> None:
    path = tmp_path / "state.db"

    async def scenario() -> tuple[int, int]:
        async with AsyncSessionDB(path, max_threads=1) as db:
            await db.create_session("s", "cli")
            release = threading.Event()
            holding = asyncio.create_task(db.run_sync(lambda _db: release.wait(STUCK)))
            await asyncio.sleep(0)
            pending = asyncio.create_task(db.append_message("s", "user", "never"))
            await asyncio.sleep(0)  # queued behind the held thread
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            release.set()
            await holding
            return await db.message_count("s"), db.cancellations.not_started

    assert run(scenario()) == (0, 1)


def test_cancelled_after_it_started_lands_whole(url: str, db_url: URL) -> None:
    """The call waits for a lock another connection holds; cancelled there, it still lands
    (message and counters) once the lock is free, and then the task sees CancelledError."""

    async def scenario() -> tuple[int, int, int]:
        async with AsyncSessionDB(url) as db:
            await db.create_session("s", "cli")
            started = threading.Event()

            def append(sync_db: SessionDB) -> int:
                started.set()
                return sync_db.append_message("s", "user", "lands")

            with _lock_holder(db_url) as (locked, release):
                await asyncio.to_thread(locked.wait, STUCK)
                task = asyncio.create_task(db.run_sync(append))
                await asyncio.to_thread(started.wait, STUCK)
                if not is_sqlite(db_url):
                    await _until_waiting(db_url)  # on the server, mid round trip
                task.cancel()
                await asyncio.sleep(0)
                release.set()
                with pytest.raises(asyncio.CancelledError):
                    await task
            row = await db.get_session("s")
            assert row is not None
            return await db.message_count("s"), row["message_count"], db.cancellations.finished_ok

    assert run(scenario()) == (1, 1, 1)


@pytest.mark.slow
def test_a_thousand_random_cancellations(url: str, db_url: URL) -> None:
    """Writes and transaction blocks cancelled at random points: every acknowledged write is
    there, every block landed whole or not at all, the counters match the rows, and nothing
    is left open or locked."""
    rng = random.Random(7)

    async def scenario() -> dict[str, Any]:
        async with AsyncSessionDB(url) as db:
            await db.create_session("s", "cli")
            acked: set[str] = set()
            blocks_acked: set[str] = set()
            cancellations = 0

            async def single(key: str) -> None:
                await db.append_message("s", "user", key)
                acked.add(key)

            async def block(key: str) -> None:
                async with db.transaction():
                    await db.append_message("s", "user", f"{key}-a")
                    await db.update_token_counts("s", input_tokens=1)
                    await db.append_message("s", "assistant", f"{key}-b")
                blocks_acked.add(key)

            n = 0
            while cancellations < 1000:
                batch = []
                for _ in range(20):
                    n += 1
                    key = f"k{n}"
                    batch.append(asyncio.create_task(single(key) if n % 2 else block(key)))
                await asyncio.sleep(0)
                for task in batch:
                    for _ in range(rng.randrange(8)):
                        await asyncio.sleep(0)
                    if rng.random() < 0.6 and not task.done() and task.cancel():
                        cancellations += 1
                await asyncio.gather(*batch, return_exceptions=True)
            rows = await db.get_messages("s")
            return {
                "rows": [m["content"] for m in rows],
                "session": await db.get_session("s"),
                "acked": acked,
                "blocks_acked": blocks_acked,
                "stats": db.cancellations,
            }

    found = run(scenario())
    contents = set(found["rows"])
    assert len(contents) == len(found["rows"])  # nothing landed twice
    assert found["acked"] <= contents
    halves = {c.rsplit("-", 1)[0] for c in contents if "-" in c}
    for key in halves:  # a block landed whole or not at all
        assert {f"{key}-a", f"{key}-b"} <= contents
    assert found["blocks_acked"] <= halves
    session = found["session"]
    assert session["message_count"] == len(found["rows"])
    assert session["input_tokens"] == len(halves)
    stats = found["stats"]
    assert stats.finished > 0 and found["acked"] and found["blocks_acked"]
    _assert_nothing_open(db_url)


def _assert_nothing_open(db_url: URL) -> None:
    if is_sqlite(db_url):
        raw = sqlite3.connect(db_url.database or "", timeout=0)
        try:
            raw.execute("BEGIN IMMEDIATE")  # the write lock is free
            raw.rollback()
        finally:
            raw.close()
        return
    engine = sa.create_engine(db_url, poolclass=NullPool)
    with engine.connect() as conn:
        open_count = conn.scalar(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND state LIKE 'idle in transaction%'"
            )
        )
    engine.dispose()
    assert open_count == 0


# -- the loop keeps running -----------------------------------------------------------------


class _Ticker:
    """A 1 ms ticker on the loop; ``ticked`` (a thread-safe event) is set after a few ticks."""

    def __init__(self, ticks: int = 5) -> None:
        self.count = 0
        self.ticked = threading.Event()
        self.wanted = ticks

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            self.count += 1
            if self.count >= self.wanted:
                self.ticked.set()


@pytest.mark.parametrize("api", ["async", "sync"])
def test_the_loop_runs_while_a_write_waits_for_a_lock(url: str, db_url: URL, api: str) -> None:
    """A write waits for a lock held elsewhere until a ticker on the loop has ticked: through
    AsyncSessionDB the ticker ticks and frees it; the sync store called on the loop stalls
    it (no tick at all while it waits; the holder gives up on its own)."""

    async def scenario() -> tuple[bool, int]:
        ticker = _Ticker()
        with _lock_holder(db_url, release_on=ticker.ticked, patience=2.0) as (locked, _):
            await asyncio.to_thread(locked.wait, STUCK)
            ticking = asyncio.create_task(ticker.run())
            await asyncio.sleep(0)
            if api == "async":
                async with AsyncSessionDB(url) as db:
                    await db.append_message("s", "user", "waited")
                    count = await db.message_count("s")
            else:
                with SessionDB(url) as sync_db:
                    before = ticker.count
                    sync_db.append_message("s", "user", "waited")
                    stalled = ticker.count - before
                    count = sync_db.message_count("s")
                    assert stalled == 0
            ticking.cancel()
        return ticker.ticked.is_set(), count

    with SessionDB(url) as setup:
        setup.create_session("s", "cli")
    ticked, count = run(scenario())
    assert count == 1
    assert ticked or api == "sync"


def test_a_retry_pause_awaits_inside_the_greenlet(pg_url: URL) -> None:
    """PostgreSQL: the Unit of Work's pause between retries lets the loop run."""

    async def scenario() -> tuple[bool, bool]:
        async with AsyncSessionDB(url_string(pg_url)) as db:
            ran = asyncio.Event()

            async def other() -> None:
                ran.set()

            def pause(sync_db: SessionDB) -> bool:
                policy = RetryPolicy(attempts=2, min_wait=0.05, max_wait=0.05)
                retry.pause(policy, policy.waits(), None, sync_db.uow.counters)
                return ran.is_set()

            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(other()))
            during = await db.run_sync(pause)
            stats = await db.stats()
            return during, stats.retries == 1

    assert run(scenario()) == (True, True)


# -- helpers --------------------------------------------------------------------------------


class _lock_holder:
    """Another connection holds the lock the store's next write needs (SQLite: the write
    lock; PostgreSQL: the session row) until ``release`` is set, or ``release_on`` (a
    threading.Event) fires, or ``patience`` seconds pass."""

    def __init__(
        self, db_url: URL, *, release_on: threading.Event | None = None, patience: float = STUCK
    ) -> None:
        self.db_url = db_url
        self.locked = threading.Event()
        self.release = release_on or threading.Event()
        self.patience = patience
        self.thread = threading.Thread(target=self._hold, daemon=True)
        self.error: BaseException | None = None

    def _hold(self) -> None:
        try:
            if is_sqlite(self.db_url):
                raw = sqlite3.connect(self.db_url.database or "", isolation_level=None)
                raw.execute("BEGIN IMMEDIATE")
                self.locked.set()
                self.release.wait(self.patience)
                raw.execute("ROLLBACK")
                raw.close()
                return
            engine = sa.create_engine(self.db_url, poolclass=NullPool)
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1 FROM sessions WHERE id = 's' FOR UPDATE"))
                self.locked.set()
                self.release.wait(self.patience)
                conn.rollback()
            engine.dispose()
        except BaseException as error:
            self.error = error
            self.locked.set()

    def __enter__(self) -> tuple[threading.Event, threading.Event]:
        self.thread.start()
        return self.locked, self.release

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join()
        if self.error is not None:
            raise self.error


async def _until_waiting(db_url: URL) -> None:
    """Until a PostgreSQL backend waits for a row lock (a server state, polled)."""
    engine = sa.create_engine(db_url, poolclass=NullPool)
    try:
        for _ in range(int(STUCK / 0.01)):
            with engine.connect() as conn:
                blocked = conn.scalar(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND wait_event_type = 'Lock'"
                    )
                )
            if blocked:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the write never waited for the lock")
    finally:
        engine.dispose()
