"""The SQLite hot writes' statements say NULL in the SQL for what the usual call leaves empty
(``repo.sqlite``: a token update with no cost or text, an append with only its text): the
rows they leave are the original store's, value and storage type alike, whichever statement
a call took."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hermes_store import SessionDB
from hermes_store.repo.sqlite import INSERT_COLUMNS
from hermes_store.repo.statements import COUNTERS, TOKEN_TEXTS
from tests.support.seed_store import SeedSessionDB

#: Every column the two writes touch: the counters, costs and texts of a session, and what
#: an INSERT of a message fills but its id and timestamp (the clock's).
_SESSION_COLUMNS = (
    "message_count",
    "tool_call_count",
    *COUNTERS,
    "estimated_cost_usd",
    "actual_cost_usd",
    *TOKEN_TEXTS,
)
_MESSAGE_COLUMNS = tuple(name for name in INSERT_COLUMNS if name not in ("id", "timestamp"))

#: Token updates: tokens only (the NULL statement) between priced ones, absolute ones too.
_TOKEN_CALLS: list[dict[str, Any]] = [
    {"input_tokens": 3},
    {"output_tokens": 2, "cache_read_tokens": -1},
    {"input_tokens": 1, "estimated_cost_usd": 0.5},
    {"reasoning_tokens": 4},
    {"actual_cost_usd": 0.25, "cost_status": "estimated", "model": "m1"},
    {"input_tokens": 5, "model": "m2", "billing_mode": "x"},
    {"input_tokens": 7, "absolute": True},
    {"output_tokens": 1},
    {"cache_write_tokens": 2, "absolute": True, "actual_cost_usd": 1.5},
    {"input_tokens": 1, "absolute": True},
    {},
]
#: Appends: text only (the NULL statement), no text, and each other column given alone.
_APPENDS: list[dict[str, Any]] = [
    {"role": "user", "content": "hello"},
    {"role": "assistant"},
    {"role": "assistant", "content": "x", "tool_calls": [{"id": "c1"}, {"id": "c2"}]},
    {"role": "tool", "content": "out", "tool_call_id": "c1", "tool_name": "t"},
    {"role": "assistant", "content": "y", "token_count": 12},
    {"role": "assistant", "content": "z", "finish_reason": "stop"},
    {"role": "assistant", "content": "r", "reasoning": "because"},
    {"role": "assistant", "content": "d", "reasoning_details": [{"k": 1}]},
    {"role": "assistant", "content": "c", "codex_reasoning_items": [{"i": 2}]},
    {"role": "user", "content": "\u4f60\u597d"},
]


def _rows(path: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Every compared column of the session and of its messages, each with its storage type."""
    typed = ", ".join(f"{c}, typeof({c})" for c in _SESSION_COLUMNS)
    typed_messages = ", ".join(f"{c}, typeof({c})" for c in _MESSAGE_COLUMNS)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        session = conn.execute(f"SELECT {typed} FROM sessions WHERE id = 's'").fetchall()
        messages = conn.execute(f"SELECT {typed_messages} FROM messages ORDER BY id").fetchall()
    return session, messages


def _play(store: Any, call: Callable[..., Any]) -> None:
    store.create_session("s", "cli")
    for kwargs in _TOKEN_CALLS:
        store.update_token_counts("s", **kwargs)
    for kwargs in _APPENDS:
        call(store, kwargs)


def test_the_usual_calls_leave_the_rows_the_original_store_leaves(tmp_path: Path) -> None:
    with SessionDB(tmp_path / "ours.db") as ours:
        _play(ours, lambda store, kwargs: store.append_message("s", **kwargs))
    seed = SeedSessionDB(tmp_path / "original.db")
    try:
        _play(seed, lambda store, kwargs: store.append_message("s", **kwargs))
    finally:
        seed.close()
    assert _rows(tmp_path / "ours.db") == _rows(tmp_path / "original.db")


def test_a_keyed_append_and_a_bulk_append_leave_the_same_rows(tmp_path: Path) -> None:
    """The keyed append takes the same two statements; the bulk append binds every column."""
    with SessionDB(tmp_path / "keyed.db") as keyed:
        _play(
            keyed,
            lambda store, kwargs: store.append_message(
                "s", **kwargs, idempotency_key=f"k{len(store.get_messages('s'))}"
            ),
        )
    with SessionDB(tmp_path / "bulk.db") as bulk:
        _play(bulk, lambda store, kwargs: store.append_messages("s", [kwargs]))
    with SessionDB(tmp_path / "plain.db") as plain:
        _play(plain, lambda store, kwargs: store.append_message("s", **kwargs))
    expected = _rows(tmp_path / "plain.db")
    assert _rows(tmp_path / "keyed.db") == expected
    assert _rows(tmp_path / "bulk.db") == expected
