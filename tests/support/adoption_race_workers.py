"""Processes of the original store that create a ``state.db`` while hermes_store opens the same
path (``tests/schema/test_adoption_races.py``). Spawned: each imports what it needs itself."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

#: The session and message the original store writes in the file it creates.
SEED_SESSION = "seed-made-this"
SEED_WORDS = "the original store created this file with an okapi"


def seed_creates(path: str, done: Any) -> None:
    """The original store opens ``path`` (creating its v6 file) and writes a session and a
    message, as its first run does; ``done`` is set once it has closed the file."""
    _seed_writes(path)
    done.set()


def _seed_writes(path: str) -> None:
    """The original store opens ``path`` (creating or finishing its file) and writes the
    session and message the tests look for."""
    from tests.support.seed_store import SeedSessionDB

    seed = SeedSessionDB(path)
    try:
        seed.create_session(SEED_SESSION, "cli")
        seed.append_message(SEED_SESSION, "user", SEED_WORDS)
    finally:
        seed.close()


def seed_creates_slowly(path: str, pause: float, started: Any) -> None:
    """The original store stopped for ``pause`` seconds in the middle of creating ``path``:
    its ``schema_version`` (no row yet) and ``sessions`` exist, ``messages`` does not (it
    creates its tables one statement at a time). ``started`` is set at that point; then it
    finishes, as its next statements do, and writes its session and message."""
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        raw.execute("PRAGMA journal_mode=WAL")
        raw.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        raw.execute(
            "CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, source TEXT NOT NULL, "
            "user_id TEXT, model TEXT, model_config TEXT, system_prompt TEXT, "
            "parent_session_id TEXT, started_at REAL NOT NULL, ended_at REAL, end_reason TEXT, "
            "message_count INTEGER DEFAULT 0, tool_call_count INTEGER DEFAULT 0, "
            "input_tokens INTEGER DEFAULT 0, output_tokens INTEGER DEFAULT 0, "
            "cache_read_tokens INTEGER DEFAULT 0, cache_write_tokens INTEGER DEFAULT 0, "
            "reasoning_tokens INTEGER DEFAULT 0, billing_provider TEXT, billing_base_url TEXT, "
            "billing_mode TEXT, estimated_cost_usd REAL, actual_cost_usd REAL, "
            "cost_status TEXT, cost_source TEXT, pricing_version TEXT, title TEXT, "
            "FOREIGN KEY (parent_session_id) REFERENCES sessions(id))"
        )
        started.set()
        time.sleep(pause)
    finally:
        raw.close()
    _seed_writes(path)


def seed_races(path: str, barrier: Any, delay: float) -> None:
    """Once every racer is ready, wait ``delay`` seconds and create ``path`` as the original
    store's first run does (:func:`seed_creates`)."""
    barrier.wait(timeout=120)
    time.sleep(delay)
    seed_creates(path, _Done())


class _Done:
    """An event nobody waits for."""

    def set(self) -> None:
        pass


def open_and_delete(path: str, barrier: Any, out: Any) -> None:
    """Once every racer is ready, hermes_store opens ``path`` (new, or created meanwhile by the
    original store) and runs the writes that need its own tables; ``out`` gets "" or the
    error."""
    from hermes_store import SessionDB

    barrier.wait(timeout=120)
    try:
        with SessionDB(path) as db:
            db.create_session("hermes-made-this", "cli")
            db.append_message("hermes-made-this", "user", "keyed", idempotency_key="k")
            db.delete_session("hermes-made-this")
        out.put("")
    except Exception as error:  # the report names whatever it was
        out.put(f"{type(error).__module__}.{type(error).__name__}: {error}")


def threads_open_a_new_path(path: str, threads: int, out: Any) -> None:
    """``threads`` threads of this process open ``path`` (no file there yet) at the same
    moment and write through their store; ``out`` gets each thread's error (``""``: none)."""
    import threading

    from hermes_store import SessionDB

    barrier = threading.Barrier(threads)
    errors: list[str] = []

    def open_and_write(n: int) -> None:
        try:
            barrier.wait()
            with SessionDB(path) as db:
                db.create_session(f"t{n}", "cli")
                db.append_message(f"t{n}", "user", f"thread {n}", idempotency_key=f"k{n}")
            errors.append("")
        except BaseException as error:  # reported to the test, which fails on it
            errors.append(f"thread {n}: {error!r}")

    pool = [threading.Thread(target=open_and_write, args=(n,)) for n in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    out.put(errors)
