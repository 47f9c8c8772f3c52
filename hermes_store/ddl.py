"""Frozen facts about the schema history and the raw DDL that SQLAlchemy cannot express.

The names here (``messages_fts`` and its triggers, the original store's indexes) are what
the original store looks for, so they never change. The Alembic revisions and the adoption
of legacy files both read these constants; the ORM models describe the same v6 tables declaratively.
"""

from __future__ import annotations

from collections.abc import Mapping

HEAD_VERSION = 6

FTS_TABLE = "messages_fts"
FTS_TRIGGERS = ("messages_fts_insert", "messages_fts_delete", "messages_fts_update")

#: Columns of each table at v1; later versions add the columns in VERSION_COLUMNS.
V1_COLUMNS: Mapping[str, tuple[str, ...]] = {
    "sessions": (
        "id",
        "source",
        "user_id",
        "model",
        "model_config",
        "system_prompt",
        "parent_session_id",
        "started_at",
        "ended_at",
        "end_reason",
        "message_count",
        "tool_call_count",
        "input_tokens",
        "output_tokens",
    ),
    "messages": (
        "id",
        "session_id",
        "role",
        "content",
        "tool_call_id",
        "tool_calls",
        "tool_name",
        "timestamp",
        "token_count",
    ),
}

#: (table, column, SQL type, default) added by each version, in the original store's order.
VERSION_COLUMNS: Mapping[int, tuple[tuple[str, str, str, str | None], ...]] = {
    2: (("messages", "finish_reason", "TEXT", None),),
    3: (("sessions", "title", "TEXT", None),),
    4: (),
    5: (
        ("sessions", "cache_read_tokens", "INTEGER", "0"),
        ("sessions", "cache_write_tokens", "INTEGER", "0"),
        ("sessions", "reasoning_tokens", "INTEGER", "0"),
        ("sessions", "billing_provider", "TEXT", None),
        ("sessions", "billing_base_url", "TEXT", None),
        ("sessions", "billing_mode", "TEXT", None),
        ("sessions", "estimated_cost_usd", "REAL", None),
        ("sessions", "actual_cost_usd", "REAL", None),
        ("sessions", "cost_status", "TEXT", None),
        ("sessions", "cost_source", "TEXT", None),
        ("sessions", "pricing_version", "TEXT", None),
    ),
    6: (
        ("messages", "reasoning", "TEXT", None),
        ("messages", "reasoning_details", "TEXT", None),
        ("messages", "codex_reasoning_items", "TEXT", None),
    ),
}


def columns_at(version: int) -> dict[str, set[str]]:
    """The column names each table has at ``version`` (1..HEAD_VERSION)."""
    shape = {table: set(cols) for table, cols in V1_COLUMNS.items()}
    for v in range(2, version + 1):
        for table, column, _type, _default in VERSION_COLUMNS[v]:
            shape[table].add(column)
    return shape


# --- SQLite: the original store's external-content FTS5 table and its three sync triggers ---

SQLITE_FTS_TABLE = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(\n"
    "    content,\n    content=messages,\n    content_rowid=id\n)"
)
SQLITE_FTS_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END""",
    """CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content)
        VALUES('delete', old.id, old.content);
END""",
    """CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content)
        VALUES('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END""",
)
SQLITE_FTS_DROP = (
    *(f"DROP TRIGGER IF EXISTS {name}" for name in FTS_TRIGGERS),
    "DROP TABLE IF EXISTS messages_fts",
)
SQLITE_FTS_REBUILD = "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')"

# --- PostgreSQL: a tsvector expression index (GIN) and a trigram index for substrings ---

#: The tsvector of a message: 'simple' keeps every word unstemmed, like FTS5's unicode61.
#: Only the first 200,000 characters are indexed: a tsvector cannot exceed 1 MB, and a longer
#: message of distinct words (a big log dump) could not be stored at all; words past the cap
#: are still found by the substring fallback, which runs when the full-text match is empty.
PG_INDEXED_CHARS = 200_000
PG_TSVECTOR = f"to_tsvector('simple'::regconfig, left(COALESCE(content, ''), {PG_INDEXED_CHARS}))"
#: Stored, so ranking reads the vector instead of re-parsing every matching message's text
#: (a word in all of 200k messages: ranking took 2.3 s from the expression, 0.06 s stored).
PG_TSV_COLUMN = "content_tsv"
PG_FTS_INDEX = "ix_messages_content_fts"
PG_TRGM_INDEX = "ix_messages_content_trgm"
PG_FTS_COLUMN_CREATE = (
    f"ALTER TABLE messages ADD COLUMN IF NOT EXISTS {PG_TSV_COLUMN} tsvector"
    f" GENERATED ALWAYS AS ({PG_TSVECTOR}) STORED"
)
PG_FTS_CREATE = f"CREATE INDEX IF NOT EXISTS {PG_FTS_INDEX} ON messages USING gin ({PG_TSV_COLUMN})"
PG_TRGM_CREATE = (
    f"CREATE INDEX IF NOT EXISTS {PG_TRGM_INDEX} ON messages USING gin (content gin_trgm_ops)"
)

#: Objects the migrations own that are not in the ORM metadata (autogenerate must ignore them).
UNMODELLED_TABLES = frozenset({FTS_TABLE, "alembic_version", "sqlite_sequence"})
UNMODELLED_INDEXES = frozenset({PG_FTS_INDEX, PG_TRGM_INDEX})
UNMODELLED_COLUMNS = frozenset({PG_TSV_COLUMN})


def is_fts_shadow_table(name: str) -> bool:
    """FTS5 keeps its index in ``messages_fts_data``, ``_idx``, ``_docsize``, ``_config``."""
    return name.startswith(f"{FTS_TABLE}_")
