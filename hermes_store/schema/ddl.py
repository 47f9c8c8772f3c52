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
#: This column holds the first 200,000 characters: a tsvector cannot exceed 1 MB, and a longer
#: message of distinct words (a big log dump) could not be stored at all. The whole text of a
#: longer message is indexed in chunks too, in the side table PG_CHUNK_TABLE (``h10``).
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

# --- PostgreSQL: the whole text of long messages, in chunks (revision h10_pg_long_text) ---

#: A message of more bytes than this may hold more than PG_INDEXED_CHARS characters: its whole
#: text is indexed in PG_CHUNK_TABLE as well (the octet length of a stored value is read from
#: its header, without decompressing it, so the test costs nothing on short messages).
PG_LONG_BYTES = PG_INDEXED_CHARS
#: Bytes of text per chunk (plus the overlap): few enough that a chunk's tsvector stays far
#: below 1 MB (at most ~6 bytes of tsvector per byte of text) and its word positions below the
#: 16,383 where PostgreSQL stops counting, so phrases and ranks inside a chunk stay exact.
PG_CHUNK_BYTES = 16_000
#: Each chunk reads on this many bytes into the next one, so a phrase of up to ~1,000 bytes
#: that straddles a cut is whole in one chunk.
PG_CHUNK_OVERLAP_BYTES = 1_000
#: A cut moves forward to the next ASCII space, newline, tab or carriage return within this
#: many bytes (no token spans one), else to the next character boundary.
PG_CHUNK_SEEK_BYTES = 1_024
PG_CHUNK_TABLE = "message_text_chunks"
PG_CHUNK_INDEX = "ix_message_text_chunks_tsv"
PG_CHUNK_CUT_FUNCTION = "hermes_text_cut"
PG_CHUNK_FILL_FUNCTION = "hermes_index_message_text"
PG_CHUNK_SYNC_FUNCTION = "hermes_message_text_chunks_sync"
PG_CHUNK_TRIGGERS = (
    "messages_text_chunks_insert",
    "messages_text_chunks_update",
    "messages_text_chunks_delete",
)
PG_CHUNK_TABLE_CREATE = f"""CREATE TABLE IF NOT EXISTS {PG_CHUNK_TABLE} (
    message_id BIGINT NOT NULL,
    chunk_no INTEGER NOT NULL,
    tsv TSVECTOR NOT NULL,
    PRIMARY KEY (message_id, chunk_no)
)"""
PG_CHUNK_INDEX_CREATE = (
    f"CREATE INDEX IF NOT EXISTS {PG_CHUNK_INDEX} ON {PG_CHUNK_TABLE} USING gin (tsv)"
)
#: Where to cut ``body`` (UTF-8 bytes) at or after byte ``at``: before the first ASCII
#: whitespace byte within PG_CHUNK_SEEK_BYTES (UTF-8 never has those bytes inside a character),
#: else at the next character start (a run that long without whitespace is one token the
#: parser drops anyway, or a blob).
PG_CHUNK_CUT_CREATE = (
    (f"CREATE OR REPLACE FUNCTION {PG_CHUNK_CUT_FUNCTION}(body bytea, at integer)\n")
    + rf"""RETURNS integer LANGUAGE plpgsql IMMUTABLE STRICT AS $fn$
DECLARE
    total integer := octet_length(body);
    seek bytea;
    best integer := 0;
    found integer;
    separator bytea;
BEGIN
    IF at >= total THEN
        RETURN total;
    END IF;
    seek := substring(body FROM at + 1 FOR {PG_CHUNK_SEEK_BYTES});
    FOREACH separator IN ARRAY ARRAY['\x20', '\x0a', '\x09', '\x0d']::bytea[] LOOP
        found := position(separator IN seek);
        IF found > 0 AND (best = 0 OR found < best) THEN
            best := found;
        END IF;
    END LOOP;
    IF best > 0 THEN
        RETURN at + best - 1;
    END IF;
    WHILE at < total AND get_byte(body, at) BETWEEN 128 AND 191 LOOP
        at := at + 1;
    END LOOP;
    RETURN at;
END
$fn$"""
)
#: Index one message's whole text as chunks (returns how many). It works on the text's UTF-8
#: bytes: a byte offset is found in constant time, where ``substr`` of text counts characters
#: from the start (quadratic over a 16 MiB message). Notices (a word over 2,047 bytes) are
#: kept from the client: a blob would send one per chunk. It and the trigger function keep
#: the search_path they were created with (the store's schema): a write through the
#: store's one-statement path names its tables by schema and sets no search_path.
PG_CHUNK_FILL_CREATE = (
    (f"CREATE OR REPLACE FUNCTION {PG_CHUNK_FILL_FUNCTION}(message bigint, content text)\n")
    + f"""RETURNS integer LANGUAGE plpgsql
SET client_min_messages = warning SET search_path FROM CURRENT AS $fn$
DECLARE
    body bytea := convert_to(content, 'UTF8');
    total integer := octet_length(body);
    chunk_start integer := 0;
    cut integer;
    stop integer;
    chunk integer := 0;
BEGIN
    WHILE chunk_start < total LOOP
        cut := {PG_CHUNK_CUT_FUNCTION}(body, chunk_start + {PG_CHUNK_BYTES});
        stop := {PG_CHUNK_CUT_FUNCTION}(body, cut + {PG_CHUNK_OVERLAP_BYTES});
        INSERT INTO {PG_CHUNK_TABLE} (message_id, chunk_no, tsv) VALUES (
            message, chunk, to_tsvector('simple'::regconfig,
                convert_from(substring(body FROM chunk_start + 1 FOR stop - chunk_start), 'UTF8')));
        chunk := chunk + 1;
        chunk_start := cut;
    END LOOP;
    RETURN chunk;
END
$fn$"""
)
PG_CHUNK_SYNC_CREATE = f"""CREATE OR REPLACE FUNCTION {PG_CHUNK_SYNC_FUNCTION}()
RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $fn$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        DELETE FROM {PG_CHUNK_TABLE} WHERE message_id = OLD.id;
    END IF;
    IF TG_OP <> 'DELETE' AND octet_length(NEW.content) > {PG_LONG_BYTES} THEN
        PERFORM {PG_CHUNK_FILL_FUNCTION}(NEW.id, NEW.content);
    END IF;
    RETURN NULL;
END
$fn$"""
#: Fired only for long messages (the WHEN is checked before a trigger call is even queued).
PG_CHUNK_TRIGGERS_CREATE = (
    f"CREATE TRIGGER {PG_CHUNK_TRIGGERS[0]} AFTER INSERT ON messages FOR EACH ROW"
    f" WHEN (octet_length(NEW.content) > {PG_LONG_BYTES})"
    f" EXECUTE FUNCTION {PG_CHUNK_SYNC_FUNCTION}()",
    f"CREATE TRIGGER {PG_CHUNK_TRIGGERS[1]} AFTER UPDATE OF id, content ON messages"
    " FOR EACH ROW"
    f" WHEN (octet_length(OLD.content) > {PG_LONG_BYTES}"
    f" OR octet_length(NEW.content) > {PG_LONG_BYTES})"
    f" EXECUTE FUNCTION {PG_CHUNK_SYNC_FUNCTION}()",
    f"CREATE TRIGGER {PG_CHUNK_TRIGGERS[2]} AFTER DELETE ON messages FOR EACH ROW"
    f" WHEN (octet_length(OLD.content) > {PG_LONG_BYTES})"
    f" EXECUTE FUNCTION {PG_CHUNK_SYNC_FUNCTION}()",
)
#: Index every long message already stored (the table must be empty of them first).
PG_CHUNK_FILL_ALL = (
    f"SELECT count({PG_CHUNK_FILL_FUNCTION}(id, content)) FROM messages"
    f" WHERE octet_length(content) > {PG_LONG_BYTES}"
)
PG_CHUNK_DROP = (
    *(f"DROP TRIGGER IF EXISTS {name} ON messages" for name in PG_CHUNK_TRIGGERS),
    f"DROP FUNCTION IF EXISTS {PG_CHUNK_SYNC_FUNCTION}()",
    f"DROP FUNCTION IF EXISTS {PG_CHUNK_FILL_FUNCTION}(bigint, text)",
    f"DROP FUNCTION IF EXISTS {PG_CHUNK_CUT_FUNCTION}(bytea, integer)",
    f"DROP TABLE IF EXISTS {PG_CHUNK_TABLE}",
)


# --- SQLite: the substring index for CJK and other scripts written without spaces ---

#: Code points of scripts whose words are not separated by spaces: unicode61 makes one token of
#: a whole run, so a word inside a longer run is only findable as a substring. CJK ideographs
#: (unified, extensions A to F, compatibility), CJK punctuation, kana, hangul (syllables and
#: jamo), half-width kana, Thai, Lao, Myanmar and Khmer.
UNSEGMENTED_RANGES: tuple[tuple[int, int], ...] = (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1000, 0x109F),  # Myanmar
    (0x1100, 0x11FF),  # hangul jamo
    (0x1780, 0x17FF),  # Khmer
    (0x3000, 0x30FF),  # CJK symbols and punctuation, hiragana, katakana
    (0x3130, 0x318F),  # hangul compatibility jamo
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7AF),  # hangul syllables
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF65, 0xFF9F),  # half-width katakana
    (0x20000, 0x2EBEF),  # CJK extensions B to F
)


def character_class(ranges: tuple[tuple[int, int], ...]) -> str:
    """``[a-b...]``: one character of the (inclusive) code point ranges, read alike by SQLite's
    GLOB and by Python's ``re`` (none of these ranges starts or ends on a special character)."""
    return "[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in ranges) + "]"


#: One character of a script written without spaces (the GLOB and the patterns below).
UNSEGMENTED_CLASS = character_class(UNSEGMENTED_RANGES)
#: A GLOB that is true when a text holds at least one such character. Built-in SQL only, so
#: the triggers run on any connection, the original store's included.
CJK_GLOB = f"*{UNSEGMENTED_CLASS}*"
CJK_TABLE = "messages_cjk"
CJK_TRIGGERS = ("messages_cjk_insert", "messages_cjk_delete", "messages_cjk_update")
#: Contentless (it stores no text, only the index: deletes hand it the old text) and
#: ``detail='none'`` (no positions: a candidate's text is checked with LIKE anyway), so it costs
#: a few bytes per trigram of the rows that need it. Trigram tokens need SQLite >= 3.34.
SQLITE_CJK_TABLE = (
    f"CREATE VIRTUAL TABLE IF NOT EXISTS {CJK_TABLE} USING fts5(\n"
    "    content,\n    content='',\n    detail='none',\n    tokenize='trigram'\n)"
)


def cjk_matches(value: str) -> str:
    """The SQL condition, on the text ``value`` (an expression), that puts it in the CJK index.

    The GLOB walks the text against every range (60 µs for 165 characters); comparing its
    byte and character lengths first (0.5 µs) skips it for ASCII text, which has no such
    character."""
    return f"length(CAST({value} AS BLOB)) > length({value}) AND {value} GLOB '{CJK_GLOB}'"


CJK_NEW_MATCHES = cjk_matches("new.content")
CJK_OLD_MATCHES = cjk_matches("old.content")
SQLITE_CJK_TRIGGERS = (
    f"""CREATE TRIGGER IF NOT EXISTS messages_cjk_insert AFTER INSERT ON messages
WHEN {CJK_NEW_MATCHES} BEGIN
    INSERT INTO {CJK_TABLE}(rowid, content) VALUES (new.id, new.content);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS messages_cjk_delete AFTER DELETE ON messages
WHEN {CJK_OLD_MATCHES} BEGIN
    INSERT INTO {CJK_TABLE}({CJK_TABLE}, rowid, content) VALUES ('delete', old.id, old.content);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS messages_cjk_update AFTER UPDATE ON messages
WHEN ({CJK_OLD_MATCHES}) OR ({CJK_NEW_MATCHES}) BEGIN
    INSERT INTO {CJK_TABLE}({CJK_TABLE}, rowid, content)
        SELECT 'delete', old.id, old.content WHERE {CJK_OLD_MATCHES};
    INSERT INTO {CJK_TABLE}(rowid, content) SELECT new.id, new.content WHERE {CJK_NEW_MATCHES};
END""",
)
SQLITE_CJK_DROP = (
    *(f"DROP TRIGGER IF EXISTS {name}" for name in CJK_TRIGGERS),
    f"DROP TABLE IF EXISTS {CJK_TABLE}",
)
#: A contentless table has no 'rebuild': empty it and index the rows that need it.
SQLITE_CJK_REBUILD = (
    f"INSERT INTO {CJK_TABLE}({CJK_TABLE}) VALUES ('delete-all')",
    f"INSERT INTO {CJK_TABLE}(rowid, content) SELECT id, content FROM messages"
    f" WHERE {cjk_matches('content')}",
)
#: The ids the index holds: FTS5 keeps one row per indexed document in its ``_docsize`` table.
CJK_DOCSIZE = f"{CJK_TABLE}_docsize"
FTS_DOCSIZE = f"{FTS_TABLE}_docsize"
#: What the insert triggers do for one row (id, content), as statements of their own: a bulk
#: load runs them for many rows at once.
SQLITE_FTS_INSERT = f"INSERT INTO {FTS_TABLE}(rowid, content) VALUES (?1, ?2)"
SQLITE_CJK_INSERT = (
    f"INSERT INTO {CJK_TABLE}(rowid, content) SELECT ?1, ?2 WHERE {cjk_matches('?2')}"
)
#: The first SQLite release with FTS5's trigram tokenizer.
TRIGRAM_SQLITE = (3, 34, 0)


def trigram_supported(sqlite_version: str) -> bool:
    """Whether a SQLite of this version (``sqlite_version()``) has the trigram tokenizer."""
    parts = tuple(int(p) for p in sqlite_version.split(".")[:3] if p.isdigit())
    return parts >= TRIGRAM_SQLITE


#: Objects the migrations own that are not in the ORM metadata (autogenerate must ignore them).
UNMODELLED_TABLES = frozenset(
    {FTS_TABLE, CJK_TABLE, PG_CHUNK_TABLE, "alembic_version", "sqlite_sequence"}
)
UNMODELLED_INDEXES = frozenset({PG_FTS_INDEX, PG_TRGM_INDEX, PG_CHUNK_INDEX})
UNMODELLED_COLUMNS = frozenset({PG_TSV_COLUMN})


def is_fts_shadow_table(name: str) -> bool:
    """FTS5 keeps its index in ``messages_fts_data``, ``_idx``, ``_docsize``, ``_config``."""
    return name.startswith((f"{FTS_TABLE}_", f"{CJK_TABLE}_"))


# --- recognising the package's own objects in a file it did not write ----------------------

#: The rows of the main index (FTS5 keeps one ``_docsize`` row per indexed message) and of
#: ``messages``: an index that holds fewer than there are messages misses some.
FTS_INDEXED_COUNT = f"SELECT count(*) FROM {FTS_DOCSIZE}"
MESSAGES_COUNT = "SELECT count(*) FROM messages"


def fts5_arguments(sql: str | None) -> tuple[list[str], dict[str, str]] | None:
    """The columns and options of an FTS5 table's ``CREATE VIRTUAL TABLE`` (quotes removed,
    names lower-cased); None when ``sql`` does not create an FTS5 table (a plain table, FTS4,
    another module)."""
    if sql is None:
        return None
    head, sep, rest = sql.partition("(")
    words = head.lower().split()
    if not sep or "virtual" not in words or words[-2:-1] != ["using"] or words[-1] != "fts5":
        return None
    columns: list[str] = []
    options: dict[str, str] = {}
    for part in rest.rpartition(")")[0].split(","):
        key, eq, value = part.partition("=")
        name = key.strip().strip("'\"`[]").lower()
        if eq:
            options[name] = value.strip().strip("'\"`[]")
        elif name:
            columns.append(name)
    return columns, options


def is_store_fts(sql: str | None) -> bool:
    """Whether ``sql`` creates an index the store can keep in step with ``messages``: FTS5
    over its ``content`` with the messages as external content, one size row per message
    (any tokenizer: the original store's is unicode61)."""
    columns, options = fts5_arguments(sql) or ([], {})
    return (
        columns == ["content"]
        and options.get("content", "").lower() == "messages"
        and options.get("content_rowid", "").lower() == "id"
        and options.get("columnsize", "1") != "0"
    )


def is_store_cjk(sql: str | None) -> bool:
    """Whether ``sql`` creates the CJK index as ``h7_cjk_index`` does: contentless trigram FTS5."""
    columns, options = fts5_arguments(sql) or ([], {})
    return (
        columns == ["content"]
        and options.get("content") == ""
        and options.get("tokenize", "").lower() == "trigram"
    )
