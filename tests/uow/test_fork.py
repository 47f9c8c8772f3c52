"""Fork safety: a forked child either uses the database safely or is refused before it writes.

SQLite keeps its per-process lock records (and the shared-memory node) in memory; a forked
child inherits them without the locks, so a connection it opens on the same file takes no
real lock, and the parent's last close checkpoints and deletes the WAL the child writes into.
Before a fork the store now closes every idle connection on the file (reopened lazily), and
a child forked while one was in use is refused the file (``ForkedProcessError``). Second line
of defence: a writer that finds its WAL deleted raises ``WalDeletedError`` instead of
acknowledging the write.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hermes_store import ForkedProcessError, SessionDB, WalDeletedError
from tests.support import fork_workers
from tests.support.fork_workers import SESSION
from tests.support.readable import readable

TIMEOUT = 120  # deadlock guards only
ROUNDS = 20


@pytest.fixture
def template(tmp_path: Path) -> Path:
    path = tmp_path / "template.db"
    fork_workers.make_template(path)
    return path


def _check_round(result: dict[str, Any], round_no: int) -> None:
    assert result["errors"] == [], f"round {round_no}: {result['errors']}"
    stored = result["stored"]
    lost = [content for content in result["acked"] if content not in stored]
    assert lost == [], (
        f"round {round_no}: {len(lost)} of {len(result['acked'])} acknowledged writes lost"
    )
    assert sorted(stored) == sorted(result["acked"])
    assert result["problems"] == [], f"round {round_no}: {result['problems']}"


def _readable(fd: int) -> None:
    assert readable(fd, TIMEOUT), "a child never answered (deadlocked?)"


# -- the children's writes survive the parent's early close ------------------------------------


def _mp_fork_round(ctx: Any, path: Path, workers: int, before: int, after: int) -> dict[str, Any]:
    acked: list[str] = []
    errors: list[str] = []
    parent_closed = ctx.Event()
    processes = []
    with SessionDB(path) as db:
        fork_workers.append_acknowledged(db, "parent", 2, acked)
        db.get_messages(SESSION)  # the parent holds a read connection too
        for n in range(workers):
            started = ctx.Event()
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=fork_workers.mp_worker,
                args=(str(path), f"w{n}", before, after, started, parent_closed, send),
            )
            process.start()
            send.close()
            processes.append((process, started, receive))
        for _process, started, _receive in processes:
            assert started.wait(TIMEOUT), "a worker never started"
        fork_workers.append_acknowledged(db, "parent-late", 1, acked)
    parent_closed.set()  # the parent left its `with SessionDB(...)` block first
    for process, _started, receive in processes:
        assert receive.poll(TIMEOUT), "a worker never reported"
        status, child_acked, error = receive.recv()
        acked += child_acked
        if status != "ok":
            errors.append(error)
        process.join(TIMEOUT)
        if process.exitcode != 0:
            errors.append(f"worker exit code {process.exitcode}")
    return {
        "acked": acked,
        "stored": fork_workers.stored_contents(path),
        "problems": fork_workers.integrity(path),
        "errors": errors,
    }


@pytest.mark.slow
def test_multiprocessing_fork_workers_keep_every_write_when_the_parent_closes_first(
    tmp_path: Path, template: Path
) -> None:
    """The ordinary pattern: 3 workers (start method fork) open their own store on the
    parent's file and write while the parent leaves its ``with SessionDB(...)`` block.
    It used to lose most of their writes (the parent's close deleted the WAL they wrote into)."""
    ctx = multiprocessing.get_context("fork")
    for n in range(ROUNDS):
        path = tmp_path / f"mp{n}.db"
        fork_workers.fresh_copy(template, path)
        _check_round(_mp_fork_round(ctx, path, workers=3, before=3, after=4), n)


@pytest.mark.slow
def test_bare_fork_children_keep_every_write_when_the_parent_closes_first(
    tmp_path: Path, template: Path
) -> None:
    """The same with bare ``os.fork()``: two children per round."""
    for n in range(ROUNDS):
        path = tmp_path / f"bare{n}.db"
        fork_workers.fresh_copy(template, path)
        _check_round(fork_workers.fork_round(path, workers=2, before=3, after=4), n)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_daemons_that_fork_after_opening_keep_every_write(tmp_path: Path, method: str) -> None:
    """A daemon started with spawn or forkserver opens its store, then forks its workers
    (bare ``os.fork()``) and closes its store while they write, for 20 rounds."""
    ctx = multiprocessing.get_context(method)
    receive, send = ctx.Pipe(duplex=False)
    daemon = ctx.Process(
        target=fork_workers.daemon_rounds, args=(str(tmp_path), ROUNDS, 2, 3, 4, send)
    )
    daemon.start()
    send.close()
    assert receive.poll(TIMEOUT), "the daemon never reported"
    status, results = receive.recv()
    daemon.join(TIMEOUT)
    assert status == "ok", results
    assert daemon.exitcode == 0
    assert len(results) == ROUNDS
    for n, result in enumerate(results):
        _check_round(result, n)


def test_a_fork_closes_other_threads_idle_read_connections(tmp_path: Path, template: Path) -> None:
    """Another thread of the parent holds its read connection (idle) across the fork: it is
    closed before the fork, the thread reads again afterwards, and the child is safe."""
    path = tmp_path / "threads.db"
    fork_workers.fresh_copy(template, path)
    ctx = multiprocessing.get_context("fork")
    read_once, read_again, done = threading.Event(), threading.Event(), threading.Event()
    seen: list[int] = []

    def reader(db: SessionDB) -> None:
        seen.append(db.message_count(SESSION))
        read_once.set()
        read_again.wait(TIMEOUT)
        seen.append(db.message_count(SESSION))
        done.set()

    parent_closed = ctx.Event()
    db = SessionDB(path)
    thread = threading.Thread(target=reader, args=(db,))
    try:
        db.append_message(SESSION, "user", "parent")
        thread.start()
        assert read_once.wait(TIMEOUT)
        started = ctx.Event()
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=fork_workers.mp_worker,
            args=(str(path), "w", 2, 3, started, parent_closed, send),
        )
        process.start()
        send.close()
        assert started.wait(TIMEOUT)
        read_again.set()
        assert done.wait(TIMEOUT)
        thread.join(TIMEOUT)
        assert seen[0] == 1 and seen[1] >= 1
    finally:
        read_again.set()
        db.close()
    parent_closed.set()
    assert receive.poll(TIMEOUT)
    status, acked, error = receive.recv()
    process.join(TIMEOUT)
    assert status == "ok", error
    stored = fork_workers.stored_contents(path)
    assert [content for content in acked if content not in stored] == []
    assert fork_workers.integrity(path) == []


# -- a fork inside a unit -------------------------------------------------------------------


def _attempt(fn: Any) -> str:
    try:
        fn()
    except BaseException as error:
        return type(error).__name__
    return "ok"


def test_a_bare_fork_inside_a_transaction_leaves_the_parent_and_the_file_intact(
    tmp_path: Path, template: Path
) -> None:
    """The child of a fork inside ``with db.transaction():`` (after one write) leaves the
    block: it gets ForkedProcessError (not a raw ValueError), commits nothing and touches
    nothing; the parent's transaction commits and the file stays a valid database. It used
    to overwrite the database header (``file is not a database`` ever after)."""
    path = tmp_path / "unit.db"
    fork_workers.fresh_copy(template, path)
    db = SessionDB(path)
    out_r, out_w = os.pipe()
    pid = -1
    report: list[str] = []
    try:
        with db.transaction():
            db.append_message(SESSION, "user", "the parent's write in the unit")
            pid = os.fork()
            if pid == 0:
                os.close(out_r)
                report.append(_attempt(lambda: db.append_message(SESSION, "user", "child in")))
    except BaseException as error:
        if pid != 0:
            raise
        report.append(type(error).__name__)
    if pid == 0:
        try:
            report.append(_attempt(lambda: db.append_message(SESSION, "user", "child after")))
            report.append(_attempt(lambda: SessionDB(path).append_message(SESSION, "user", "x")))
            report.append(_attempt(db.close))
            fork_workers.send(out_w, repr(report).encode())
        finally:
            os._exit(0)
    os.close(out_w)
    try:
        _readable(out_r)
        child = fork_workers._literal(fork_workers.receive(out_r))
    finally:
        os.close(out_r)
        os.waitpid(pid, 0)
    # Inside the block, leaving it, after it, a new store: all refused; closing is quiet.
    assert child == [
        "ForkedProcessError",
        "ForkedProcessError",
        "ForkedProcessError",
        "ForkedProcessError",
        "ok",
    ]
    # The parent goes on: its transaction committed, its store works.
    db.append_message(SESSION, "user", "the parent after the fork")
    db.close()
    assert sorted(fork_workers.stored_contents(path)) == [
        "the parent after the fork",
        "the parent's write in the unit",
    ]
    assert fork_workers.integrity(path) == []
    with open(path, "rb") as raw:
        assert raw.read(16) == b"SQLite format 3\x00"


def test_a_multiprocessing_child_forked_inside_a_transaction_is_refused(
    tmp_path: Path, template: Path
) -> None:
    """A worker started (fork) inside the parent's ``transaction()`` block opens a store on
    the same file and writes: refused with ForkedProcessError before anything is written."""
    path = tmp_path / "unit-mp.db"
    fork_workers.fresh_copy(template, path)
    ctx = multiprocessing.get_context("fork")
    db = SessionDB(path)
    try:
        with db.transaction():
            db.append_message(SESSION, "user", "in the unit")
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(target=fork_workers.mp_write_once, args=(str(path), send))
            process.start()
            send.close()
            assert receive.poll(TIMEOUT)
            outcome = receive.recv()
            process.join(TIMEOUT)
        db.append_message(SESSION, "user", "after")
    finally:
        db.close()
    assert outcome.startswith("ForkedProcessError: this process was forked while")
    assert sorted(fork_workers.stored_contents(path)) == ["after", "in the unit"]
    assert fork_workers.integrity(path) == []


def test_a_child_forked_while_another_thread_is_inside_a_transaction_is_refused(
    tmp_path: Path, template: Path
) -> None:
    """Another thread's transaction outlasts the fork's bounded wait: its connection cannot
    be closed, so the child is refused the file; the thread's transaction commits."""
    path = tmp_path / "busy.db"
    fork_workers.fresh_copy(template, path)
    ctx = multiprocessing.get_context("fork")
    db = SessionDB(path)
    inside, leave = threading.Event(), threading.Event()

    def long_transaction() -> None:
        with db.transaction():
            db.append_message(SESSION, "user", "the thread's write")
            inside.set()
            leave.wait(TIMEOUT)

    thread = threading.Thread(target=long_transaction)
    thread.start()
    try:
        assert inside.wait(TIMEOUT)
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=fork_workers.mp_write_once, args=(str(path), send))
        process.start()  # waits FORK_WAIT_S for the thread's unit, then forks anyway
        send.close()
        assert receive.poll(TIMEOUT)
        outcome = receive.recv()
        process.join(TIMEOUT)
    finally:
        leave.set()
        thread.join(TIMEOUT)
    db.close()
    assert outcome.startswith("ForkedProcessError"), outcome
    assert fork_workers.stored_contents(path) == ["the thread's write"]
    assert fork_workers.integrity(path) == []


# -- second line of defence: a deleted WAL is reported, not acknowledged ----------------------


@pytest.fixture
def lost_wal_store(tmp_path: Path, template: Path) -> Iterator[tuple[SessionDB, Path]]:
    """A store that committed once, whose WAL is then deleted under it (what another process
    does when it believes itself the last user of the file)."""
    path = tmp_path / "lost.db"
    fork_workers.fresh_copy(template, path)
    db = SessionDB(path)
    db.uow.wal_check_every = 0.0  # every commit checks (by default, ten times a second)
    db.append_message(SESSION, "user", "before")
    os.unlink(f"{path}-wal")
    yield db, path
    db.close()


def test_a_writer_whose_wal_was_deleted_raises_instead_of_acknowledging(
    lost_wal_store: tuple[SessionDB, Path],
) -> None:
    db, _path = lost_wal_store
    with pytest.raises(WalDeletedError, match="was deleted while this process"):
        db.append_message(SESSION, "user", "lost")
    # And it stays refused: no later write is acknowledged either, on any path.
    with pytest.raises(WalDeletedError):
        db.append_message(SESSION, "user", "lost too")
    with pytest.raises(WalDeletedError), db.transaction():
        db.update_token_counts(SESSION, input_tokens=1)
    assert db.uow.checkpoint() is False


def test_a_checkpoint_after_the_wal_was_deleted_is_not_called_harmless(
    lost_wal_store: tuple[SessionDB, Path], caplog: pytest.LogCaptureFixture
) -> None:
    db, _path = lost_wal_store
    with caplog.at_level(logging.WARNING, logger="hermes_store.uow"):
        assert db.uow.checkpoint() is False
    messages = [record.getMessage() for record in caplog.records]
    assert any(record.levelno == logging.ERROR for record in caplog.records), messages
    assert not any("harmless" in message for message in messages), messages
    assert any("was deleted while this process" in message for message in messages)
    with pytest.raises(WalDeletedError):
        db.append_message(SESSION, "user", "after the checkpoint")


def test_a_lone_writers_checkpoint_after_the_wal_was_deleted_is_skipped(
    tmp_path: Path, template: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone writer checkpoints on its own connection right after its commit, between two
    of its WAL checks: that checkpoint too looks at the WAL first, and never copies a deleted
    one into the file."""
    path = tmp_path / "lost.db"
    fork_workers.fresh_copy(template, path)
    with SessionDB(path) as db:
        db.uow.wal_check_every = 3600.0  # the commits' own check sees nothing after the first
        db.uow.counters.checkpoint_every = 1  # every write is followed by a checkpoint
        db.append_message(SESSION, "user", "before")
        checkpoints = db.stats().checkpoints
        os.unlink(f"{path}-wal")
        with caplog.at_level(logging.WARNING, logger="hermes_store.uow"):
            db.append_message(SESSION, "user", "between two checks")
        messages = [record.getMessage() for record in caplog.records]
        assert any("WAL checkpoint skipped" in message for message in messages), messages
        assert db.stats().checkpoints == checkpoints
        with pytest.raises(WalDeletedError):
            db.append_message(SESSION, "user", "after")


def test_a_fork_refuses_nothing_when_the_store_is_idle(tmp_path: Path, template: Path) -> None:
    """Unit-sized check of the fork hook: an idle store closes its connections before the
    fork and goes on working in the parent (they reopen lazily)."""
    path = tmp_path / "idle.db"
    fork_workers.fresh_copy(template, path)
    with SessionDB(path) as db:
        db.append_message(SESSION, "user", "one")
        db.get_messages(SESSION)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if db.uow.backend.writer.refused is None else 1)
        _, status = os.waitpid(pid, 0)
        assert status == 0
        backend = db.uow.backend  # its connections were closed before the fork
        assert backend.writer.connection is None and not backend.readers.held
        db.append_message(SESSION, "user", "two")
        assert db.message_count(SESSION) == 2
    assert ForkedProcessError.__mro__[1].__name__ == "HermesStoreError"
