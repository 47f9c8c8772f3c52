"""Worker processes for the fork-safety tests (importable: ``forkserver`` and ``spawn``
children import this module, not the test module and its fixtures).

Each worker writes, tells its parent it has started, waits until the parent has closed its
own store (the early close that used to delete the WAL under it), writes again and reports
the contents of every write the store acknowledged. The parent then checks that each of
them is in the file.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import struct
import traceback
from pathlib import Path
from typing import Any

from hermes_store import SessionDB
from hermes_store.ops import backup

SESSION = "forked"


def make_template(path: Path) -> None:
    """A database at head with one session, checkpointed into the main file (copied per round
    instead of migrating a new file each time)."""
    db = SessionDB(path)
    try:
        db.create_session(SESSION, "cli")
    finally:
        db.close()
    raw = sqlite3.connect(path)
    try:
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        raw.close()


def fresh_copy(template: Path, path: Path) -> None:
    shutil.copyfile(template, path)


def append_acknowledged(db: SessionDB, tag: str, count: int, acked: list[str]) -> None:
    for i in range(count):
        content = f"{tag}-{i}"
        db.append_message(SESSION, "user", content)
        acked.append(content)  # only once the store said it was saved


def stored_contents(path: Path) -> list[str]:
    raw = sqlite3.connect(path)
    try:
        return [row[0] for row in raw.execute("SELECT content FROM messages")]
    finally:
        raw.close()


def integrity(path: Path) -> list[str]:
    """What the backup verification finds (integrity_check, foreign keys, the full-text
    indexes, the schema at head); none: []."""
    return backup.check_snapshot(path)


# -- multiprocessing workers (fork, forkserver, spawn) -------------------------------------


def mp_worker(
    path: str, tag: str, before: int, after: int, started: Any, parent_closed: Any, out: Any
) -> None:
    """Open a store of its own on the parent's file, write before and after the parent's close."""
    acked: list[str] = []
    try:
        db = SessionDB(path)
        try:
            append_acknowledged(db, f"{tag}-a", before, acked)
            started.set()
            if not parent_closed.wait(120):
                raise TimeoutError("the parent never closed its store")
            append_acknowledged(db, f"{tag}-b", after, acked)
        finally:
            db.close()
        out.send(("ok", acked, ""))
    except BaseException as error:
        started.set()
        out.send(("error", acked, f"{type(error).__name__}: {error}"))


def mp_write_once(path: str, out: Any) -> None:
    """Try one write through a new store and report the error's class name ('' if it worked)."""
    try:
        db = SessionDB(path)
        try:
            db.append_message(SESSION, "user", "from a child forked inside a unit")
        finally:
            db.close()
        out.send("")
    except BaseException as error:
        out.send(f"{type(error).__name__}: {error}")


# -- bare os.fork() ---------------------------------------------------------------------------


def send(fd: int, payload: bytes) -> None:
    os.write(fd, struct.pack("<I", len(payload)) + payload)


def receive(fd: int) -> bytes:
    head = _read_exactly(fd, 4)
    return _read_exactly(fd, struct.unpack("<I", head)[0])


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the other process closed the pipe")
        data += chunk
    return data


def forked_writer(
    path: str, tag: str, before: int, after: int, started: int, go: int, out: int
) -> None:
    """The body of a bare ``os.fork()`` child (never returns: ``os._exit``). ``started`` and
    ``out`` are pipe ends to write, ``go`` one to read (the parent closed its store)."""
    code = 0
    acked: list[str] = []
    try:
        db = SessionDB(path)
        try:
            append_acknowledged(db, f"{tag}-a", before, acked)
            os.write(started, b"s")
            if os.read(go, 1) != b"g":
                raise EOFError("the parent went away")
            append_acknowledged(db, f"{tag}-b", after, acked)
        finally:
            db.close()
        send(out, repr(("ok", acked, "")).encode())
    except BaseException as error:
        code = 1
        try:
            os.write(started, b"s")
            send(out, repr(("error", acked, f"{type(error).__name__}: {error}")).encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def fork_round(path: Path, workers: int, before: int, after: int) -> dict[str, Any]:
    """One round with bare forks: the parent opens its store and writes, forks ``workers``
    children that write, closes its store while they still run, lets them write again.
    Returns what was acknowledged, what the file holds and its integrity problems."""
    acked: list[str] = []
    errors: list[str] = []
    children: list[tuple[int, int]] = []
    started_r, started_w = os.pipe()
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    with SessionDB(path) as db:
        append_acknowledged(db, "parent", 2, acked)
        db.get_messages(SESSION)  # a held read connection too
        for n in range(workers):
            pid = os.fork()
            if pid == 0:
                os.close(started_r)
                os.close(go_w)
                os.close(out_r)
                forked_writer(str(path), f"w{n}", before, after, started_w, go_r, out_w)
            children.append((pid, n))
        for _ in range(workers):
            if os.read(started_r, 1) != b"s":
                errors.append("a child died before it started")
        append_acknowledged(db, "parent-late", 1, acked)
    # The parent's store is closed: only now may the children write again.
    os.write(go_w, b"g" * workers)
    for _ in range(workers):
        status, child_acked, error = _literal(receive(out_r))
        acked += child_acked
        if status != "ok":
            errors.append(error)
    for pid, _ in children:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            errors.append(f"child {pid} exited with status {status}")
    for fd in (started_r, started_w, go_r, go_w, out_r, out_w):
        os.close(fd)
    return {
        "acked": acked,
        "stored": stored_contents(path),
        "problems": integrity(path),
        "errors": errors,
    }


def _literal(raw: bytes) -> Any:
    import ast

    return ast.literal_eval(raw.decode())


def daemon_rounds(
    folder: str, rounds: int, workers: int, before: int, after: int, out: Any
) -> None:
    """A daemon started with ``spawn`` or ``forkserver``: it opens stores and forks workers
    after opening (bare ``os.fork()``), ``rounds`` times; reports every round's outcome."""
    try:
        base = Path(folder)
        template = base / "template.db"
        make_template(template)
        results = []
        for n in range(rounds):
            path = base / f"round{n}.db"
            fresh_copy(template, path)
            results.append(fork_round(path, workers, before, after))
        out.send(("ok", results))
    except BaseException:
        out.send(("error", traceback.format_exc()))
