"""A retention job frozen in the middle of a chunk: which writers wait, and for how long.

The job is frozen by a test-only trigger that fires on its ``DELETE FROM sessions``, inside the
chunk's transaction (after it has locked the chunk's sessions and deleted their messages):
on PostgreSQL the trigger waits for an advisory lock the test holds, on SQLite it calls a
Python function that waits for an event. Nothing here sleeps to synchronise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB, UnknownSessionError
from hermes_store.ops import retention

DEADLINE = 120.0  # a hang guard only: every wait is on an event, a lock or a join
FREEZE_KEY = 4242


def _seed(store: SessionDB) -> None:
    """Two old ended sessions (one chunk each with ``chunk=1``, ``old-a`` first) and an
    active one the policy never selects."""
    for name in ("old-a", "old-b"):
        store.create_session(name, "cli")
        store.append_message(name, "user", f"{name} first message")
        store.end_session(name, "done")
    store.create_session("live", "cli")


class _Writer(threading.Thread):
    """Appends one message to ``session`` and keeps the outcome (an id or the error)."""

    def __init__(self, store: SessionDB, session: str) -> None:
        super().__init__(daemon=True)
        self.store, self.session = store, session
        self.outcome: int | BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.outcome = self.store.append_message(self.session, "user", "during the prune")
        except BaseException as error:  # kept for the assertions
            self.outcome = error
        finally:
            self.done.set()


class _Job(threading.Thread):
    def __init__(self, store: SessionDB, **options: Any) -> None:
        super().__init__(daemon=True)
        self.store, self.options = store, options
        self.report: retention.Report | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            # A generous step bound: each chunk is one session, however long it is frozen.
            self.report = retention.run(
                self.store.uow, retention.Policy(-1), chunk=1, step_seconds=10, **self.options
            )
        except BaseException as error:
            self.error = error


def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll a database-side condition (lock tables) with a hang guard."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


# -- PostgreSQL ---------------------------------------------------------------------------------


def _count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(sql), {"key": FREEZE_KEY}).scalar_one())


def test_postgresql_a_frozen_chunk_blocks_only_writers_to_its_own_sessions(pg_url: URL) -> None:
    watcher = sa.create_engine(pg_url, poolclass=NullPool)
    with watcher.begin() as conn:
        conn.exec_driver_sql(
            "CREATE FUNCTION test_freeze_chunk() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN PERFORM pg_advisory_xact_lock_shared({FREEZE_KEY}); RETURN OLD; END $$"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER test_freeze_chunk BEFORE DELETE ON sessions "
            "FOR EACH ROW EXECUTE FUNCTION test_freeze_chunk()"
        )
    url = pg_url.render_as_string(hide_password=False)
    job_store, writers = SessionDB(url), SessionDB(url)
    holder = watcher.connect()
    try:
        _seed(writers)
        holder.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": FREEZE_KEY})
        job = _Job(job_store)
        job.start()
        _until(
            lambda: (
                _count(
                    watcher,
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND objid = :key AND NOT granted",
                )
                == 1
            ),
            "the job is frozen inside its first chunk",
        )
        # Frozen mid-chunk: writers to sessions outside it commit at once.
        assert isinstance(writers.append_message("old-b", "user", "next chunk's"), int)
        assert isinstance(writers.append_message("live", "user", "never pruned"), int)
        # A writer to the chunk's own session waits for the chunk's row lock...
        inside = _Writer(writers, "old-a")
        inside.start()
        _until(
            lambda: (
                _count(
                    watcher,
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                    "WHERE NOT l.granted AND l.locktype <> 'advisory' "
                    "AND a.datname = current_database() AND :key > 0",
                )
                >= 1
            ),
            "the writer to the chunk's session waits for its row lock",
        )
        assert not inside.done.is_set()
        holder.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": FREEZE_KEY})
        holder.commit()
        # ... and once the chunk commits, finds its session gone.
        assert inside.done.wait(DEADLINE)
        assert isinstance(inside.outcome, UnknownSessionError), inside.outcome
        job.join(DEADLINE)
        assert not job.is_alive() and job.error is None, job.error
        assert job.report is not None
        assert (job.report.sessions, job.report.chunks) == (2, 2)
        # old-b's later message was deleted with it; the live session kept its own.
        assert job.report.messages == 3
        assert writers.get_session("old-a") is None and writers.get_session("old-b") is None
        assert writers.message_count("old-a") == 0
        assert [m["content"] for m in writers.get_messages("live")] == ["never pruned"]
    finally:
        holder.close()
        job_store.close()
        writers.close()
        watcher.dispose()


# -- SQLite -------------------------------------------------------------------------------------


class _Freezer:
    """The SQL function ``test_freeze()``: the n-th call waits until chunk n is released."""

    def __init__(self) -> None:
        self.entered = [threading.Event(), threading.Event()]
        self.release = [threading.Event(), threading.Event()]
        self.calls = 0

    def __call__(self) -> int:
        number = self.calls
        self.calls += 1
        if number < len(self.entered):
            self.entered[number].set()
            assert self.release[number].wait(DEADLINE)
        return 0


@contextmanager
def _freeze_function(freezer: _Freezer) -> Iterator[None]:
    """Every SQLite connection opened meanwhile knows ``test_freeze()``."""

    def register(dbapi_connection: Any, _record: object) -> None:
        dbapi_connection.create_function("test_freeze", 0, freezer)

    sa.event.listen(Engine, "connect", register)
    try:
        yield
    finally:
        sa.event.remove(Engine, "connect", register)


def test_sqlite_writers_wait_for_one_frozen_chunk_then_get_in_before_the_next(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    freezer = _Freezer()
    with _freeze_function(freezer):
        job_store, writers = SessionDB(path), SessionDB(path)
        try:
            _seed(writers)
            with job_store.engine.begin() as conn:
                conn.exec_driver_sql(
                    "CREATE TRIGGER test_freeze_chunk BEFORE DELETE ON sessions "
                    "BEGIN SELECT test_freeze(); END"
                )
            job = _Job(job_store)
            job.start()
            assert freezer.entered[0].wait(DEADLINE)  # frozen in chunk 1, holding the lock
            # SQLite has one write lock: every writer waits for the chunk, the live
            # session's as much as the chunk's own.
            outside, inside = _Writer(writers, "live"), _Writer(writers, "old-a")
            outside.start()
            inside.start()
            assert not outside.done.is_set() and not inside.done.is_set()
            freezer.release[0].set()
            # The job's next chunk freezes holding the lock again: both writers must be done
            # by then, having waited for one chunk only.
            assert freezer.entered[1].wait(DEADLINE)
            assert outside.done.wait(DEADLINE) and inside.done.wait(DEADLINE)
            assert isinstance(outside.outcome, int), outside.outcome
            assert isinstance(inside.outcome, UnknownSessionError), inside.outcome
            freezer.release[1].set()
            job.join(DEADLINE)
            assert not job.is_alive() and job.error is None, job.error
            assert job.report is not None
            assert (job.report.sessions, job.report.chunks, job.report.messages) == (2, 2, 2)
            assert [m["content"] for m in writers.get_messages("live")] == ["during the prune"]
            assert writers.message_count("old-a") == 0
        finally:
            for event in freezer.release:
                event.set()  # never leave the job frozen behind a failed assertion
            job_store.close()
            writers.close()
