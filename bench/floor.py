"""The floor: raw stdlib sqlite3 running exactly the original store's statements.

Same pragmas as the original store's connection: WAL, ``foreign_keys=ON``, ``synchronous`` left
at its default, ``timeout=1.0``, ``isolation_level=None`` with explicit ``BEGIN IMMEDIATE``, and
its PASSIVE checkpoint after every 50 writes. Search, listing and message loading use the
re-implementation of the original store in ``tests/support/seed_store.py`` (the same SQL).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.support.seed_store import LIST_RICH_SQL, SNIPPET, SeedSessionDB

INSERT_MESSAGE = (
    "INSERT INTO messages (session_id, role, content, tool_call_id, tool_calls, tool_name,"
    " timestamp, token_count, finish_reason, reasoning, reasoning_details, codex_reasoning_items)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
#: The original store's counter update after one message.
BUMP_COUNTERS = (
    "UPDATE sessions SET message_count = message_count + 1,"
    " tool_call_count = tool_call_count + ? WHERE id = ?"
)
#: The same for a batch (the original store has no bulk call; this is the obvious raw equivalent).
BUMP_COUNTERS_BY = (
    "UPDATE sessions SET message_count = message_count + ?,"
    " tool_call_count = tool_call_count + ? WHERE id = ?"
)
#: The original store's incremental ``update_token_counts`` (every counter and cost column).
ADD_TOKENS = (
    "UPDATE sessions SET input_tokens = input_tokens + ?, output_tokens = output_tokens + ?,"
    " cache_read_tokens = cache_read_tokens + ?, cache_write_tokens = cache_write_tokens + ?,"
    " reasoning_tokens = reasoning_tokens + ?,"
    " estimated_cost_usd = COALESCE(estimated_cost_usd, 0) + COALESCE(?, 0),"
    " actual_cost_usd = CASE WHEN ? IS NULL THEN actual_cost_usd"
    " ELSE COALESCE(actual_cost_usd, 0) + ? END,"
    " cost_status = COALESCE(?, cost_status), cost_source = COALESCE(?, cost_source),"
    " pricing_version = COALESCE(?, pricing_version),"
    " billing_provider = COALESCE(billing_provider, ?),"
    " billing_base_url = COALESCE(billing_base_url, ?),"
    " billing_mode = COALESCE(billing_mode, ?), model = COALESCE(model, ?) WHERE id = ?"
)
#: Its cost, status, pricing, billing and model parameters when only tokens are added.
NO_COSTS = (None,) * 10
BARE_SEARCH = (
    f"SELECT m.id, m.session_id, m.role, {SNIPPET} AS snippet, m.timestamp, m.tool_name,"
    " s.source, s.model, s.started_at AS session_started FROM messages_fts"
    " JOIN messages m ON m.id = messages_fts.rowid JOIN sessions s ON s.id = m.session_id"
    " WHERE messages_fts MATCH ? ORDER BY rank LIMIT ? OFFSET ?"
)
BARE_LIKE = (
    "SELECT m.id, m.session_id, m.role, m.content, m.timestamp, m.tool_name, s.source, s.model,"
    " s.started_at FROM messages m JOIN sessions s ON s.id = m.session_id"
    " WHERE m.content LIKE ? ORDER BY m.timestamp DESC LIMIT ? OFFSET ?"
)
CHECKPOINT_EVERY = 50


class Floor:
    """One raw sqlite3 connection doing what the original's ``SessionDB`` does, nothing more."""

    def __init__(self, path: str | Path) -> None:
        self.conn = sqlite3.connect(
            str(path), timeout=1.0, isolation_level=None, check_same_thread=False
        )
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.writes = 0

    def close(self) -> None:
        self.conn.close()

    def _wrote(self) -> None:
        self.writes += 1
        if self.writes % CHECKPOINT_EVERY == 0:
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def create_session(self, session_id: str, source: str) -> None:
        self.conn.execute(
            "INSERT OR IGNORE INTO sessions (id, source, started_at) VALUES (?, ?, ?)",
            (session_id, source, time.time()),
        )

    def append_message(
        self,
        session_id: str,
        role: str,
        content: str | None = None,
        tool_name: str | None = None,
        tool_calls: Any = None,
        tool_call_id: str | None = None,
        token_count: int | None = None,
    ) -> int:
        """The original store's append: JSON first, then BEGIN IMMEDIATE; INSERT; UPDATE; COMMIT."""
        calls_json = json.dumps(tool_calls) if tool_calls else None
        n_calls = (
            0 if tool_calls is None else (len(tool_calls) if isinstance(tool_calls, list) else 1)
        )
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            cursor = conn.execute(
                INSERT_MESSAGE,
                (
                    session_id,
                    role,
                    content,
                    tool_call_id,
                    calls_json,
                    tool_name,
                    time.time(),
                    token_count,
                    None,
                    None,
                    None,
                    None,
                ),
            )
            conn.execute(BUMP_COUNTERS, (n_calls, session_id))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._wrote()
        return int(cursor.lastrowid or 0)

    def update_token_counts(
        self, session_id: str, input_tokens: int = 0, output_tokens: int = 0
    ) -> None:
        """The original store's incremental token update: BEGIN IMMEDIATE; UPDATE; COMMIT."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                ADD_TOKENS,
                (input_tokens, output_tokens, 0, 0, 0, *NO_COSTS, session_id),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._wrote()

    def append_many(self, session_id: str, messages: Sequence[dict[str, Any]]) -> None:
        """A bulk import the raw way: one transaction, ``executemany`` of the original's INSERT."""
        now = time.time()
        rows = [
            (
                session_id,
                m["role"],
                m.get("content"),
                m.get("tool_call_id"),
                json.dumps(m["tool_calls"]) if m.get("tool_calls") else None,
                m.get("tool_name"),
                now,
                m.get("token_count"),
                m.get("finish_reason"),
                None,
                None,
                None,
            )
            for m in messages
        ]
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(INSERT_MESSAGE, rows)
            conn.execute(BUMP_COUNTERS_BY, (len(rows), 0, session_id))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._wrote()

    def search_bare(self, query: str, limit: int = 20) -> list[tuple[Any, ...]]:
        """Only the MATCH + snippet query (no context, no fallback): a lower bound."""
        try:
            return self.conn.execute(BARE_SEARCH, (query, limit, 0)).fetchall()
        except sqlite3.OperationalError:
            return []

    def like_bare(self, needle: str, limit: int = 20) -> list[tuple[Any, ...]]:
        return self.conn.execute(BARE_LIKE, (f"%{needle}%", limit, 0)).fetchall()

    def iter_export(self) -> Iterator[dict[str, Any]]:
        """The original store's export loop, streamed: each session row, then its messages."""
        sessions = self.conn.execute("SELECT * FROM sessions ORDER BY started_at DESC").fetchall()
        names = [d[0] for d in self.conn.execute("SELECT * FROM sessions LIMIT 0").description]
        for row in sessions:
            session = dict(zip(names, row, strict=True))
            cursor = self.conn.execute(
                "SELECT * FROM messages WHERE session_id = ? ORDER BY timestamp, id",
                (session["id"],),
            )
            columns = [d[0] for d in cursor.description]
            messages = [dict(zip(columns, r, strict=True)) for r in cursor]
            for message in messages:
                if message.get("tool_calls"):
                    try:
                        message["tool_calls"] = json.loads(message["tool_calls"])
                    except ValueError:
                        message["tool_calls"] = []
            yield {**session, "messages": messages}


__all__ = ["LIST_RICH_SQL", "Floor", "SeedSessionDB"]
