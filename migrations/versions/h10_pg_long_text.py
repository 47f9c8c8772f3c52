r"""h10: the whole text of long messages in PostgreSQL's full-text index.

``messages.content_tsv`` holds a message's first 200,000 characters (a tsvector cannot exceed
1 MB, and positions stop at 16,383). This revision adds the side table
``message_text_chunks(message_id, chunk_no, tsv)``: for every message of more than 200,000
bytes, its WHOLE text cut into chunks of about 16,000 bytes (at whitespace, each reading 1,000
bytes on into the next so a phrase across a cut is whole in one chunk), each chunk's
``to_tsvector('simple', ...)`` GIN-indexed. Three triggers on ``messages`` keep it exact on
insert (``COPY`` included), update and delete; their ``WHEN`` reads only the stored value's
length, so a short message costs nothing. The search unions the two indexes.

The upgrade indexes the long messages already stored, in batches (``schema_ops.BACKFILL_BATCH``
messages per statement, each logged), BEFORE it puts the triggers on ``messages``: creating a
trigger locks the table against writes until the migration commits, so writers wait only for
a second pass that indexes the long messages committed during the first (with h8's
``lock_timeout``: a transaction holding ``messages`` longer than that fails the upgrade
cleanly, to be re-run, instead of queueing every gateway behind it). SQLite indexes every
character already: there this revision only moves the Alembic version. Offline (``--sql``)
the triggers come first and the backfill is one statement.

Revision ID: h10_pg_long_text
Revises: h9_write_keys
Create Date: 2026-12-05
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from hermes_store.schema import steps as schema_ops

revision: str = "h10_pg_long_text"
down_revision: str | None = "h9_write_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger(__name__)

TABLE = """CREATE TABLE IF NOT EXISTS message_text_chunks (
    message_id BIGINT NOT NULL,
    chunk_no INTEGER NOT NULL,
    tsv TSVECTOR NOT NULL,
    PRIMARY KEY (message_id, chunk_no)
)"""
INDEX = (
    "CREATE INDEX IF NOT EXISTS ix_message_text_chunks_tsv ON message_text_chunks USING gin (tsv)"
)
CUT = r"""CREATE OR REPLACE FUNCTION hermes_text_cut(body bytea, at integer)
RETURNS integer LANGUAGE plpgsql IMMUTABLE STRICT AS $fn$
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
    seek := substring(body FROM at + 1 FOR 1024);
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
FILL = """CREATE OR REPLACE FUNCTION hermes_index_message_text(message bigint, content text)
RETURNS integer LANGUAGE plpgsql
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
        cut := hermes_text_cut(body, chunk_start + 16000);
        stop := hermes_text_cut(body, cut + 1000);
        INSERT INTO message_text_chunks (message_id, chunk_no, tsv) VALUES (
            message, chunk, to_tsvector('simple'::regconfig,
                convert_from(substring(body FROM chunk_start + 1 FOR stop - chunk_start), 'UTF8')));
        chunk := chunk + 1;
        chunk_start := cut;
    END LOOP;
    RETURN chunk;
END
$fn$"""
SYNC = """CREATE OR REPLACE FUNCTION hermes_message_text_chunks_sync()
RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $fn$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        DELETE FROM message_text_chunks WHERE message_id = OLD.id;
    END IF;
    IF TG_OP <> 'DELETE' AND octet_length(NEW.content) > 200000 THEN
        PERFORM hermes_index_message_text(NEW.id, NEW.content);
    END IF;
    RETURN NULL;
END
$fn$"""
TRIGGERS = (
    "CREATE TRIGGER messages_text_chunks_insert AFTER INSERT ON messages FOR EACH ROW"
    " WHEN (octet_length(NEW.content) > 200000)"
    " EXECUTE FUNCTION hermes_message_text_chunks_sync()",
    "CREATE TRIGGER messages_text_chunks_update AFTER UPDATE OF id, content ON messages"
    " FOR EACH ROW"
    " WHEN (octet_length(OLD.content) > 200000 OR octet_length(NEW.content) > 200000)"
    " EXECUTE FUNCTION hermes_message_text_chunks_sync()",
    "CREATE TRIGGER messages_text_chunks_delete AFTER DELETE ON messages FOR EACH ROW"
    " WHEN (octet_length(OLD.content) > 200000)"
    " EXECUTE FUNCTION hermes_message_text_chunks_sync()",
)
FILL_ALL = (
    "SELECT count(hermes_index_message_text(id, content)) FROM messages"
    " WHERE octet_length(content) > 200000"
)
#: The next batch of long messages not indexed yet after :after, by id (the primary key's
#: order: each batch resumes where the last one stopped).
NEXT_BATCH = (
    "SELECT id FROM messages WHERE id > :after AND octet_length(content) > 200000"
    " AND NOT EXISTS (SELECT 1 FROM message_text_chunks c WHERE c.message_id = messages.id)"
    " ORDER BY id LIMIT :batch"
)
LOCK_TIMEOUT = "SET LOCAL lock_timeout = '30s'"
FILL_BATCH = "SELECT sum(hermes_index_message_text(id, content)) FROM messages WHERE id = ANY(:ids)"
DROP = (
    "DROP TRIGGER IF EXISTS messages_text_chunks_insert ON messages",
    "DROP TRIGGER IF EXISTS messages_text_chunks_update ON messages",
    "DROP TRIGGER IF EXISTS messages_text_chunks_delete ON messages",
    "DROP FUNCTION IF EXISTS hermes_message_text_chunks_sync()",
    "DROP FUNCTION IF EXISTS hermes_index_message_text(bigint, text)",
    "DROP FUNCTION IF EXISTS hermes_text_cut(bytea, integer)",
    "DROP TABLE IF EXISTS message_text_chunks",
)


def _backfill() -> None:
    """Index the long messages stored and not indexed yet, a bounded batch per statement."""
    bind = op.get_bind()
    after, messages, chunks = 0, 0, 0
    while True:
        batch = {"after": after, "batch": schema_ops.BACKFILL_BATCH}
        ids = bind.execute(sa.text(NEXT_BATCH), batch).scalars().all()
        if not ids:
            break
        chunks += int(bind.execute(sa.text(FILL_BATCH), {"ids": list(ids)}).scalar_one())
        messages += len(ids)
        after = int(ids[-1])
        log.info("indexed %d long messages in %d chunks so far", messages, chunks)


def upgrade() -> None:
    if schema_ops.dialect_name() != "postgresql":
        return
    for statement in (TABLE, INDEX, CUT, FILL, SYNC):
        op.execute(sa.text(statement))
    if schema_ops.offline():
        for statement in (LOCK_TIMEOUT, *TRIGGERS, FILL_ALL):
            op.execute(sa.text(statement))
        return
    _backfill()  # writers go on meanwhile
    for statement in (LOCK_TIMEOUT, *TRIGGERS):
        op.execute(sa.text(statement))
    _backfill()  # what they committed before the triggers could see it


def downgrade() -> None:
    if schema_ops.dialect_name() != "postgresql":
        return
    for statement in DROP:
        op.execute(sa.text(statement))
