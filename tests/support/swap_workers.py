"""Other processes around ``db optimize --vacuum --swap``: one holding the file open, one
swapping that is killed in the middle of its copy."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

#: A hang guard only: the parent sets the events or kills the process.
DEADLINE = 120.0


def hold_open(path: str, opened: Any, release: Any) -> None:
    """An agent: the store open (after a read, as any agent's is) until ``release``."""
    from hermes_store import SessionDB

    store = SessionDB(path)
    try:
        store.session_count()
        opened.set()
        release.wait(DEADLINE)
    finally:
        store.close()


def commit_and_vanish(path: str) -> None:
    """Commit one session and end without closing: the commit stays in the WAL, not yet
    checkpointed into the file (a closing last connection would checkpoint it)."""
    import os

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("INSERT INTO sessions (id, source, started_at) VALUES ('in-the-wal', 'cli', 0)")
    os._exit(0)


def swap_until_killed(path: str, point: str, reached: Any, never: Any) -> None:
    """Run the swap and stop at ``point``: ``"copying"`` (inside its ``VACUUM INTO``, once the
    copy has pages on disk), ``"before-rename"`` (the file taken alone and out of WAL mode,
    the copy ready) or ``"after-rename"`` (the copy renamed over the file, the old one still
    locked). ``reached`` is set there, then this process waits on ``never`` for its SIGKILL.
    Between the swap's first look and its copy, another process commits and vanishes, so the
    old file has a commit in its WAL only while the swap runs."""
    import multiprocessing
    import os

    from hermes_store.engine import files
    from hermes_store.ops import maintenance

    database = Path(os.path.realpath(path))
    connect = files.connect_sqlite

    def stop() -> None:
        reached.set()
        never.wait(DEADLINE)

    def copy_started() -> bool:
        copies = database.parent.glob(f".{database.name}.*.compact")
        return any(copy.stat().st_size > 0 for copy in copies)

    def watched(where: Path, **options: Any) -> sqlite3.Connection:
        if where != database or "timeout" in options:  # not the copy's connection
            return connect(where, **options)
        writer = multiprocessing.get_context("spawn").Process(
            target=commit_and_vanish, args=(path,)
        )
        writer.start()
        writer.join(DEADLINE)
        connection = connect(where, **options)
        if point == "copying":
            copying_now = [False]

            def trace(statement: str) -> None:
                copying_now[0] = copying_now[0] or statement.startswith("VACUUM INTO")

            def step() -> int:
                if copying_now[0] and copy_started():
                    stop()
                return 0

            # A small cache: VACUUM INTO spills its pages into the copy as it goes.
            connection.execute("PRAGMA cache_size=8")
            connection.set_trace_callback(trace)
            connection.set_progress_handler(step, 100)
        return connection

    files.connect_sqlite = watched  # type: ignore[assignment]
    rename = os.replace

    def renaming(source: Any, target: Any) -> None:
        if point == "before-rename":
            stop()
        rename(source, target)
        stop()

    os.replace = renaming  # type: ignore[assignment]
    maintenance.vacuum_swap(database)
