"""Scratch stores for tests/schema/test_fts_damage.py: a bulk-built history and a writer process.

The history is inserted through raw ``sqlite3`` into a file the store created (its schema,
triggers and both full-text indexes), so a few seconds build what would take the store's
one-transaction-per-append API minutes. Text is realistic enough for FTS5: chat turns, long
tool outputs, and 5% CJK (which the trigram index also takes).
"""

from __future__ import annotations

import random
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from hermes_store import SessionDB

DAY = 86400.0


def _vocabulary(rng: random.Random) -> tuple[list[str], list[str]]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(20_000)]
    ideographs = [chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(3_000)]
    return words, ideographs


def _text(rng: random.Random, vocabulary: tuple[list[str], list[str]], words: int) -> str:
    latin, cjk = vocabulary
    if rng.random() < 0.05:
        return "".join(rng.choices(cjk, k=words))
    return " ".join(rng.choices(latin, k=words))


def build_history(
    path: Path, *, sessions: int, per_session: int, page_size: int | None = None, days: int = 365
) -> None:
    """``sessions`` ended sessions spread evenly over the last ``days``, each with
    ``per_session`` messages (every fifth a tool output of 300-1,500 words). ``page_size``
    sets FTS5's ``pgsz`` first: small leaves give a small file the leaf count (so the merge
    budget) of a large one."""
    SessionDB(path).close()
    rng = random.Random(20261205)
    vocabulary = _vocabulary(rng)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        if page_size is not None:
            conn.execute(
                "INSERT INTO messages_fts(messages_fts, rank) VALUES ('pgsz', ?)", (page_size,)
            )
        now = time.time()
        conn.execute("BEGIN")
        for number in range(sessions):
            started = now - days * DAY + days * DAY * number / sessions
            session = f"old-{number:06d}"
            conn.execute(
                "INSERT INTO sessions (id, source, started_at, ended_at, message_count)"
                " VALUES (?, 'cli', ?, ?, ?)",
                (session, started, started + 600, per_session),
            )
            rows = []
            for index in range(per_session):
                tool = index % 5 == 4
                size = rng.randint(300, 1_500) if tool else rng.randint(10, 60)
                role = "tool" if tool else ("user", "assistant")[index % 2]
                rows.append((session, role, _text(rng, vocabulary, size), started + index))
            conn.executemany(
                "INSERT INTO messages (session_id, role, content, timestamp) VALUES (?, ?, ?, ?)",
                rows,
            )
            if number % 100 == 99:
                conn.execute("COMMIT")
                conn.execute("BEGIN")
        conn.execute("COMMIT")
    finally:
        conn.close()


def append_until_stopped(path: str, ready: Any, stop: Any, pipe: Any) -> None:
    """A writer process: appends chat turns to a live session through SessionDB, one after
    the other, until ``stop`` is set, then sends (appends, error text or None) down ``pipe``.
    Faster than the issue's agent (one append per 50 ms), so a small file sees as many
    appends between the job's steps as the issue's 2 GB file did."""
    rng = random.Random(7)
    vocabulary = _vocabulary(rng)
    store = SessionDB(path)
    appended, failure = 0, None
    try:
        store.create_session("live-writer", "cli")
        ready.set()
        while not stop.is_set():
            store.append_message("live-writer", "user", _text(rng, vocabulary, 20))
            appended += 1
    except Exception as error:  # reported to the test
        failure = f"{type(error).__name__}: {error}"
    finally:
        ready.set()
        store.close()
        pipe.send((appended, failure))


def append_on_request(path: str, pipe: Any) -> None:
    """A writer process driven in lock-step: creates a live session, says "ready", then
    appends one message per request (any message but None) and answers with its id, or with
    the error's text (and stops)."""
    store = SessionDB(path)
    try:
        store.create_session("live-writer", "cli")
        pipe.send("ready")
        while (request := pipe.recv()) is not None:
            try:
                pipe.send(store.append_message("live-writer", "user", f"turn {request} mergeable"))
            except Exception as error:  # reported to the test
                pipe.send(f"{type(error).__name__}: {error}")
                return
    finally:
        store.close()


def damage_structure_record(path: Path) -> None:
    """The full-text index's structure record (row 10) as the issue found it: a level count
    of 2,001 (varint ``8F 51``), then zeros; FTS5 then refuses the table."""
    garbage = bytes(4) + bytes([0x8F, 0x51]) + bytes(40)
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("UPDATE messages_fts_data SET block = ? WHERE id = 10", (garbage,))
