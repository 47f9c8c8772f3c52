"""Ctrl-C at every point of a write or read in the main thread, one point per run.

:class:`~tests.support.interrupt_points.InterruptAt` raises ``KeyboardInterrupt`` where
CPython would raise a real SIGINT's (a function's start, a C call's return, a loop's jump),
at the n-th such point of one call; the test walks n over all of them. After each interrupt:
the caller got the interrupt, SQLite's write lock is free (a foreign connection takes it at
once), the writer's in-process lock is free, no unit stays open for the thread to join, a
write from another thread and the next call of the main thread both land, and every write
the store acknowledged is on disk once. Before: an interrupt as the WAL checkpoint took the
writer's lock left it held (every writer of the process waited forever), one as BEGIN
returned left SQLite's lock held until the process wrote again, one as a turn's ``with``
ended left the turn held, and one as a unit was made current left later writes joining a
unit that had ended (acknowledged, never committed).
"""

from __future__ import annotations

import inspect
import sqlite3
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from hermes_store import SessionDB
from hermes_store.uow import writequeue
from tests.support.backends import sqlite_lock_is_free
from tests.support.interrupt_points import InterruptAt

pytestmark = [
    pytest.mark.slow,  # every point of a call, one run each: ~40 s in all
    pytest.mark.skipif(
        sys.version_info[:2] != (3, 11),
        reason="the interrupt points modelled are CPython 3.11's (the version it ships on)",
    ),
]

GUARD = 20.0  # a bound on waits that only a bug reaches
#: Points in the package and its context managers only: the queue's helper thread starts in
#: ``Thread.start()``, whose own Condition an interrupt breaks (CPython's, not the package's).
PACKAGE_ONLY = ("/hermes_store/", "/contextlib.py")


def _in_thread(call: Callable[[], Any], where: str | None) -> Any:
    """``call()`` in another thread, which must end within GUARD (a leaked lock: never)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:  # handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD)
    if thread.is_alive():
        stack = "".join(traceback.format_stack(sys._current_frames()[thread.ident or 0]))
        raise AssertionError(f"after {where}, another thread's call never ended:\n{stack}")
    assert not isinstance(outcome[0], BaseException), outcome[0]
    return outcome[0]


@contextmanager
def _finalizers_drop_what_they_raise() -> Iterator[None]:
    """An interrupt that lands in a finalizer (the garbage collector closing a generator) is
    dropped, as CPython's own hook drops it once printed: pytest's hook would keep it until
    the test ends, and its traceback's frames with it (a unit the interrupt left to the
    collector among them)."""
    kept = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    finally:
        sys.unraisablehook = kept


class Walk:
    """One store and the writes it acknowledged, checked on disk at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = SessionDB(path, checkpoint_every=1)
        self.db.create_session("s", "cli")
        self.db.append_message("s", "user", "a needle to find")
        self.acked: dict[int, str] = {}
        self.serial = 0

    def append(self) -> None:
        self.serial += 1
        content = f"m{self.serial}"
        self.acked[self.db.append_message("s", "user", content)] = content

    def every_point(self, call: Callable[[], object]) -> int:
        """Interrupt ``call`` at each of its points in turn; check the store after each.
        Returns how many points there were."""
        db = self.db
        writer = db.uow.backend.writer  # type: ignore[union-attr]
        n = 0
        while True:
            n += 1
            interrupted = False
            try:
                with _finalizers_drop_what_they_raise(), InterruptAt(n) as points:
                    call()
            except KeyboardInterrupt:
                interrupted = True
            if points.count < n:  # fewer points than n: the call ran to its end
                assert not interrupted
                return n - 1
            # Met and not raised: it landed in a finalizer (a generator closed by the garbage
            # collector), where CPython prints an interrupt and drops it, as with a real one.
            where = points.where
            assert sqlite_lock_is_free(self.path), f"SQLite's lock held after {where}"
            assert not writer.lock.locked(), f"the writer's lock held after {where}"
            assert writer.in_line == 0, f"a turn still counted after {where}"
            joined = db.uow._joinable()
            assert joined is None, f"a unit left open to join after {where}"
            _in_thread(self.append, where)
            self.append()

    def check_on_disk(self) -> None:
        self.db.close()
        conn = sqlite3.connect(self.path)
        try:
            rows = conn.execute("SELECT id, content FROM messages").fetchall()
        finally:
            conn.close()
        stored = dict(rows)
        missing = {i: c for i, c in self.acked.items() if stored.get(i) != c}
        assert not missing, f"acknowledged but not stored: {list(missing.items())[:5]}"
        contents = [c for _, c in rows]
        assert len(contents) == len(set(contents)), "a write stored twice"


@pytest.fixture
def walk(tmp_path: Path) -> Iterator[Walk]:
    walker = Walk(tmp_path / "state.db")
    yield walker
    walker.check_on_disk()


@pytest.fixture(params=["straight", "group", "alone"])
def write_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a lone write runs: straight in, in a group of its process, or alone in the line."""
    path = str(request.param)
    monkeypatch.setenv("HERMES_STORE_UNCONTENDED", "1" if path == "straight" else "0")
    monkeypatch.setenv("HERMES_STORE_GROUP_COMMIT", "0" if path == "alone" else "1")
    return path


def test_an_append_interrupted_anywhere(write_path: str, walk: Walk) -> None:
    assert walk.every_point(walk.append) > 20


def test_a_unit_interrupted_anywhere(write_path: str, walk: Walk) -> None:
    serial = iter(range(10**6))
    assert walk.every_point(lambda: walk.db.create_session(f"c{next(serial)}", "cli")) > 20


def test_a_transaction_block_interrupted_anywhere(walk: Walk) -> None:
    db = walk.db
    serial = iter(range(10**6))

    def block() -> None:
        with db.transaction():
            db.append_message("s", "assistant", f"block {next(serial)}")
            db.update_token_counts("s", input_tokens=1)

    assert walk.every_point(block) > 20


def test_a_search_interrupted_anywhere(walk: Walk) -> None:
    assert walk.every_point(lambda: walk.db.search_messages("needle")) > 20


def test_a_checkpoint_interrupted_anywhere(write_path: str, walk: Walk) -> None:
    assert walk.every_point(walk.db.uow.checkpoint) > 5


def test_a_place_in_the_fair_line_interrupted_anywhere(tmp_path: Path) -> None:
    """A turn that waits behind another process's (another open file description of the
    lock file) interrupted at each point: afterwards no byte of the lock file stays locked
    by it, and its descriptor holds no grant it did not wait for (before: an interrupt as
    the helper's grant arrived left the predecessor's byte locked and the grant unused, so
    the next turn of the process went ahead of the line at once)."""
    path = tmp_path / "state.db"
    sqlite3.connect(path).close()
    ahead = writequeue.WriteQueue(path, wait_timeout=GUARD)
    mine = writequeue.WriteQueue(path, wait_timeout=0.3)
    onlooker = writequeue.WriteQueue(path)
    n = 0
    while True:
        n += 1
        interrupted = False
        with ahead.turn() as first:
            assert first.queued
            place = mine.turn()
            try:
                with (
                    _finalizers_drop_what_they_raise(),
                    InterruptAt(n, PACKAGE_ONLY) as points,
                    place,
                ):
                    pass
            except KeyboardInterrupt:
                place.release()  # as the package's callers do
                interrupted = True
        if points.count < n:
            assert not interrupted
            break
        # A helper still waiting for the byte ahead when the interrupt came gets it once the
        # turn ahead ended, and drops it: wait for that (a bound only a bug reaches).
        deadline = time.monotonic() + GUARD
        while not onlooker.empty():
            assert time.monotonic() < deadline, f"a byte stayed locked after {points.where}"
            time.sleep(0.01)
        # Private state, looked at on purpose: a grant left unused would go unseen by any
        # call until it let a later turn skip its wait.
        for descriptor in mine._free + mine._parked:
            assert not descriptor.pending or descriptor in mine._parked
            if not descriptor.pending:
                assert descriptor._done.locked(), f"an unused grant after {points.where}"
    assert n > 10


#: Points in SQLAlchemy's Connection and Transaction too (``engine/base.py``): where its
#: rollback, commit and connect are cut short (its pool's own bookkeeping is left out).
THROUGH_SQLALCHEMY = (*PACKAGE_ONLY, "/sqlalchemy/engine/base.py")


class InterruptAtButResumes(InterruptAt):
    """:class:`InterruptAt` without the resumes of suspended generators: a block's end
    resumes them with ``throw()``, where CPython checks for a signal only inside their
    handlers, while a trace function raising there skips the handlers (a point no signal
    reaches)."""

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_flags & _GENERATOR and frame.f_lasti > 0:
            return self._local if self._is_watched(frame.f_code) else None
        return super()._trace(frame, event, arg)


_GENERATOR = inspect.CO_GENERATOR


def test_a_failed_blocks_rollback_interrupted_anywhere_in_sqlalchemy(walk: Walk) -> None:
    """A block that raised, then Ctrl-C at each point of its end, SQLAlchemy's rollback
    included: the caller gets the interrupt (never SQLAlchemy's AssertionError), SQLite's
    lock is free, and the writer works. Before: an interrupt in SQLAlchemy's rollback kept
    the lock in the idle process and broke the next block."""
    db, writer = walk.db, walk.db.uow.backend.writer  # type: ignore[attr-defined]
    n = 0
    while True:
        n += 1
        points = InterruptAtButResumes(n, THROUGH_SQLALCHEMY)
        raised: type[BaseException] | None = None
        try:
            with _finalizers_drop_what_they_raise():
                try:
                    with db.transaction():
                        db.append_message("s", "user", "rolled back")
                        points.__enter__()
                        raise ValueError("the block fails")
                finally:
                    points.__exit__()
        except BaseException as error:  # its kind handed to the test (the error let go of,
            raised = type(error)  # as a caller's except block does, with what it holds)
        if points.count < n:
            assert raised is ValueError, raised
            break
        assert raised in (KeyboardInterrupt, ValueError), (points.where, raised)
        assert sqlite_lock_is_free(walk.path), f"SQLite's lock held after {points.where}"
        assert not writer.lock.locked(), f"the writer's lock held after {points.where}"
        assert db.uow._joinable() is None, f"a unit left open to join after {points.where}"
        _in_thread(walk.append, points.where)
        walk.append()
    assert n > 20


def test_the_writers_connect_interrupted_anywhere_in_sqlalchemy(
    write_path: str, walk: Walk
) -> None:
    """Ctrl-C at each point of a write that opens the writer connection, SQLAlchemy's
    Connection included: the writer is left with a whole connection or none (before: the
    connection without its driver, and every later write raised a raw AttributeError)."""
    writer = walk.db.uow.backend.writer  # type: ignore[attr-defined]
    n = 0
    while True:
        n += 1
        writer.drop(invalidate=False)
        interrupted = False
        try:
            with _finalizers_drop_what_they_raise(), InterruptAt(n, THROUGH_SQLALCHEMY) as points:
                walk.append()
        except KeyboardInterrupt:
            interrupted = True
        if points.count < n:
            assert not interrupted
            break
        assert (writer.connection is None) == (writer.driver is None), points.where
        assert sqlite_lock_is_free(walk.path), f"SQLite's lock held after {points.where}"
        assert not writer.lock.locked(), f"the writer's lock held after {points.where}"
        _in_thread(walk.append, points.where)
        walk.append()
    assert n > 20
