"""Exports to import and an importer process to kill, for tests/services/test_transfer.py.

The export is small but has what the bulk path must get right: chat turns, tool outputs of a
few KB, Chinese text (the CJK index takes it), tool calls, titles, parents that come after
their children, costs with every digit.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import sqlite3
import threading
from contextlib import closing
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from hermes_store import SessionDB, transfer
from hermes_store.schema import ddl, fulltext

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


def triggers(path: Path) -> dict[str, str]:
    with closing(sqlite3.connect(path)) as conn:
        return dict(
            conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' ORDER BY name")
        )


def index_problems(path: Path) -> list[str]:
    """FTS5's integrity check of both indexes, and the CJK index against its condition."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        found = fulltext.index_damage(conn)
        misplaced = conn.execute(
            f"SELECT count(*) FROM messages m WHERE ({ddl.cjk_matches('m.content')}) IS NOT "
            f"EXISTS (SELECT 1 FROM {ddl.CJK_DOCSIZE} d WHERE d.id = m.id)"
        ).fetchone()[0]
        unindexed = conn.execute(
            "SELECT (SELECT count(*) FROM messages) - "
            f"(SELECT count(*) FROM {ddl.FTS_TABLE}_docsize)"
        ).fetchone()[0]
    if misplaced:
        found.append(f"{misplaced} messages misplaced in the CJK index")
    if unindexed:
        found.append(f"{unindexed} messages missing from the main index")
    return found


def write_export(path: Path, records: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def import_and_stall(db_path: str, export_path: str, batch_size: int, pipe: Any) -> None:
    """Import ``export_path`` batch by batch; in the second batch, once its messages are in and
    the index's triggers suspended (the moment it starts indexing them in bulk), say so down
    ``pipe`` and wait there for good: the test kills the process."""
    store = SessionDB(db_path)
    event.listen(store.engine, "before_cursor_execute", _stall_in_second_batch(pipe))
    with open(export_path, "rb") as handle:
        transfer.import_sessions(
            store, transfer.read_records(handle, lambda _: None), batch_size=batch_size
        )
    pipe.send("finished without stalling")


def import_new_file_and_stall(db_path: str, export_path: str, batch_size: int, pipe: Any) -> None:
    """:func:`import_and_stall` through ``import_new_file`` (the file built under a private
    name, by an engine of its own: every engine of the process is listened to)."""
    event.listen(Engine, "before_cursor_execute", _stall_in_second_batch(pipe))
    with open(export_path, "rb") as handle:
        transfer.import_new_file(
            db_path, transfer.read_records(handle, lambda _: None), batch_size=batch_size
        )
    pipe.send("finished without stalling")


def _stall_in_second_batch(pipe: Any) -> Any:
    """A ``before_cursor_execute`` listener that says so down ``pipe`` and waits for good as
    the second batch's messages are indexed."""
    indexing = 0

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal indexing
        if statement.startswith("INSERT INTO messages_fts(rowid, content)"):
            indexing += 1
            if indexing == 2:
                pipe.send("indexing the second batch")
                threading.Event().wait()

    return before


def kill_in_second_batch(worker: Any, path: Path, export: Path, batch_size: int) -> None:
    """Run ``worker`` (one of the two above) in a process of its own and kill it (SIGKILL) as
    it indexes its second batch."""
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    importer = context.Process(target=worker, args=(str(path), str(export), batch_size, child))
    importer.start()
    try:
        assert parent.poll(120), "the importer never reached its second batch"
        assert parent.recv() == "indexing the second batch"
        importer.kill()
    finally:
        importer.join(30)
    assert importer.exitcode == -9
