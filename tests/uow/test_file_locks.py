"""Acknowledged writes survive other openers: nothing here may drop SQLite's locks.

SQLite's POSIX locks belong to the process: one ``open()``/``close()`` of the database file by
any code in a process releases the locks of every live connection it has. Another process
that then opens and closes the file believes it is the last user, checkpoints and unlinks the
WAL; the first process goes on committing into the unlinked file and those writes vanish. A
process that opens several ``SessionDB`` instances on one file (a gateway does) used to do
exactly that while probing the file's header.

The processes are forked (cheap: hermes_store is already imported) and driven over pipes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from click.testing import CliRunner

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.engine.files import deleted_wal_holders
from hermes_store.schema import migrate

CTX = mp.get_context("fork")
#: The acceptance bar is 100 rounds (run with HERMES_STORE_LOCK_ROUNDS=100); CI runs fewer.
ROUNDS = int(os.environ.get("HERMES_STORE_LOCK_ROUNDS", "12"))
DEADLINE = 120.0  # only a guard against a hung child: every wait is on a pipe or a join


def _writer(path: str, instances: int, pipe: Connection) -> None:
    """Instance 1 writes; more instances open (each probes the file); then all append."""
    first = SessionDB(path)
    first.create_session("s", "gateway")
    acked = [first.append_message("s", "user", "before the other instances opened")]
    stores = [first] + [SessionDB(path) for _ in range(instances - 1)]
    pipe.send(acked)
    pipe.recv()  # the other processes have opened and closed the file
    try:
        for number, store in enumerate(stores):
            acked.append(store.append_message("s", "user", f"after, through instance {number}"))
            store.update_token_counts("s", input_tokens=1)
    except Exception as error:
        pipe.send(f"writing failed: {error!r}")
    else:
        pipe.send(acked)
    pipe.recv()  # never answered: this process is SIGKILLed


def _open_and_close(path: str, through_store: bool) -> None:
    """What any other process does: open the database, read, close it."""
    if through_store:
        with SessionDB(path) as store:
            store.message_count("s")
        return
    raw = sqlite3.connect(path)
    raw.execute("SELECT count(*) FROM messages").fetchone()
    raw.close()


def _visible(path: Path) -> tuple[set[int], int]:
    """Message ids and the token counter, as a process other than the writer sees them."""
    raw = sqlite3.connect(path)
    try:
        ids = {row[0] for row in raw.execute("SELECT id FROM messages")}
        tokens = raw.execute("SELECT input_tokens FROM sessions WHERE id = 's'").fetchone()[0]
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        raw.close()
    return ids, tokens


def _run(target: object, *args: object) -> None:
    process = CTX.Process(target=target, args=args)
    process.start()
    process.join(DEADLINE)
    assert process.exitcode == 0, f"{target} exited with {process.exitcode}"


@pytest.fixture
def spawned() -> Iterator[list[mp.process.BaseProcess]]:
    """Processes a test started; any still alive at the end are killed."""
    started: list[mp.process.BaseProcess] = []
    yield started
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(DEADLINE)


@pytest.mark.slow
def test_other_processes_opening_and_closing_lose_no_acknowledged_write(
    tmp_path: Path, spawned: list[mp.process.BaseProcess]
) -> None:
    rng = random.Random(16)
    for round_number in range(ROUNDS):
        path = tmp_path / f"round{round_number}.db"
        instances, openers = rng.randint(2, 6), rng.randint(1, 8)
        ours, theirs = CTX.Pipe()
        writer = CTX.Process(target=_writer, args=(str(path), instances, theirs))
        writer.start()
        theirs.close()  # the writer's end: if it dies, recv() here ends instead of waiting
        spawned.append(writer)
        assert ours.poll(DEADLINE), "the writer never opened its instances"
        ours.recv()
        for opener in range(openers):
            _run(_open_and_close, str(path), opener % 2 == 0)
        ours.send("append")
        assert ours.poll(DEADLINE), "the writer never acknowledged its appends"
        answer = ours.recv()
        where = f"round {round_number}: {instances} instances, {openers} other processes"
        assert isinstance(answer, list), f"{where}: {answer}"
        acked = set(answer)
        ids, tokens = _visible(path)
        assert acked <= ids, f"{where}: acknowledged {sorted(acked - ids)} are not visible"
        assert tokens == instances, where
        os.kill(writer.pid or 0, signal.SIGKILL)
        writer.join(DEADLINE)
        ids, tokens = _visible(path)
        assert acked <= ids, f"{where}: acknowledged {sorted(acked - ids)} lost after SIGKILL"
        assert tokens == instances, where


def _probing_writer(path: str, probers: int, rounds: int, pipe: Connection) -> None:
    """One instance appends while threads open, probe and close more instances."""
    store = SessionDB(path)
    store.create_session("s", "gateway")
    acked: list[int] = []
    stop = threading.Event()

    def append() -> None:
        while not stop.is_set():
            acked.append(store.append_message("s", "user", f"message {len(acked)}"))

    def probe() -> None:
        for _ in range(rounds):
            SessionDB(path).close()
            migrate.current(path)
            migrate.preflight_sqlite(Path(path))

    appender = threading.Thread(target=append)
    appender.start()
    threads = [threading.Thread(target=probe) for _ in range(probers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    appender.join()
    pipe.send(acked)
    pipe.recv()  # never answered: this process is SIGKILLed


@pytest.mark.slow
def test_threads_probing_while_an_instance_writes_lose_nothing(
    tmp_path: Path, spawned: list[mp.process.BaseProcess]
) -> None:
    path = tmp_path / "state.db"
    SessionDB(path).close()
    ours, theirs = CTX.Pipe()
    writer = CTX.Process(target=_probing_writer, args=(str(path), 4, 15, theirs))
    writer.start()
    theirs.close()
    spawned.append(writer)
    # Meanwhile another process keeps opening and closing the file, as a CLI or cron job would.
    deadline = time.monotonic() + DEADLINE  # a hang guard only: the loop ends on the pipe
    while not ours.poll(0):
        _open_and_close(str(path), through_store=False)
        assert time.monotonic() < deadline, "the probing writer never finished"
    acked = set(ours.recv())
    assert acked, "the writer acknowledged nothing"
    assert acked <= _visible(path)[0]
    os.kill(writer.pid or 0, signal.SIGKILL)
    writer.join(DEADLINE)
    assert acked <= _visible(path)[0]


def _lock_dropping_writer(path: str, pipe: Connection) -> None:
    """Reproduces the damage on purpose: a plain open()/close() drops this process's locks."""
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("INSERT INTO sessions (id, source, started_at) VALUES ('s', 'cli', 0)")
    open(path, "rb").close()  # the very thing the package must never do
    pipe.send("dropped")
    pipe.recv()  # another process opened and closed the file: the WAL is gone
    raw.execute("INSERT INTO sessions (id, source, started_at) VALUES ('t', 'cli', 0)")
    pipe.send("wrote")
    pipe.recv()


def test_doctor_names_a_process_writing_into_a_deleted_wal(
    tmp_path: Path, spawned: list[mp.process.BaseProcess]
) -> None:
    path = tmp_path / "state.db"
    SessionDB(path).close()
    ours, theirs = CTX.Pipe()
    writer = CTX.Process(target=_lock_dropping_writer, args=(str(path), theirs))
    writer.start()
    theirs.close()
    spawned.append(writer)
    assert ours.poll(DEADLINE)
    ours.recv()
    _run(_open_and_close, str(path), False)
    ours.send("write")
    assert ours.poll(DEADLINE)
    ours.recv()

    assert [pid for pid, _ in deleted_wal_holders(path)] == [writer.pid]
    result = CliRunner().invoke(cli, ["--db", str(path), "doctor", "--json"])
    assert result.exit_code == 1, result.output
    assert f'"pid {writer.pid}' in result.output or f"pid {writer.pid}" in result.output
    assert "deleted WAL" in result.output


def test_doctor_reports_no_deleted_wal_on_a_healthy_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        assert deleted_wal_holders(path) == []
        result = CliRunner().invoke(cli, ["--db", str(path), "doctor", "--json"])
    assert result.exit_code == 0, result.output
    assert "deleted WAL" not in result.output


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm"])
def test_export_never_replaces_the_database_or_its_sidecars(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        store.append_message("s", "user", "keep me")
        target = Path(f"{path}{suffix}")
        result = CliRunner().invoke(cli, ["--db", str(path), "export", "-o", str(target)])
        assert result.exit_code == 1, result.output
        assert "onto the database itself" in result.output
        assert store.get_messages("s")[0]["content"] == "keep me"
    assert _visible(path)[0] == {1}


def test_export_is_owner_only_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
    out = tmp_path / "out" / "all.jsonl"
    out.parent.mkdir()
    result = CliRunner().invoke(cli, ["--db", str(path), "export", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in out.parent.iterdir()] == ["all.jsonl"]


#: Every place in the package that opens, reads, writes or replaces a file by name, with why it
#: can never be the database, its -wal or its -shm. A new one must be added here, consciously.
FILE_ACCESS_ALLOWED = {
    ("transfer.py", "open"): "export: the descriptor of its own mkstemp file; import: the "
    "file to import, refused when it is the database or a sidecar",
    ("transfer.py", "os.replace"): "export: renames its temp file onto a target checked not to "
    "be the database or a sidecar, nor a device, FIFO, folder or socket",
    ("transfer.py", "os.open"): "export: writes into a character device or FIFO the target is "
    "(/dev/null, a pipe), O_NOFOLLOW, checked on the descriptor; the database is a regular file "
    "and never a target",
    ("factory.py", "os.open"): "create_private_file: O_CREAT|O_EXCL, fails rather than open an "
    "existing file",
    ("migrate.py", "os.link"): "links a complete new database into place; never replaces a path "
    "that exists (no descriptor either)",
    ("writequeue.py", "os.open"): "<db>-writer.lock, the queue's own lock file (0600), opened "
    "once per descriptor slot and held while a writer uses the file (tickets() and progress() read "
    "it on a short-lived read-only descriptor: its OFD locks survive the close); never the "
    "database",
    ("trajectory.py", "open"): "appends trajectories to the caller's JSONL file, through the "
    "descriptor below",
    ("trajectory.py", "os.open"): "the caller's JSONL file, O_APPEND|O_NOFOLLOW, refused unless "
    "a regular file of this user; the database is never a trajectory file",
    ("files.py", "read_bytes"): "/proc/<pid>/cmdline of a process holding a deleted WAL",
    ("backup.py", "os.link"): "links its own finished 0600 temp copy to the backup's name "
    "(checked not to be the database or a sidecar); fails rather than replace a file",
    ("backup.py", "os.open"): "a read-only descriptor on its own 0600 temp copy, only to flush "
    "it in small increments; closed after the copy's connection, never the database",
    ("backup.py", "os.replace"): "backup --force: renames its own finished temp copy onto a "
    "destination checked not to be the database, a sidecar, or a file with -wal/-shm beside it",
    ("app.py", "os.open"): "the CLI: os.devnull, standing in for a stdout whose reader left",
    ("app.py", "open"): "the CLI: a file object on its own os.devnull descriptor, standing in "
    "for a standard stream the caller closed (>&-); never a path",
    ("files.py", "read_text"): "/proc/locks, the kernel's list of locks: whom a writer waits for",
    ("maintenance.py", "os.open"): "vacuum_swap: a read-only descriptor on its own compacted "
    "copy (0600, not yet the database) to give it the database's mode and owner before any "
    "connection opens it; never the database",
    ("maintenance.py", "os.replace"): "vacuum_swap: renames its own checked copy onto the "
    "database while holding the database's exclusive lock (nobody else has it open) after the "
    "old file left WAL mode, so no -wal/-shm of it remains under the new file's names",
    ("files.py", "os.unlink"): "remove_dead_partials: removes the files builds beside the "
    "database left (.NAME.PID.HEX.new of a new database, .NAME.PID.HEX.import of an import "
    "into a new file, .NAME.PID.HEX.compact of a vacuum swap) once their process is gone, "
    "and the .NAME.PID.HEX.backup copies killed backups left, of any name in a backup's "
    "target folder (process gone and over an hour old); never the database, a link or a "
    "folder",
    ("files.py", "os.open"): "fsync_path: a read-only descriptor (O_NOFOLLOW) on a file this "
    "process built and no connection of it has open (a compacted copy, an import's built "
    "file), or on a folder (O_DIRECTORY) to flush a rename or link; never the database",
    ("transfer.py", "os.link"): "import_new_file: links its own finished file (.NAME.PID.HEX."
    "import) under the new database's name; never replaces a path that exists",
    ("retention.py", "os.open"): "<db>-retention, the retention policy's marker (0600, "
    "O_NOFOLLOW, refused unless a regular file); never the database",
    ("health.py", "shutil.rmtree"): "doctor --full: removes its own mkdtemp folder holding the "
    "snapshot copy it checked; never the database's folder",
}
_FILE_CALLS = {"open", "read_bytes", "read_text", "write_bytes", "write_text"}
_OS_CALLS = {"open", "replace", "rename", "link", "unlink", "remove", "truncate"}


def _file_accesses(source: Path) -> set[tuple[str, str]]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            found.add((source.name, "open"))
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else ""
            if owner == "shutil" or (owner == "os" and func.attr in _OS_CALLS):
                found.add((source.name, f"{owner}.{func.attr}"))
            elif owner != "os" and func.attr in _FILE_CALLS:
                found.add((source.name, func.attr))
    return found


def test_the_package_opens_no_file_outside_the_audited_places() -> None:
    package = Path(__file__).resolve().parents[2] / "hermes_store"
    found: set[tuple[str, str]] = set()
    for source in package.rglob("*.py"):
        found |= _file_accesses(source)
    assert found <= set(FILE_ACCESS_ALLOWED), sorted(found - set(FILE_ACCESS_ALLOWED))
