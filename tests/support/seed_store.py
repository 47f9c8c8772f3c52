"""A compact re-implementation of the original store's ``SessionDB`` (``hermes_state.py``).

Test/bench baseline only, NOT part of ``hermes_store``: raw stdlib ``sqlite3``, used to
prove that files written by the package stay readable and writable by the original store,
and as the raw-sqlite3 baseline in benchmarks. It follows the original store's connection
settings, schema, writes, lifecycle, token counters, listing and migrations, and its
documented rules where its code is not at hand (append counters, token COALESCE rules,
title sanitising). ``end_session`` is the original unconditional UPDATE ("first end wins"
is a hermes_store refinement). ``search_messages`` keeps the original store's simple
behaviour: any FTS5 syntax error gives ``[]`` (CJK queries fall back to LIKE).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
SCHEMA_VERSION = 6
MAX_TITLE_LENGTH = 100

# v6 shape; the title index is created after the migrations (v1/v2 files have no title).
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, source TEXT NOT NULL, user_id TEXT, model TEXT, model_config TEXT,
    system_prompt TEXT, parent_session_id TEXT, started_at REAL NOT NULL, ended_at REAL,
    end_reason TEXT, message_count INTEGER DEFAULT 0, tool_call_count INTEGER DEFAULT 0,
    input_tokens INTEGER DEFAULT 0, output_tokens INTEGER DEFAULT 0,
    cache_read_tokens INTEGER DEFAULT 0, cache_write_tokens INTEGER DEFAULT 0,
    reasoning_tokens INTEGER DEFAULT 0, billing_provider TEXT, billing_base_url TEXT,
    billing_mode TEXT, estimated_cost_usd REAL, actual_cost_usd REAL, cost_status TEXT,
    cost_source TEXT, pricing_version TEXT, title TEXT,
    FOREIGN KEY (parent_session_id) REFERENCES sessions(id)
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL, content TEXT, tool_call_id TEXT, tool_calls TEXT, tool_name TEXT,
    timestamp REAL NOT NULL, token_count INTEGER, finish_reason TEXT, reasoning TEXT,
    reasoning_details TEXT, codex_reasoning_items TEXT
);
CREATE INDEX IF NOT EXISTS idx_sessions_source ON sessions(source);
CREATE INDEX IF NOT EXISTS idx_sessions_parent ON sessions(parent_session_id);
CREATE INDEX IF NOT EXISTS idx_sessions_started ON sessions(started_at DESC);
CREATE INDEX IF NOT EXISTS idx_messages_session ON messages(session_id, timestamp);
"""
FTS_SQL = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(
    content, content=messages, content_rowid=id
);
CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES('delete', old.id, old.content);
END;
CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
"""
TITLE_INDEX_SQL = (
    "CREATE UNIQUE INDEX IF NOT EXISTS idx_sessions_title_unique "
    "ON sessions(title) WHERE title IS NOT NULL"
)
V5_COLUMNS = (
    ("cache_read_tokens", "INTEGER DEFAULT 0"), ("cache_write_tokens", "INTEGER DEFAULT 0"),
    ("reasoning_tokens", "INTEGER DEFAULT 0"), ("billing_provider", "TEXT"),
    ("billing_base_url", "TEXT"), ("billing_mode", "TEXT"), ("estimated_cost_usd", "REAL"),
    ("actual_cost_usd", "REAL"), ("cost_status", "TEXT"), ("cost_source", "TEXT"),
    ("pricing_version", "TEXT"),
)  # fmt: skip
V6_COLUMNS = (("reasoning", "TEXT"), ("reasoning_details", "TEXT"),
              ("codex_reasoning_items", "TEXT"))  # fmt: skip
_TITLE_STRIP = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ufff9-\ufffc]"
)


class SeedSessionDB:
    """The original's ``SessionDB`` over one SQLite file (WAL, one connection, manual txns)."""

    _WRITE_MAX_RETRIES = 15
    _WRITE_RETRY_MIN_S = 0.020
    _WRITE_RETRY_MAX_S = 0.150
    _CHECKPOINT_EVERY_N_WRITES = 50

    def __init__(self, db_path: str | Path) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._write_count = 0
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            str(self.db_path), check_same_thread=False, timeout=1.0, isolation_level=None
        )
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._init_schema()

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.ProgrammingError("SeedSessionDB is closed")
        return self._conn

    # --- schema -------------------------------------------------------------------------

    def _init_schema(self) -> None:
        """Create the v6 tables if absent, then run the v2..v6 migrations (idempotent)."""
        cur = self.conn.cursor()
        cur.executescript(SCHEMA_SQL)
        row = cur.execute("SELECT version FROM schema_version LIMIT 1").fetchone()
        if row is None:
            cur.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        else:
            current = row["version"]
            steps: list[tuple[int, list[str]]] = [
                (2, ["ALTER TABLE messages ADD COLUMN finish_reason TEXT"]),
                (3, ["ALTER TABLE sessions ADD COLUMN title TEXT"]),
                (4, [TITLE_INDEX_SQL]),
                (5, [f'ALTER TABLE sessions ADD COLUMN "{c.replace(chr(34), chr(34) * 2)}" {t}'
                     for c, t in V5_COLUMNS]),
                (6, [f'ALTER TABLE messages ADD COLUMN "{c.replace(chr(34), chr(34) * 2)}" {t}'
                     for c, t in V6_COLUMNS]),
            ]  # fmt: skip
            for version, statements in steps:
                if current < version:
                    for sql in statements:
                        with contextlib.suppress(sqlite3.OperationalError):
                            cur.execute(sql)  # fails harmlessly when already there
                    cur.execute("UPDATE schema_version SET version = ?", (version,))
        with contextlib.suppress(sqlite3.OperationalError):
            cur.execute(TITLE_INDEX_SQL)
        cur.executescript(FTS_SQL)

    # --- writes -------------------------------------------------------------------------

    def _execute_write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """BEGIN IMMEDIATE + retry with random jitter on locked/busy; periodic checkpoint."""
        last_err: sqlite3.OperationalError | None = None
        for attempt in range(self._WRITE_MAX_RETRIES):
            try:
                with self._lock:
                    self.conn.execute("BEGIN IMMEDIATE")
                    try:
                        result = fn(self.conn)
                        self.conn.commit()
                    except BaseException:
                        self.conn.rollback()
                        raise
                self._write_count += 1
                if self._write_count % self._CHECKPOINT_EVERY_N_WRITES == 0:
                    self._try_wal_checkpoint()
                return result
            except sqlite3.OperationalError as exc:
                msg = str(exc).lower()
                if "locked" in msg or "busy" in msg:
                    last_err = exc
                    if attempt < self._WRITE_MAX_RETRIES - 1:
                        time.sleep(random.uniform(self._WRITE_RETRY_MIN_S, self._WRITE_RETRY_MAX_S))
                        continue
                raise
        raise last_err or sqlite3.OperationalError("database is locked")

    def _try_wal_checkpoint(self) -> None:
        with contextlib.suppress(sqlite3.Error), self._lock:  # best effort, never fatal
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def close(self) -> None:
        """Best-effort PASSIVE checkpoint, then close. Safe to call twice."""
        if self._conn is None:
            return
        self._try_wal_checkpoint()
        with self._lock:
            self._conn.close()
            self._conn = None

    # --- sessions -----------------------------------------------------------------------

    def create_session(self, session_id: str, source: str, model: str | None = None,
                       model_config: dict[str, Any] | None = None,
                       system_prompt: str | None = None, user_id: str | None = None,
                       parent_session_id: str | None = None) -> str:  # fmt: skip
        config = json.dumps(model_config) if model_config else None
        self._execute_write(lambda c: c.execute(
            "INSERT OR IGNORE INTO sessions (id, source, user_id, model, model_config,"
            " system_prompt, parent_session_id, started_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (session_id, source, user_id, model, config, system_prompt, parent_session_id,
             time.time())))  # fmt: skip
        return session_id

    def ensure_session(self, session_id: str, source: str = "unknown",
                       model: str | None = None) -> None:  # fmt: skip
        self._execute_write(lambda c: c.execute(
            "INSERT OR IGNORE INTO sessions (id, source, model, started_at) VALUES (?, ?, ?, ?)",
            (session_id, source, model, time.time())))  # fmt: skip

    def end_session(self, session_id: str, end_reason: str) -> None:
        self._execute_write(lambda c: c.execute(
            "UPDATE sessions SET ended_at = ?, end_reason = ? WHERE id = ?",
            (time.time(), end_reason, session_id)))  # fmt: skip

    def reopen_session(self, session_id: str) -> None:
        self._execute_write(lambda c: c.execute(
            "UPDATE sessions SET ended_at = NULL, end_reason = NULL WHERE id = ?",
            (session_id,)))  # fmt: skip

    def delete_session(self, session_id: str) -> bool:
        def _do(c: sqlite3.Connection) -> bool:
            if c.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                return False
            c.execute("UPDATE sessions SET parent_session_id = NULL WHERE parent_session_id = ?",
                      (session_id,))  # fmt: skip
            c.execute("DELETE FROM messages WHERE session_id = ?", (session_id,))
            c.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            return True

        return self._execute_write(_do)

    def get_session(self, session_id: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return dict(row) if row else None

    # --- titles -------------------------------------------------------------------------

    @staticmethod
    def sanitize_title(title: str | None) -> str | None:
        if not title:
            return None
        cleaned = re.sub(r"\s+", " ", _TITLE_STRIP.sub("", title)).strip()
        if not cleaned:
            return None
        if len(cleaned) > MAX_TITLE_LENGTH:
            raise ValueError(f"Title too long ({len(cleaned)} > {MAX_TITLE_LENGTH} chars)")
        return cleaned

    def set_session_title(self, session_id: str, title: str | None) -> bool:
        clean = self.sanitize_title(title)

        def _do(c: sqlite3.Connection) -> bool:
            if clean is not None:
                other = c.execute("SELECT id FROM sessions WHERE title = ? AND id != ?",
                                  (clean, session_id)).fetchone()  # fmt: skip
                if other:
                    raise ValueError(f"Title '{clean}' is already in use by session {other[0]}")
            cur = c.execute("UPDATE sessions SET title = ? WHERE id = ?", (clean, session_id))
            return cur.rowcount > 0

        return self._execute_write(_do)

    # --- tokens -------------------------------------------------------------------------

    def update_token_counts(self, session_id: str, input_tokens: int = 0,
                            output_tokens: int = 0, model: str | None = None,
                            cache_read_tokens: int = 0, cache_write_tokens: int = 0,
                            reasoning_tokens: int = 0, estimated_cost_usd: float | None = None,
                            actual_cost_usd: float | None = None, cost_status: str | None = None,
                            cost_source: str | None = None, pricing_version: str | None = None,
                            billing_provider: str | None = None,
                            billing_base_url: str | None = None, billing_mode: str | None = None,
                            absolute: bool = False) -> None:  # fmt: skip
        counters = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                    "reasoning_tokens")  # fmt: skip
        if absolute:
            sets = [f"{c} = ?" for c in counters]
            sets += ["estimated_cost_usd = COALESCE(?, 0)",
                     "actual_cost_usd = COALESCE(?, actual_cost_usd)"]  # fmt: skip
            cost_params: tuple[Any, ...] = (estimated_cost_usd, actual_cost_usd)
        else:
            sets = [f"{c} = {c} + ?" for c in counters]
            sets += ["estimated_cost_usd = COALESCE(estimated_cost_usd, 0) + COALESCE(?, 0)",
                     ("actual_cost_usd = CASE WHEN ? IS NULL THEN actual_cost_usd"
                      " ELSE COALESCE(actual_cost_usd, 0) + ? END")]  # fmt: skip
            cost_params = (estimated_cost_usd, actual_cost_usd, actual_cost_usd)
        sets += [f"{c} = COALESCE(?, {c})" for c in ("cost_status", "cost_source",
                                                      "pricing_version")]  # fmt: skip
        sets += [f"{c} = COALESCE({c}, ?)" for c in ("billing_provider", "billing_base_url",
                                                      "billing_mode", "model")]  # fmt: skip
        params = (input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
                  reasoning_tokens, *cost_params, cost_status, cost_source, pricing_version,
                  billing_provider, billing_base_url, billing_mode, model, session_id)  # fmt: skip
        sql = f"UPDATE sessions SET {', '.join(sets)} WHERE id = ?"
        self._execute_write(lambda c: c.execute(sql, params))

    # --- messages -----------------------------------------------------------------------

    def append_message(self, session_id: str, role: str, content: str | None = None,
                       tool_name: str | None = None, tool_calls: Any = None,
                       tool_call_id: str | None = None, token_count: int | None = None,
                       finish_reason: str | None = None, reasoning: str | None = None,
                       reasoning_details: Any = None,
                       codex_reasoning_items: Any = None) -> int:  # fmt: skip
        tool_calls_json = json.dumps(tool_calls) if tool_calls else None
        details_json = json.dumps(reasoning_details) if reasoning_details else None
        codex_json = json.dumps(codex_reasoning_items) if codex_reasoning_items else None
        n_calls = 0
        if tool_calls is not None:
            n_calls = len(tool_calls) if isinstance(tool_calls, list) else 1

        def _do(c: sqlite3.Connection) -> int:
            cur = c.execute(
                "INSERT INTO messages (session_id, role, content, tool_call_id, tool_calls,"
                " tool_name, timestamp, token_count, finish_reason, reasoning,"
                " reasoning_details, codex_reasoning_items)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (session_id, role, content, tool_call_id, tool_calls_json, tool_name,
                 time.time(), token_count, finish_reason, reasoning, details_json, codex_json),
            )  # fmt: skip
            c.execute("UPDATE sessions SET message_count = message_count + 1,"
                      " tool_call_count = tool_call_count + ? WHERE id = ?",
                      (n_calls, session_id))  # fmt: skip
            assert cur.lastrowid is not None
            return cur.lastrowid

        return self._execute_write(_do)

    def get_messages(self, session_id: str) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT * FROM messages WHERE session_id = ? ORDER BY timestamp, id", (session_id,)
        ).fetchall()
        out = []
        for row in rows:
            msg = dict(row)
            if msg.get("tool_calls"):
                try:
                    msg["tool_calls"] = json.loads(msg["tool_calls"])
                except (json.JSONDecodeError, TypeError):
                    msg["tool_calls"] = []
            out.append(msg)
        return out

    def message_count(self, session_id: str | None = None) -> int:
        if session_id is None:
            return int(self.conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0])
        sql = "SELECT COUNT(*) FROM messages WHERE session_id = ?"
        return int(self.conn.execute(sql, (session_id,)).fetchone()[0])

    def session_count(self, source: str | None = None) -> int:
        if source is None:
            return int(self.conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])
        sql = "SELECT COUNT(*) FROM sessions WHERE source = ?"
        return int(self.conn.execute(sql, (source,)).fetchone()[0])

    # --- search -------------------------------------------------------------------------

    @staticmethod
    def _contains_cjk(text: str) -> bool:
        ranges = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x3000, 0x303F),
                  (0x3040, 0x309F), (0x30A0, 0x30FF), (0xAC00, 0xD7AF))  # fmt: skip
        return any(lo <= ord(ch) <= hi for ch in text for lo, hi in ranges)

    def search_messages(self, query: str, source_filter: list[str] | None = None,
                        exclude_sources: list[str] | None = None,
                        role_filter: list[str] | None = None, limit: int = 20,
                        offset: int = 0) -> list[dict[str, Any]]:  # fmt: skip
        """FTS5 MATCH, best rank first; errors -> [] unless CJK (then LIKE fallback)."""
        if not query or not query.strip():
            return []
        where: list[str] = []
        params: list[Any] = []
        for values, op in ((source_filter, "IN"), (exclude_sources, "NOT IN")):
            if values is not None:
                where.append(f"s.source {op} ({', '.join('?' * len(values))})")
                params += values
        if role_filter:
            where.append(f"m.role IN ({', '.join('?' * len(role_filter))})")
            params += role_filter
        extra = "".join(f" AND {w}" for w in where)
        cols = ("m.id, m.session_id, m.role, {snip} AS snippet, m.timestamp, m.tool_name,"
                " s.source, s.model, s.started_at AS session_started")  # fmt: skip
        sql = (f"SELECT {cols.format(snip=SNIPPET)} FROM messages_fts"
               " JOIN messages m ON m.id = messages_fts.rowid"
               " JOIN sessions s ON s.id = m.session_id"
               f" WHERE messages_fts MATCH ?{extra} ORDER BY rank LIMIT ? OFFSET ?")  # fmt: skip
        cjk = self._contains_cjk(query)
        try:
            matches = [dict(r) for r in
                       self.conn.execute(sql, [query.strip(), *params, limit, offset])]  # fmt: skip
        except sqlite3.OperationalError:
            if not cjk:
                return []
            matches = []
        if not matches and cjk:
            raw = query.strip('"').strip()
            like_sql = (f"SELECT {cols.format(snip='m.content')} FROM messages m"
                        " JOIN sessions s ON s.id = m.session_id"
                        f" WHERE m.content LIKE ?{extra}"
                        " ORDER BY m.timestamp DESC LIMIT ? OFFSET ?")  # fmt: skip
            like_params = [f"%{raw}%", *params, limit, offset]
            matches = [dict(r) for r in self.conn.execute(like_sql, like_params)]
            for m in matches:  # ~120 characters centred on the match
                start = max(0, (m["snippet"] or "").find(raw) - 60 + len(raw) // 2)
                m["snippet"] = (m["snippet"] or "")[start : start + 120]
        for match in matches:
            match["context"] = self._context(match["session_id"], match["id"])
        return matches

    def _context(self, session_id: str, message_id: int) -> list[dict[str, Any]]:
        """Previous message, the match, next message, all of the same session."""
        me = self.conn.execute("SELECT id, timestamp, role, content FROM messages WHERE id = ?",
                               (message_id,)).fetchone()  # fmt: skip
        near = ("SELECT role, content FROM messages WHERE session_id = ? AND (timestamp, id) {op}"
                " (?, ?) ORDER BY timestamp {d}, id {d} LIMIT 1")  # fmt: skip
        args = (session_id, me["timestamp"], me["id"])
        prev = self.conn.execute(near.format(op="<", d="DESC"), args).fetchone()
        nxt = self.conn.execute(near.format(op=">", d="ASC"), args).fetchone()
        return [{"role": r["role"], "content": (r["content"] or "")[:200]}
                for r in (prev, me, nxt) if r is not None]  # fmt: skip

    # --- listing ------------------------------------------------------------------------

    def list_sessions_rich(self, source: str | None = None,
                           exclude_sources: list[str] | None = None, limit: int = 20,
                           offset: int = 0, include_children: bool = False,
                           ) -> list[dict[str, Any]]:  # fmt: skip
        """One query with correlated subqueries (no compression-tip projection)."""
        where: list[str] = []
        params: list[Any] = []
        if not include_children:
            where.append("s.parent_session_id IS NULL")
        if source:
            where.append("s.source = ?")
            params.append(source)
        if exclude_sources:
            where.append(f"s.source NOT IN ({', '.join('?' * len(exclude_sources))})")
            params += exclude_sources
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self.conn.execute(f"{LIST_RICH_SQL} {clause} ORDER BY s.started_at DESC"
                                 " LIMIT ? OFFSET ?", [*params, limit, offset])  # fmt: skip
        out = []
        for row in rows:
            item = dict(row)
            raw = (item.pop("_preview_raw") or "").strip()
            item["preview"] = raw[:60] + "..." if len(raw) > 60 else raw
            out.append(item)
        return out


SNIPPET = "snippet(messages_fts, 0, '>>>', '<<<', '...', 40)"
LIST_RICH_SQL = """
SELECT s.*,
    COALESCE(
        (SELECT SUBSTR(REPLACE(REPLACE(m.content, X'0A', ' '), X'0D', ' '), 1, 63)
         FROM messages m
         WHERE m.session_id = s.id AND m.role = 'user' AND m.content IS NOT NULL
         ORDER BY m.timestamp, m.id LIMIT 1),
        ''
    ) AS _preview_raw,
    COALESCE(
        (SELECT MAX(m2.timestamp) FROM messages m2 WHERE m2.session_id = s.id),
        s.started_at
    ) AS last_active
FROM sessions s"""
