"""Processes for tests/ops/test_long_lived.py: a writer that records what it was told was
written, and a process that runs a retention policy by itself when told to start."""

from __future__ import annotations

from typing import Any

from hermes_store import SessionDB
from hermes_store.ops import retention


def append_acknowledged(path: str, session: str, ready: Any, stop: Any, pipe: Any) -> None:
    """Appends to ``session`` (created first) one message after another until ``stop`` is set,
    then sends (ids acknowledged, errors as text) down ``pipe``: an error is recorded and the
    writer goes on, as an agent would with its next turn."""
    store = SessionDB(path)
    acknowledged: list[int] = []
    errors: list[str] = []
    try:
        store.create_session(session, "gateway")
        ready.set()
        while not stop.is_set():
            try:
                acknowledged.append(
                    store.append_message(session, "user", f"turn {len(acknowledged)} kept")
                )
            except Exception as error:  # reported to the test, which fails on any
                errors.append(f"{type(error).__name__}: {error}")
    except Exception as error:  # the session itself could not be created
        errors.append(f"{type(error).__name__}: {error}")
    finally:
        ready.set()
        store.close()
        pipe.send((acknowledged, errors))


def retention_when_told(path: str, days: float, arrived: Any, start: Any, pipe: Any) -> None:
    """Opens the store, says it ``arrived``, waits for ``start``, then runs the policy by
    itself (:func:`retention.maybe_run`) and sends what it did: None when it did not run (the
    day was claimed), else (sessions, messages) deleted; an error as text."""
    store = SessionDB(path)
    try:
        arrived.set()
        start.wait(120)
        report = retention.maybe_run(store.uow, retention.Policy(days))
        pipe.send(None if report is None else (report.sessions, report.messages))
    except Exception as error:  # reported to the test
        pipe.send(f"{type(error).__name__}: {error}")
    finally:
        store.close()


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = 0
    for i in range(9):
        byte = data[at]
        at += 1
        if i == 8:
            return (value << 8) | byte, at
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            return value, at
    raise AssertionError("unreachable")


def index_levels(path: str, table: str = "messages_fts") -> list[tuple[int, list[int]]]:
    """An FTS5 index's levels as its structure record has them: (segments of the level still
    being merged into the next, [segment ids]), lowest level first."""
    import sqlite3

    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        block = connection.execute(f"SELECT block FROM {table}_data WHERE id = 10").fetchone()[0]
    finally:
        connection.close()
    at = 4  # the cookie
    second_format = block[at : at + 4] == b"\xff\x00\x00\x01"  # SQLite >= 3.44
    at += 4 if second_format else 0
    count, at = _varint(block, at)
    _, at = _varint(block, at)  # segments
    _, at = _varint(block, at)  # the write counter
    levels: list[tuple[int, list[int]]] = []
    for _ in range(count):
        merging, at = _varint(block, at)
        segments, at = _varint(block, at)
        ids: list[int] = []
        for _ in range(segments):
            segment, at = _varint(block, at)
            for _ in range(2 + (5 if second_format else 0)):  # first and last page, more
                _, at = _varint(block, at)
            ids.append(segment)
        levels.append((merging, ids))
    return levels
