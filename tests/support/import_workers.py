"""Exports to import and an importer process to kill, for tests/services/test_transfer.py.

The export is small but has what the bulk path must get right: chat turns, tool outputs of a
few KB, Chinese text (the CJK index takes it), tool calls, titles, parents that come after
their children, costs with every digit.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import event

from hermes_store import SessionDB, transfer

CJK = ("数据库连接失败", "请帮我看看这个错误", "服务器重启之后", "部署到生产环境")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


def export_records(sessions: int, per_session: int, seed: int = 5) -> list[dict[str, Any]]:
    """Export records, newest session first (as ``export`` writes them); message ids 1..N."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    next_id = 1
    for number in range(sessions):
        sid = f"imported-{number:04d}"
        started = 1_760_000_000.0 + number * 100 + rng.random()
        messages = []
        for index in range(per_session):
            role = ("user", "assistant", "tool")[index % 3]
            if rng.random() < 0.1:
                content = "，".join(rng.sample(CJK, 2))
            elif role == "tool":
                content = "\n".join(
                    f"line {n} {' '.join(rng.choices(WORDS, k=8))}" for n in range(80)
                )
            else:
                content = " ".join(rng.choices(WORDS, k=12))
            content += f" marker{number}x{index}"
            messages.append(
                {
                    "id": next_id,
                    "session_id": sid,
                    "role": role,
                    "content": content,
                    "tool_call_id": f"call-{next_id}" if role == "tool" else None,
                    "tool_calls": [{"id": f"call-{next_id + 1}"}] if role == "assistant" else None,
                    "tool_name": "terminal" if role == "tool" else None,
                    "timestamp": started + index + rng.random() / 7,
                    "token_count": rng.randint(1, 500),
                    "finish_reason": None,
                    "reasoning": None,
                    "reasoning_details": None,
                    "codex_reasoning_items": None,
                }
            )
            next_id += 1
        records.append(
            {
                "id": sid,
                "source": "cli",
                "model": "m",
                "parent_session_id": f"imported-{number - 1:04d}" if number % 4 == 3 else None,
                "started_at": started,
                "ended_at": started + 50.5,
                "message_count": per_session,
                "input_tokens": rng.randint(0, 10**9),
                "estimated_cost_usd": rng.random() / 3,
                "title": f"title {number}" if number % 2 else None,
                "messages": messages,
            }
        )
    return list(reversed(records))


def write_export(path: Path, records: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def import_and_stall(db_path: str, export_path: str, batch_size: int, pipe: Any) -> None:
    """Import ``export_path`` batch by batch; in the second batch, once its messages are in and
    the index's triggers suspended (the moment it starts indexing them in bulk), say so down
    ``pipe`` and wait there for good: the test kills the process."""
    store = SessionDB(db_path)
    indexing = 0

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal indexing
        if statement.startswith("INSERT INTO messages_fts(rowid, content)"):
            indexing += 1
            if indexing == 2:
                pipe.send("indexing the second batch")
                threading.Event().wait()

    event.listen(store.engine, "before_cursor_execute", before)
    with open(export_path, "rb") as handle:
        transfer.import_sessions(
            store, transfer.read_records(handle, lambda _: None), batch_size=batch_size
        )
    pipe.send("finished without stalling")
