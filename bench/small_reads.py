"""CPU per call of the small reads, hermes_store against the original store
(``python -m bench.small_reads``; about 20 s).

Both stores read one file (a session of 40 messages among 200 sessions). Rounds interleave
the two stores so load from other processes hits both alike; the figure is the median over
rounds of ``time.process_time`` per call.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hermes_store import SessionDB
from tests.support.seed_store import SeedSessionDB

CALLS = 2000
ROUNDS = 7


def _build(path: Path) -> None:
    store = SessionDB(path)
    try:
        for s in range(200):
            store.create_session(f"s{s}", "cli", model="m")
            turns = [
                {"role": "user" if i % 2 else "assistant", "content": f"message {i} of {s}"}
                for i in range(40)
            ]
            store.append_messages(f"s{s}", turns)
            store.set_session_title(f"s{s}", f"title {s}")
    finally:
        store.close()


def _seed_title(seed: SeedSessionDB, session_id: str) -> str | None:
    """The original store has no such method: the query it would run, in its style."""
    row = seed.conn.execute("SELECT title FROM sessions WHERE id = ?", (session_id,)).fetchone()
    return row["title"] if row else None


def _cpu(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    for _ in range(CALLS):
        fn()
    return (time.process_time() - start) / CALLS


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.db"
        _build(path)
        ours, seed = SessionDB(path), SeedSessionDB(path)
        calls: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
            "get_session": (lambda: ours.get_session("s7"), lambda: seed.get_session("s7")),
            "get_messages": (lambda: ours.get_messages("s7"), lambda: seed.get_messages("s7")),
            "get_session_title": (
                lambda: ours.get_session_title("s7"),
                lambda: _seed_title(seed, "s7"),
            ),
            "message_count": (lambda: ours.message_count("s7"), lambda: seed.message_count("s7")),
        }
        try:
            for name, (mine, theirs) in calls.items():
                assert mine() == theirs() or name == "get_session", name
                ratios, mine_us, theirs_us = [], [], []
                for _ in range(ROUNDS):
                    a, b = _cpu(mine), _cpu(theirs)
                    ratios.append(a / b)
                    mine_us.append(a * 1e6)
                    theirs_us.append(b * 1e6)
                print(
                    f"{name:18} hermes_store {statistics.median(mine_us):7.1f} us  "
                    f"original {statistics.median(theirs_us):7.1f} us  "
                    f"ratio {statistics.median(ratios):.2f}",
                    file=sys.stdout,
                )
        finally:
            ours.close()
            seed.close()


if __name__ == "__main__":
    main()
