"""Build SQLite files exactly as the original store's ``SessionDB`` left them, v1..v6.

Test support only, stdlib ``sqlite3`` only. The original store's schema history:

* v1: base ``sessions`` (with input/output tokens, no title, no billing) and ``messages``
* v2: ``messages.finish_reason``
* v3: ``sessions.title``
* v4: ``idx_sessions_title_unique ON sessions(title) WHERE title IS NOT NULL``
* v5: eleven token/billing columns on ``sessions``
* v6: ``messages.reasoning``, ``reasoning_details``, ``codex_reasoning_items``

Files are built the way they really evolved: v1 tables, then each ``ALTER TABLE ... ADD
COLUMN`` in order, so the physical column order is that of an upgraded file (not the order
of the v6 ``CREATE TABLE``). FTS5 and the four base indexes exist at every version.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

HEAD_VERSION = 6

# (column, declaration) of the v1 tables, in the original store's order.
V1_SESSIONS: tuple[tuple[str, str], ...] = (
    ("id", "TEXT PRIMARY KEY"),
    ("source", "TEXT NOT NULL"),
    ("user_id", "TEXT"),
    ("model", "TEXT"),
    ("model_config", "TEXT"),
    ("system_prompt", "TEXT"),
    ("parent_session_id", "TEXT"),
    ("started_at", "REAL NOT NULL"),
    ("ended_at", "REAL"),
    ("end_reason", "TEXT"),
    ("message_count", "INTEGER DEFAULT 0"),
    ("tool_call_count", "INTEGER DEFAULT 0"),
    ("input_tokens", "INTEGER DEFAULT 0"),
    ("output_tokens", "INTEGER DEFAULT 0"),
)
V1_MESSAGES: tuple[tuple[str, str], ...] = (
    ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"),
    ("session_id", "TEXT NOT NULL REFERENCES sessions(id)"),
    ("role", "TEXT NOT NULL"),
    ("content", "TEXT"),
    ("tool_call_id", "TEXT"),
    ("tool_calls", "TEXT"),
    ("tool_name", "TEXT"),
    ("timestamp", "REAL NOT NULL"),
    ("token_count", "INTEGER"),
)

# version -> ALTER TABLE statements that version ran, as (table, column, type, quoted).
# The original store quoted the column names in its v5 and v6 loops (``ADD COLUMN "{safe}"``).
VERSION_ALTERS: dict[int, tuple[tuple[str, str, str, bool], ...]] = {
    2: (("messages", "finish_reason", "TEXT", False),),
    3: (("sessions", "title", "TEXT", False),),
    4: (),
    5: tuple(
        ("sessions", name, decl, True)
        for name, decl in (
            ("cache_read_tokens", "INTEGER DEFAULT 0"),
            ("cache_write_tokens", "INTEGER DEFAULT 0"),
            ("reasoning_tokens", "INTEGER DEFAULT 0"),
            ("billing_provider", "TEXT"),
            ("billing_base_url", "TEXT"),
            ("billing_mode", "TEXT"),
            ("estimated_cost_usd", "REAL"),
            ("actual_cost_usd", "REAL"),
            ("cost_status", "TEXT"),
            ("cost_source", "TEXT"),
            ("pricing_version", "TEXT"),
        )
    ),
    6: tuple(
        ("messages", name, "TEXT", True)
        for name in ("reasoning", "reasoning_details", "codex_reasoning_items")
    ),
}

BASE_INDEXES = """
CREATE INDEX IF NOT EXISTS idx_sessions_source ON sessions(source);
CREATE INDEX IF NOT EXISTS idx_sessions_parent ON sessions(parent_session_id);
CREATE INDEX IF NOT EXISTS idx_sessions_started ON sessions(started_at DESC);
CREATE INDEX IF NOT EXISTS idx_messages_session ON messages(session_id, timestamp);
"""
TITLE_INDEX = (
    "CREATE UNIQUE INDEX IF NOT EXISTS idx_sessions_title_unique "
    "ON sessions(title) WHERE title IS NOT NULL"
)
# The original store's indexes and FTS objects.
FTS_DDL = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(
    content,
    content=messages,
    content_rowid=id
);

CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;

CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content)
        VALUES('delete', old.id, old.content);
END;

CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content)
        VALUES('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
"""

# The original store's v6 schema, in the v6 CREATE TABLE column order.
SEED_V6_DDL = (
    """
CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    user_id TEXT,
    model TEXT,
    model_config TEXT,
    system_prompt TEXT,
    parent_session_id TEXT,
    started_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT,
    message_count INTEGER DEFAULT 0,
    tool_call_count INTEGER DEFAULT 0,
    input_tokens INTEGER DEFAULT 0,
    output_tokens INTEGER DEFAULT 0,
    cache_read_tokens INTEGER DEFAULT 0,
    cache_write_tokens INTEGER DEFAULT 0,
    reasoning_tokens INTEGER DEFAULT 0,
    billing_provider TEXT,
    billing_base_url TEXT,
    billing_mode TEXT,
    estimated_cost_usd REAL,
    actual_cost_usd REAL,
    cost_status TEXT,
    cost_source TEXT,
    pricing_version TEXT,
    title TEXT,
    FOREIGN KEY (parent_session_id) REFERENCES sessions(id)
);

CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL,
    content TEXT,
    tool_call_id TEXT,
    tool_calls TEXT,
    tool_name TEXT,
    timestamp REAL NOT NULL,
    token_count INTEGER,
    finish_reason TEXT,
    reasoning TEXT,
    reasoning_details TEXT,
    codex_reasoning_items TEXT
);
"""
    + BASE_INDEXES
    + TITLE_INDEX
    + ";\n"
    + FTS_DDL
)


def _versions_applied(version: int, extra_later_columns: bool) -> list[int]:
    """The versions whose ALTERs a file of ``version`` carries (2..version, plus extras)."""
    if not 1 <= version <= HEAD_VERSION:
        raise ValueError(f"version must be 1..{HEAD_VERSION}, got {version}")
    applied = list(range(2, version + 1))
    if extra_later_columns:
        if version >= HEAD_VERSION:
            raise ValueError("extra_later_columns only makes sense for version < 6")
        extras = {version + 1} | ({5} if version <= 3 else set())
        applied += sorted(extras)
    return applied


def columns_at(version: int, *, extra_later_columns: bool = False) -> dict[str, list[str]]:
    """Physical column order of ``sessions`` and ``messages`` in a built file."""
    cols = {"sessions": [c for c, _ in V1_SESSIONS], "messages": [c for c, _ in V1_MESSAGES]}
    for v in _versions_applied(version, extra_later_columns):
        for table, column, _decl, _quoted in VERSION_ALTERS[v]:
            cols[table].append(column)
    return cols


# --- deterministic rows (full v6 shape; projected to the columns a file has) ---------------

S_ROOT = "7f3c9a2e-1b4d-4c8e-9f01-a1b2c3d4e5f6"  # cli, ended by compression
S_CHILD = "7f3c9a2e-2c5e-4d9f-8a12-b2c3d4e5f607"  # cli, child of S_ROOT, active
S_TG = "c0ffee00-3d6f-4eaf-9b23-c3d4e5f60718"  # telegram, active, CJK
S_BARE = "0badf00d-4e70-4fb0-8c34-d4e5f6071829"  # discord, ensure_session-style: NULLs/0s

TOOL_CALLS_JSON = (
    '[{"id": "call_zx81", "type": "function", "function": {"name": "terminal", '
    '"arguments": "{\\"command\\": \\"ls -la ~/.hermes\\"}"}}]'
)

_SESSION_KEYS = [c for c, _ in V1_SESSIONS] + [c for _, c, _, _ in VERSION_ALTERS[3]]
_SESSION_KEYS += [c for _, c, _, _ in VERSION_ALTERS[5]]


def _session(**kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(_SESSION_KEYS)
    for k in ("message_count", "tool_call_count", "input_tokens", "output_tokens",
              "cache_read_tokens", "cache_write_tokens", "reasoning_tokens"):  # fmt: skip
        row[k] = 0
    assert set(kw) <= set(row), set(kw) - set(row)
    row.update(kw)
    return row


def _message(id: int, session_id: str, role: str, content: str | None, ts: float,
             **kw: Any) -> dict[str, Any]:  # fmt: skip
    keys = [c for c, _ in V1_MESSAGES] + [c for _, c, _, _ in VERSION_ALTERS[2]]
    keys += [c for _, c, _, _ in VERSION_ALTERS[6]]
    row: dict[str, Any] = dict.fromkeys(keys)
    row.update(id=id, session_id=session_id, role=role, content=content, timestamp=ts)
    assert set(kw) <= set(row), set(kw) - set(row)
    row.update(kw)
    return row


LEGACY_ROWS: dict[str, list[dict[str, Any]]] = {
    # Insertion order (parents first); dump order is ORDER BY id.
    "sessions": [
        _session(
            id=S_ROOT, source="cli", user_id="local-user", model="anthropic/claude-sonnet-4.5",
            model_config='{"temperature": 0.3, "top_p": 0.95}',
            system_prompt="You are Hermes, a helpful agent.\nBe concise.",
            started_at=1735689600.25, ended_at=1735693200.75, end_reason="compression",
            message_count=4, tool_call_count=1, input_tokens=12345, output_tokens=6789,
            title="Database migration plan", cache_read_tokens=4096, cache_write_tokens=1024,
            reasoning_tokens=512, billing_provider="openrouter",
            billing_base_url="https://openrouter.ai/api/v1", billing_mode="official_docs_snapshot",
            estimated_cost_usd=0.123456, actual_cost_usd=0.118, cost_status="final",
            cost_source="provider_response", pricing_version="pricing-2025-01-01",
        ),
        _session(
            id=S_CHILD, source="cli", user_id="local-user", model="anthropic/claude-sonnet-4.5",
            model_config='{"temperature": 0.3}',
            system_prompt="You are Hermes (continued after compression).",
            parent_session_id=S_ROOT, started_at=1735693201.0, message_count=2,
            input_tokens=2222, output_tokens=1111, title="Database migration plan #2",
            cache_read_tokens=333, cache_write_tokens=44, reasoning_tokens=55,
            billing_provider="anthropic", billing_base_url="https://api.anthropic.com",
            billing_mode="subscription_included", estimated_cost_usd=0.0425,
            actual_cost_usd=0.04, cost_status="estimated", cost_source="pricing_table",
            pricing_version="pricing-2025-01-02",
        ),
        _session(
            id=S_TG, source="telegram", user_id="987654321", model="openai/gpt-4.1-mini",
            model_config='{"max_tokens": 2048}', system_prompt="你是 Hermes。",
            started_at=1735690000.5, message_count=3, input_tokens=900, output_tokens=450,
            title="数据库迁移 🚀", cache_read_tokens=100, cache_write_tokens=200,
            reasoning_tokens=300, billing_provider="openai",
            billing_base_url="https://api.openai.com/v1", billing_mode="usage",
            estimated_cost_usd=0.00175, cost_status="estimated", cost_source="none",
            pricing_version="pricing-2024-12-31",
        ),
        _session(id=S_BARE, source="discord", started_at=1735700000.0),
    ],
    # Ids interleave sessions on purpose: global id neighbours are not session neighbours.
    "messages": [
        _message(1, S_ROOT, "user", "Plan the database migration for state.db", 1735689601.0,
                 token_count=9),
        _message(2, S_TG, "user", "数据库迁移完成了", 1735690001.0, token_count=12),
        _message(3, S_ROOT, "assistant", None, 1735689605.5, tool_calls=TOOL_CALLS_JSON,
                 token_count=42, finish_reason="tool_calls",
                 reasoning="I should inspect the schema first.",
                 reasoning_details='[{"type": "reasoning.summary", "summary": "inspect"}]',
                 codex_reasoning_items='[{"id": "rs_001", "type": "reasoning", '
                 '"encrypted_content": "gAAAAB-zz"}]'),
        _message(4, S_ROOT, "tool", '{"exit_code": 0, "output": "state.db\\nstate.db-wal"}',
                 1735689607.0, tool_call_id="call_zx81", tool_name="terminal", token_count=17),
        _message(5, S_TG, "assistant", "好的！迁移已经验证通过。", 1735690003.25, token_count=20,
                 finish_reason="stop", reasoning="用户确认了迁移"),
        _message(6, S_ROOT, "assistant",
                 "Migration done. Codename: zebracorn.\nAll \"quotes\" and 'apostrophes' "
                 "kept; emoji 🦓🦄.", 1735689610.0, token_count=31, finish_reason="stop",
                 reasoning=""),
        _message(7, S_CHILD, "user", "Continue: verify the FTS index after compression.",
                 1735693202.0, token_count=10),
        _message(8, S_TG, "user", "Can you also check the cost report?", 1735690010.0),
        _message(9, S_CHILD, "assistant", "FTS index verified; 0 rows differ.", 1735693205.0,
                 token_count=11, finish_reason="stop",
                 reasoning_details='{"effort": "low"}'),
    ],
}  # fmt: skip


def _typed(value: Any) -> tuple[str, Any]:
    """(SQLite storage class as ``typeof()`` names it, value) for a Python value."""
    kinds = {type(None): "null", int: "integer", float: "real", str: "text", bytes: "blob"}
    return kinds[type(value)], value


def expected_rows(
    version: int, *, extra_later_columns: bool = False, typed: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Exactly what ``build_legacy_db(..., version, rows=True)`` inserted, ordered by id.

    Each row has the file's columns in physical order. With ``typed`` every value is a
    ``(typeof, value)`` pair, matching ``dump_rows(..., typed=True)`` (catches 0 vs 0.0).
    """
    cols = columns_at(version, extra_later_columns=extra_later_columns)
    out: dict[str, list[dict[str, Any]]] = {}
    for table in ("sessions", "messages"):
        rows = sorted(LEGACY_ROWS[table], key=lambda r: r["id"])
        out[table] = [{c: _typed(r[c]) if typed else r[c] for c in cols[table]} for r in rows]
    return out


# --- building -------------------------------------------------------------------------------


def _alter(table: str, column: str, decl: str, quoted: bool) -> str:
    name = '"' + column.replace('"', '""') + '"' if quoted else column
    return f"ALTER TABLE {table} ADD COLUMN {name} {decl}"


def build_legacy_db(
    path: str | Path, version: int, *, rows: bool = True, extra_later_columns: bool = False
) -> None:
    """Create ``path`` as the original store's store left it at schema ``version`` (1..6), WAL mode.

    ``extra_later_columns``: the shape is ahead of the number (an older build that already
    carried later columns): ``schema_version`` says ``version`` but the file also has the
    columns of ``version + 1`` and, for version <= 3, the v5 columns (not the v4 index).
    Those extra columns are filled too when ``rows``. The file must not exist yet.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(path)
    applied = _versions_applied(version, extra_later_columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(str(path), isolation_level=None)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA foreign_keys=ON")
        con.execute("BEGIN")
        con.execute("CREATE TABLE IF NOT EXISTS schema_version (\n    version INTEGER NOT NULL\n)")
        body = ",\n    ".join(f"{c} {d}" for c, d in V1_SESSIONS)
        con.execute(
            f"CREATE TABLE IF NOT EXISTS sessions (\n    {body},\n"
            "    FOREIGN KEY (parent_session_id) REFERENCES sessions(id)\n)"
        )
        body = ",\n    ".join(f"{c} {d}" for c, d in V1_MESSAGES)
        con.execute(f"CREATE TABLE IF NOT EXISTS messages (\n    {body}\n)")
        for stmt in BASE_INDEXES.strip().split(";"):
            if stmt.strip():
                con.execute(stmt)
        for v in applied:
            for alter in VERSION_ALTERS[v]:
                con.execute(_alter(*alter))
            if v == 4 and v <= version:
                con.execute(TITLE_INDEX)
        # executescript would COMMIT first; run the FTS statements one by one instead.
        for stmt in re.split(r";\s*\n(?=\s*CREATE|\s*$)", FTS_DDL):
            if stmt.strip():
                con.execute(stmt)
        con.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
        if rows:
            cols = columns_at(version, extra_later_columns=extra_later_columns)
            for table in ("sessions", "messages"):
                names = cols[table]
                sql = (
                    f"INSERT INTO {table} ({', '.join(names)}) "
                    f"VALUES ({', '.join('?' * len(names))})"
                )
                for row in LEGACY_ROWS[table]:
                    con.execute(sql, [row[c] for c in names])
        con.execute("COMMIT")
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise
    finally:
        con.close()


# --- reading back ---------------------------------------------------------------------------


def drop_full_text(path: str | Path) -> None:
    """Remove the original store's full-text index (the FTS5 table and its three triggers)
    from a legacy file: adopting it then rebuilds the index under the write lock, the longest
    step an adoption takes."""
    names = re.findall(r"CREATE TRIGGER IF NOT EXISTS (\w+)", FTS_DDL)
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        raw.execute("BEGIN")
        for name in names:
            raw.execute(f"DROP TRIGGER {name}")
        raw.execute("DROP TABLE messages_fts")
        raw.execute("COMMIT")
    finally:
        raw.close()


def _connect_existing(path: str | Path) -> sqlite3.Connection:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(path)
    return sqlite3.connect(str(path))


def dump_rows(path: str | Path, *, typed: bool = False) -> dict[str, list[dict[str, Any]]]:
    """All columns of ``sessions`` and ``messages`` ordered by id, as plain dicts.

    With ``typed`` each value is ``(typeof(col), value)`` so a change of storage class
    (say INTEGER 0 -> REAL 0.0, which compare equal in Python) is visible.
    """
    con = _connect_existing(path)
    try:
        out: dict[str, list[dict[str, Any]]] = {}
        for table in ("sessions", "messages"):
            names = [r[1] for r in con.execute("SELECT * FROM pragma_table_info(?)", (table,))]
            quoted = [f'"{n}"' for n in names]
            select = ", ".join(quoted + [f"typeof({q})" for q in quoted])
            rows = con.execute(f"SELECT {select} FROM {table} ORDER BY id").fetchall()
            n = len(names)
            out[table] = [
                {name: (r[n + i], r[i]) if typed else r[i] for i, name in enumerate(names)}
                for r in rows
            ]
        return out
    finally:
        con.close()


# --- schema signature -----------------------------------------------------------------------

SIGNATURE_TABLES = ("schema_version", "sessions", "messages")


def _ignored_table(name: str) -> bool:
    """Bookkeeping tables, FTS shadow tables, hermes_store's CJK index and its idempotency keys
    (not the original store's schema: the CJK index's presence is checked on its own, see
    ``migration_checks.cjk_objects``; the keys' by the revision's pinned SQL)."""
    ignored = ("alembic_version", "sqlite_sequence", "messages_cjk", "write_keys")
    return name in ignored or name.startswith(("messages_fts_", "messages_cjk_", "sqlite_stat"))


def _norm_sql(sql: str) -> str:
    """Lower-case, drop IF NOT EXISTS / identifier quotes / trailing ';', collapse spaces."""
    s = sql.lower().replace('"', "").replace("`", "")
    s = re.sub(r"\s+", " ", s).strip().rstrip(";").strip()
    s = s.replace(" if not exists ", " ")
    return re.sub(r"\s*([(),=])\s*", r"\1", s)


def schema_signature(path: str | Path, *, trigger_sql: bool = False) -> dict[str, Any]:
    """A column-order-independent, comparable description of a SQLite file's schema.

    Keys: ``tables`` (sorted names, ignoring alembic_version, sqlite_sequence and FTS
    shadow tables), ``columns`` ({table: {name: (TYPE, notnull, dflt_value, pk)}}),
    ``autoincrement`` ({table: bool}), ``foreign_keys`` ({table: [(table, from, to)]}),
    ``indexes`` ({name: (table, unique, [(column, desc)], where-or-None)}), ``triggers``
    (sorted names; with ``trigger_sql`` a {name: normalised SQL} dict instead) and ``fts``
    (the normalised CREATE VIRTUAL TABLE of messages_fts, or None).
    """
    con = _connect_existing(path)
    try:
        master = con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
        sig: dict[str, Any] = {
            "tables": sorted(n for t, n, _, _ in master if t == "table" and not _ignored_table(n)),
            "columns": {},
            "autoincrement": {},
            "foreign_keys": {},
        }
        table_sql = {n: s for t, n, _, s in master if t == "table"}
        for table in SIGNATURE_TABLES:
            info = con.execute("SELECT * FROM pragma_table_info(?)", (table,)).fetchall()
            sig["columns"][table] = {
                name: ((decl or "").upper(), notnull, dflt, pk)
                for _cid, name, decl, notnull, dflt, pk in info
            }
            sig["autoincrement"][table] = "autoincrement" in (table_sql.get(table) or "").lower()
            fks = con.execute("SELECT * FROM pragma_foreign_key_list(?)", (table,)).fetchall()
            sig["foreign_keys"][table] = sorted((r[2], r[3], r[4]) for r in fks)
        indexes: dict[str, Any] = {}
        for kind, name, tbl, sql in master:
            if kind != "index" or name.startswith("sqlite_autoindex_") or _ignored_table(tbl):
                continue
            listing = con.execute('SELECT name, "unique" FROM pragma_index_list(?)', (tbl,))
            unique = dict(listing.fetchall())[name]
            xinfo = con.execute("SELECT * FROM pragma_index_xinfo(?)", (name,)).fetchall()
            cols = [(r[2], r[3]) for r in xinfo if r[5]]  # (name, desc) of key columns
            where = None
            if sql:
                flat = re.sub(r"\s+", " ", sql)
                parts = re.split(r"\swhere\s", flat, maxsplit=1, flags=re.IGNORECASE)
                if len(parts) == 2:
                    where = _norm_sql(parts[1])
            indexes[name] = (tbl, unique, cols, where)
        sig["indexes"] = indexes
        triggers = {
            n: _norm_sql(s or "")
            for t, n, tbl, s in master
            if t == "trigger" and not _ignored_table(tbl) and not n.startswith("messages_cjk_")
        }
        sig["triggers"] = triggers if trigger_sql else sorted(triggers)
        fts_sql = table_sql.get("messages_fts")
        sig["fts"] = _norm_sql(fts_sql) if fts_sql else None
        return sig
    finally:
        con.close()


def build_from_ddl(path: str | Path, ddl: str = SEED_V6_DDL, version: int = HEAD_VERSION) -> None:
    """Create ``path`` from a DDL script (default: the original store's v6) with its version row."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(path)
    con = sqlite3.connect(str(path), isolation_level=None)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.executescript(ddl)
        con.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    finally:
        con.close()
