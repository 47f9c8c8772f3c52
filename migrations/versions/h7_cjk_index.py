"""h7: a trigram index of the messages written in CJK and other unsegmented scripts (SQLite).

Not a schema version of the original store: ``schema_version`` stays 6, so the original store
keeps opening and writing the file, and its inserts keep the index in step through the
triggers (they use built-in SQL only). Created only when SQLite has the trigram tokenizer
(3.34+): a trigger naming a trigram table would make every insert fail on an older SQLite.
Offline (``--sql``) the index is emitted, as for a SQLite that has the tokenizer. PostgreSQL
already serves the same queries from its ``pg_trgm`` index: nothing to do.

Revision ID: h7_cjk_index
Revises: v6_reasoning_columns
Create Date: 2026-12-01
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from hermes_store.schema import steps as schema_ops

revision: str = "h7_cjk_index"
down_revision: str | None = "v6_reasoning_columns"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger(__name__)

#: Scripts written without spaces between words: unicode61 makes one token of a whole run.
RANGES: tuple[tuple[int, int], ...] = (
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
GLOB = "*[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in RANGES) + "]*"
# Comparing byte and character lengths first (0.5 us) skips the GLOB for ASCII text.
NEW_MATCHES = (
    f"length(CAST(new.content AS BLOB)) > length(new.content) AND new.content GLOB '{GLOB}'"
)
OLD_MATCHES = (
    f"length(CAST(old.content AS BLOB)) > length(old.content) AND old.content GLOB '{GLOB}'"
)
#: Contentless, no positions: a few bytes per trigram of only the rows that need it.
TABLE = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_cjk USING fts5(\n"
    "    content,\n    content='',\n    detail='none',\n    tokenize='trigram'\n)"
)
TRIGGERS = (
    f"""CREATE TRIGGER IF NOT EXISTS messages_cjk_insert AFTER INSERT ON messages
WHEN {NEW_MATCHES} BEGIN
    INSERT INTO messages_cjk(rowid, content) VALUES (new.id, new.content);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS messages_cjk_delete AFTER DELETE ON messages
WHEN {OLD_MATCHES} BEGIN
    INSERT INTO messages_cjk(messages_cjk, rowid, content) VALUES ('delete', old.id, old.content);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS messages_cjk_update AFTER UPDATE ON messages
WHEN ({OLD_MATCHES}) OR ({NEW_MATCHES}) BEGIN
    INSERT INTO messages_cjk(messages_cjk, rowid, content)
        SELECT 'delete', old.id, old.content WHERE {OLD_MATCHES};
    INSERT INTO messages_cjk(rowid, content) SELECT new.id, new.content WHERE {NEW_MATCHES};
END""",
)
#: Index what an adopted file already holds (nothing, on a new database).
FILL = (
    "INSERT INTO messages_cjk(rowid, content) SELECT id, content FROM messages"
    f" WHERE content GLOB '{GLOB}'"
)


def _trigram_available() -> bool:
    if schema_ops.offline():
        return True  # the documented default of offline SQL
    version = str(op.get_bind().exec_driver_sql("SELECT sqlite_version()").scalar())
    if schema_ops.trigram_supported(version):
        return True
    log.warning("SQLite %s has no trigram tokenizer (needs 3.34+): CJK search will scan", version)
    return False


def upgrade() -> None:
    if schema_ops.dialect_name() != "sqlite" or not _trigram_available():
        return
    for statement in (TABLE, *TRIGGERS, FILL):
        op.execute(sa.text(statement))


def downgrade() -> None:
    if schema_ops.dialect_name() != "sqlite":
        return
    for name in ("messages_cjk_insert", "messages_cjk_delete", "messages_cjk_update"):
        op.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}"))
    op.execute(sa.text("DROP TABLE IF EXISTS messages_cjk"))
