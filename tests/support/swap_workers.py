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


def swap_until_killed(path: str, copying: Any, never: Any) -> None:
    """Run the swap and stop inside its ``VACUUM INTO`` once the copy has pages on disk:
    ``copying`` is set, then this process waits on ``never`` for its SIGKILL."""
    from hermes_store.engine import files
    from hermes_store.ops import maintenance

    database = Path(path)
    connect = files.connect_sqlite

    def copy_started() -> bool:
        copies = database.parent.glob(f".{database.name}.*.compact")
        return any(copy.stat().st_size > 0 for copy in copies)

    def watched(where: Path, **options: Any) -> sqlite3.Connection:
        connection = connect(where, **options)
        copying_now = [False]

        def trace(statement: str) -> None:
            if statement.startswith("VACUUM INTO"):
                copying_now[0] = True

        def step() -> int:
            if copying_now[0] and copy_started():
                copying.set()
                never.wait(DEADLINE)
            return 0

        # A small cache: VACUUM INTO spills its pages into the copy as it goes.
        connection.execute("PRAGMA cache_size=8")
        connection.set_trace_callback(trace)
        connection.set_progress_handler(step, 100)
        return connection

    files.connect_sqlite = watched  # type: ignore[assignment]
    maintenance.vacuum_swap(database)
