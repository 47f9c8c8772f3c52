"""The full-text index, one strategy per backend: the one place that creates, drops, rebuilds,
optimizes, checks and repairs it at run time.

SQLite: the original store's external-content FTS5 table ``messages_fts`` with its three sync
triggers, plus (from ``h7_cjk_index``, where SQLite has trigrams) the contentless trigram table
``messages_cjk`` for scripts written without spaces. PostgreSQL: the stored ``content_tsv``
column with its GIN index, and the ``pg_trgm`` index when the extension is there.

The Alembic revisions spell out their own DDL and never call this module: a released revision
must not change when this code does. Everything else (adoption, repair at open, the doctor,
``rebuild_search_index``, maintenance, snapshot checks) goes through :func:`for_dialect`.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from hermes_store.engine import fastpath, placement
from hermes_store.schema import ddl, revisions

log = logging.getLogger(__name__)

#: The revision that added the CJK index (SQLite).
CJK_REVISION = "h7_cjk_index"
#: The revision that added the chunked index of long messages (PostgreSQL).
LONG_TEXT_REVISION = "h10_pg_long_text"
#: SQLITE_CORRUPT; also the low byte of SQLITE_CORRUPT_VTAB.
SQLITE_CORRUPT = 11
#: FTS5 reads at most this many levels (and segments) from its structure record: one more and
#: every statement on the table, its constructor's included (so DROP TABLE too), fails as corrupt.
FTS5_MAX_STRUCTURE = 2000
#: Levels from which no full merge is started and the doctor warns, half of FTS5's limit: each
#: start on a structure whose segments sit on several levels adds two empty levels that
#: nothing removes (SQLite 3.40; later releases stop at 64), so a daily job reaches it in over
#: a year; only a rebuild makes the structure shallow again.
DEEP_LEVELS = 1000
#: The row of ``<table>_data`` holding the structure record; row 1 holds the averages.
STRUCTURE_ROWID = 10
#: A structure record of an empty index: cookie 0, no level, no segment, write counter 0.
EMPTY_STRUCTURE = bytes(7)
#: Marks a structure record of the second format (SQLite >= 3.44): four bytes after the cookie.
_STRUCTURE_V2 = b"\xff\x00\x00\x01"


def integrity_statement(table: str) -> str:
    """FTS5's 'integrity-check' of ``table`` (a write statement that changes nothing)."""
    return f"INSERT INTO {table}({table}, rank) VALUES ('integrity-check', 1)"


def index_damage(connection: sqlite3.Connection) -> list[str]:
    """FTS5's 'integrity-check' of each full-text index the file has (the main one and the
    CJK trigram one), on a plain ``sqlite3`` connection outside a transaction: what each
    reports damaged (empty: sound). ``PRAGMA integrity_check`` cannot see this damage (an
    unreadable structure record is a valid row of a valid table). Errors that are not
    corruption (a locked file) are raised."""
    tables = [
        str(row[0])
        for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN (?, ?) ORDER BY name",
            (ddl.FTS_TABLE, ddl.CJK_TABLE),
        )
    ]
    found: list[str] = []
    for table in tables:
        connection.execute("BEGIN")
        try:
            connection.execute(integrity_statement(table))
        except sqlite3.DatabaseError as error:
            if getattr(error, "sqlite_errorcode", 0) & 0xFF != SQLITE_CORRUPT:
                raise
            found.append(f"full-text index {table}: {error}")
        finally:
            connection.execute("ROLLBACK")
    return found


def merge_statement(table: str = ddl.FTS_TABLE) -> str:
    """FTS5's bounded 'merge' (``:pages`` leaf pages of work; negative: every segment)."""
    return f"INSERT INTO {table}({table}, rank) VALUES ('merge', :pages)"


@dataclass(frozen=True)
class IndexShape:
    """The header of an FTS5 structure record: how many levels and segments the index has."""

    levels: int
    segments: int


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """SQLite's varint at ``at``: (value, offset after it); ValueError past the end."""
    value = 0
    for i in range(9):
        if at >= len(data):
            raise ValueError("the record ends inside a number")
        byte = data[at]
        at += 1
        if i == 8:
            return (value << 8) | byte, at
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            return value, at
    raise AssertionError("unreachable")


def decode_structure(block: bytes) -> IndexShape:
    """The header of an FTS5 structure record; ValueError when FTS5 itself would refuse it."""
    at = 4  # the cookie
    if block[at : at + 4] == _STRUCTURE_V2:
        at += 4
    levels, at = _varint(block, at)
    segments, at = _varint(block, at)
    _varint(block, at)  # the write counter
    if levels > FTS5_MAX_STRUCTURE or segments > FTS5_MAX_STRUCTURE:
        raise ValueError(
            f"{levels} levels and {segments} segments (FTS5 reads at most {FTS5_MAX_STRUCTURE})"
        )
    return IndexShape(levels, segments)


def structure_block(conn: Connection, table: str = ddl.FTS_TABLE) -> bytes | None:
    """The index's structure record (a plain table read, so it works when the table's own
    constructor fails); None when the index has none. ValueError: not a blob."""
    block = conn.execute(
        sa.text(f"SELECT block FROM {table}_data WHERE id = :id"), {"id": STRUCTURE_ROWID}
    ).scalar()
    if block is not None and not isinstance(block, bytes):
        raise ValueError(f"the structure record is a {type(block).__name__}, not a blob")
    return block


def structure(conn: Connection, table: str = ddl.FTS_TABLE) -> IndexShape | None:
    """The index's shape read from its structure record; None when the index has none.
    ValueError: damaged."""
    block = structure_block(conn, table)
    return None if block is None else decode_structure(block)


def index_segments(block: bytes) -> list[tuple[int, int, int]]:
    """(segment id, first leaf page, last leaf page) of each segment an FTS5 structure record
    lists; ValueError where FTS5 itself would refuse the record."""
    decode_structure(block)  # the header, within FTS5's limits
    at = 4
    second_format = block[at : at + 4] == _STRUCTURE_V2
    if second_format:
        at += 4
    levels, at = _varint(block, at)
    _, at = _varint(block, at)  # the segments in all
    _, at = _varint(block, at)  # the write counter
    found: list[tuple[int, int, int]] = []
    for _level in range(levels):
        _, at = _varint(block, at)  # the segments of a merge in progress
        count, at = _varint(block, at)
        for _segment in range(count):
            segment, at = _varint(block, at)
            first, at = _varint(block, at)
            last, at = _varint(block, at)
            for _field in range(5 if second_format else 0):  # origins and tombstones
                _, at = _varint(block, at)
            if last < first:
                raise ValueError(f"segment {segment} ends (page {last}) before it starts")
            found.append((segment, first, last))
    return found


class FullText(Protocol):
    """What the runtime code asks of a backend's full-text index."""

    dialect: str

    def missing(
        self, tables: Collection[str], triggers: Collection[str], indexes: Collection[str]
    ) -> list[str]:
        """Objects of the index absent from a schema read (names, for messages)."""
        ...

    def damage(
        self,
        tables: Collection[str],
        triggers: Collection[str],
        indexes: Collection[str],
        columns: Collection[str],
    ) -> list[str]:
        """What a schema read lacks, described for the repair's log."""
        ...

    def create(self, conn: Connection) -> None:
        """Create whatever is missing (idempotent); does not fill the index."""
        ...

    def drop(self, conn: Connection) -> None:
        """Drop the index objects (the messages stay)."""
        ...

    def rebuild(self, conn: Connection) -> None:
        """Recreate missing objects and rebuild the index from ``messages``."""
        ...

    def optimize(self, conn: Connection) -> None:
        """Compact the index."""
        ...

    def check(self, conn: Connection) -> bool:
        """True when the index is present and sound (logs what is wrong)."""
        ...

    def repair(
        self,
        conn: Connection,
        tables: Collection[str],
        triggers: Collection[str],
        indexes: Collection[str],
        columns: Collection[str],
    ) -> list[str]:
        """Recreate what is missing, from the data; returns what was done."""
        ...


def _normal(sql: str) -> str:
    """A trigger's SQL without the spelling that does not change what it does."""
    return " ".join(sql.replace("IF NOT EXISTS ", "").split()).lower()


@dataclass(frozen=True)
class _InsertTrigger:
    """An insert trigger a bulk load does the work of: its SQL (normalised), how to drop it,
    the statement that does its work for one row, and the one that does it for every message
    whose id is in the JSON array ``?1`` (read from the table, in the array's order)."""

    sql: str
    drop: str
    work: str
    work_all: str


#: The messages of a bulk load, by the ids it hands over as a JSON array.
_LOADED = "FROM json_each(?1) AS j JOIN messages AS m ON m.id = j.value"
_INSERT_TRIGGERS = {
    ddl.FTS_TRIGGERS[0]: _InsertTrigger(
        _normal(ddl.SQLITE_FTS_TRIGGERS[0]),
        f"DROP TRIGGER {ddl.FTS_TRIGGERS[0]}",
        ddl.SQLITE_FTS_INSERT,
        f"INSERT INTO {ddl.FTS_TABLE}(rowid, content) SELECT m.id, m.content {_LOADED}",
    ),
    ddl.CJK_TRIGGERS[0]: _InsertTrigger(
        _normal(ddl.SQLITE_CJK_TRIGGERS[0]),
        f"DROP TRIGGER {ddl.CJK_TRIGGERS[0]}",
        ddl.SQLITE_CJK_INSERT,
        f"INSERT INTO {ddl.CJK_TABLE}(rowid, content) SELECT m.id, m.content {_LOADED} "
        f"WHERE {ddl.cjk_matches('m.content')}",
    ),
}
#: Whether a connection's SQLite has ``json_each`` (built in since 3.38; a build may omit it).
_JSON_EACH = "SELECT count(*) FROM json_each('[]')"
_HAS_JSON_KEY = "hermes_store_json_each"
_FIND_INSERT_TRIGGERS = sa.text(
    "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'messages' "
    "AND name IN :names"
).bindparams(sa.bindparam("names", expanding=True))
#: Counts over the messages of a bulk load (``:ids``, in chunks): those the main index holds;
#: those with ASCII text the CJK index holds (none should be there); those with other text
#: where the CJK index and its condition disagree.
_IDS: sa.BindParameter[list[int]] = sa.bindparam("ids", expanding=True)
_IN_MAIN = sa.text(f"SELECT count(*) FROM {ddl.FTS_DOCSIZE} WHERE id IN :ids").bindparams(_IDS)
_IN_CJK = sa.text(f"SELECT count(*) FROM {ddl.CJK_DOCSIZE} WHERE id IN :ids").bindparams(_IDS)
_CJK_WRONG = sa.text(
    f"SELECT count(*) FROM messages m WHERE m.id IN :ids AND ({ddl.cjk_matches('m.content')}) "
    f"<> EXISTS (SELECT 1 FROM {ddl.CJK_DOCSIZE} d WHERE d.id = m.id)"
).bindparams(_IDS)
#: The same counts over the ids of the JSON array ``?1`` (where the connection has
#: ``json_each``): one statement for a whole batch instead of one per 500 ids.
_IN_MAIN_ALL = f"SELECT count(*) FROM json_each(?1) AS j JOIN {ddl.FTS_DOCSIZE} d ON d.id = j.value"
_IN_CJK_ALL = f"SELECT count(*) FROM json_each(?1) AS j JOIN {ddl.CJK_DOCSIZE} d ON d.id = j.value"
_CJK_WRONG_ALL = (
    f"SELECT count(*) {_LOADED} WHERE ({ddl.cjk_matches('m.content')}) "
    f"<> EXISTS (SELECT 1 FROM {ddl.CJK_DOCSIZE} d WHERE d.id = m.id)"
)
#: Message ids per statement when checking a bulk load.
_ID_CHUNK = 500


@dataclass
class BulkLoad:
    """The messages a bulk load inserted: (id, content), to index in one go."""

    rows: list[tuple[int, str | None]] = field(default_factory=list)

    def add(self, rows: Iterable[tuple[int, str | None]]) -> None:
        self.rows.extend(rows)


def _has_json_each(conn: Connection) -> bool:
    """Whether the connection's SQLite has ``json_each`` (asked once per connection)."""
    info = conn.connection.info
    known = info.get(_HAS_JSON_KEY)
    if known is None:
        try:
            conn.exec_driver_sql(_JSON_EACH).scalar()
            known = True
        except sa.exc.OperationalError:
            known = False
        info[_HAS_JSON_KEY] = known
    return bool(known)


class SqliteFullText:
    """FTS5 ``messages_fts`` (the original store's) and the CJK trigram table."""

    dialect = "sqlite"

    def missing(
        self, tables: Collection[str], triggers: Collection[str], indexes: Collection[str] = ()
    ) -> list[str]:
        found = set(tables) | set(triggers)
        return sorted({ddl.FTS_TABLE, *ddl.FTS_TRIGGERS} - found)

    def damage(
        self,
        tables: Collection[str],
        triggers: Collection[str],
        indexes: Collection[str] = (),
        columns: Collection[str] = (),
    ) -> list[str]:
        found: list[str] = []
        if ddl.FTS_TABLE not in tables:
            found.append(f"no {ddl.FTS_TABLE} table")
        missing_triggers = set(ddl.FTS_TRIGGERS) - set(triggers)
        if missing_triggers:
            found.append(f"missing triggers {sorted(missing_triggers)}")
        return found

    def present(self, conn: Connection) -> list[str]:
        """The objects of the main index missing from the database (read from sqlite_master)."""
        found = conn.scalars(
            sa.text(
                "SELECT name FROM sqlite_master "
                "WHERE name = :t OR (type = 'trigger' AND tbl_name = 'messages')"
            ),
            {"t": ddl.FTS_TABLE},
        ).all()
        return self.missing(found, found)

    def create(self, conn: Connection) -> None:
        for statement in (ddl.SQLITE_FTS_TABLE, *ddl.SQLITE_FTS_TRIGGERS):
            conn.exec_driver_sql(statement)
        if cjk_index_expected(conn):
            for statement in (ddl.SQLITE_CJK_TABLE, *ddl.SQLITE_CJK_TRIGGERS):
                conn.exec_driver_sql(statement)

    @contextmanager
    def bulk_load(self, conn: Connection) -> Iterator[BulkLoad]:
        """Inside a write transaction: the index's insert triggers are suspended while the
        caller inserts messages (handing each one's id and text to :meth:`BulkLoad.add`), then
        those rows are indexed in a few statements and the triggers put back, in the same
        transaction: committed together, or (a crash, a rollback) not at all.

        A trigger is suspended only when it says exactly what this package's (and the original
        store's) says; any other keeps firing row by row. An error inside the block leaves the
        rows unindexed and the triggers put back: the caller's transaction must roll back.
        """
        rows = conn.execute(_FIND_INSERT_TRIGGERS, {"names": list(_INSERT_TRIGGERS)})
        found = {str(name): str(sql) for name, sql in rows}
        suspended = {
            name: sql for name, sql in found.items() if _normal(sql) == _INSERT_TRIGGERS[name].sql
        }
        for name in suspended:
            conn.exec_driver_sql(_INSERT_TRIGGERS[name].drop)
        load = BulkLoad()
        try:
            yield load
            whole = _has_json_each(conn)
            for name in suspended:
                rows_for = load.rows
                if name == ddl.CJK_TRIGGERS[0]:
                    # ASCII text never meets the condition (its first test); SQL decides the rest
                    rows_for = [row for row in load.rows if row[1] and not row[1].isascii()]
                if not rows_for:
                    continue
                trigger = _INSERT_TRIGGERS[name]
                if whole:
                    # One statement: SQLite indexes the whole batch without coming back to
                    # Python, so the driver releases the GIL for all of it (another thread
                    # reads the next batch meanwhile) and no text crosses back from Python.
                    ids = json.dumps([row[0] for row in rows_for])
                    conn.exec_driver_sql(trigger.work_all, (ids,))
                else:
                    conn.exec_driver_sql(trigger.work, rows_for)
        finally:
            for sql in suspended.values():
                conn.exec_driver_sql(sql)

    def unindexed(self, conn: Connection, rows: Sequence[tuple[int, str | None]]) -> list[str]:
        """What the indexes get wrong about the messages ``rows`` (id, content): one missing
        from the main index, one missing from the CJK index that its condition puts there, one
        there that it keeps out. Counted from FTS5's one row per indexed document
        (``<table>_docsize``); empty when every message is where it belongs."""
        problems: list[str] = []
        if has_table(conn, ddl.FTS_DOCSIZE):
            held = _count(conn, _IN_MAIN, _IN_MAIN_ALL, [row[0] for row in rows])
            if held != len(rows):
                problems.append(f"{ddl.FTS_TABLE} holds {held} of {len(rows)} messages")
        if has_table(conn, ddl.CJK_DOCSIZE):
            plain = [row[0] for row in rows if not row[1] or row[1].isascii()]
            others = [row[0] for row in rows if row[1] and not row[1].isascii()]
            wrong = _count(conn, _IN_CJK, _IN_CJK_ALL, plain) + _count(
                conn, _CJK_WRONG, _CJK_WRONG_ALL, others
            )
            if wrong:
                problems.append(f"{ddl.CJK_TABLE} is wrong about {wrong} of {len(rows)} messages")
        return problems

    def covers_messages(self, conn: Connection) -> bool:
        """Whether the main index holds as many messages as there are: one the original store
        created on a file that already had messages (its ``CREATE ... IF NOT EXISTS`` makes
        it empty) holds only those written since. Two counts, no read of the text."""
        if not has_table(conn, ddl.FTS_DOCSIZE):
            return False
        indexed = conn.exec_driver_sql(ddl.FTS_INDEXED_COUNT).scalar()
        return indexed == conn.exec_driver_sql(ddl.MESSAGES_COUNT).scalar()

    def create_main(self, conn: Connection, fill: bool) -> None:
        """The original store's objects only (adoption: the CJK index comes with h7)."""
        for statement in (ddl.SQLITE_FTS_TABLE, *ddl.SQLITE_FTS_TRIGGERS):
            conn.exec_driver_sql(statement)
        if fill:
            conn.exec_driver_sql(ddl.SQLITE_FTS_REBUILD)

    def drop(self, conn: Connection) -> None:
        for statement in (*ddl.SQLITE_FTS_DROP, *ddl.SQLITE_CJK_DROP):
            conn.exec_driver_sql(statement)

    def rebuild(self, conn: Connection) -> None:
        """Rebuild both indexes from ``messages``; an index whose table cannot even be opened
        (a damaged structure record fails its constructor, and with it 'rebuild' and DROP
        TABLE) is emptied through its shadow tables first."""
        for table in (ddl.FTS_TABLE, ddl.CJK_TABLE):
            if has_table(conn, table) and not _opens(conn, table):
                reset_shadow_tables(conn, table)
        self.create_main(conn, fill=True)
        if cjk_index_expected(conn):
            statements = (ddl.SQLITE_CJK_TABLE, *ddl.SQLITE_CJK_TRIGGERS, *ddl.SQLITE_CJK_REBUILD)
            for statement in statements:
                conn.exec_driver_sql(statement)

    def optimize(self, conn: Connection) -> None:
        """FTS5 'optimize'; a structure already deep is rebuilt instead (as much work: both
        rewrite the whole index), as 'optimize' would make it deeper still."""
        shape = structure(conn)
        if shape is not None and shape.levels >= DEEP_LEVELS:
            conn.exec_driver_sql(ddl.SQLITE_FTS_REBUILD)
            return
        conn.exec_driver_sql(f"INSERT INTO {ddl.FTS_TABLE}({ddl.FTS_TABLE}) VALUES ('optimize')")

    def merge_step(self, conn: Connection, pages: int) -> None:
        """One bounded FTS5 'merge' of ``pages`` leaf pages (negative: every segment)."""
        conn.execute(sa.text(merge_statement()), {"pages": pages})

    def leaf_pages(self, conn: Connection) -> int:
        """Rows of the index's data table: the size of the work a full merge takes."""
        return int(conn.exec_driver_sql(f"SELECT count(*) FROM {ddl.FTS_TABLE}_data").scalar() or 0)

    def check(self, conn: Connection) -> bool:
        """FTS5 'integrity-check' against the content table (a write statement: use a write
        transaction), then the CJK index when present or due."""
        if self.present(conn):
            log.error("full-text table %s or its triggers are missing", ddl.FTS_TABLE)
            return False
        if not fts5_integrity(conn, ddl.FTS_TABLE):
            return False
        return _check_cjk_index(conn)

    def repair(
        self,
        conn: Connection,
        tables: Collection[str],
        triggers: Collection[str],
        indexes: Collection[str] = (),
        columns: Collection[str] = (),
    ) -> list[str]:
        damage = self.damage(tables, triggers)
        if not damage:
            return []
        # Rows written while the table or a trigger was missing are not indexed: rebuild.
        self.create_main(conn, fill=True)
        return [
            f"recreated {ddl.FTS_TABLE} and its triggers and rebuilt the index "
            f"(was: {'; '.join(damage)})"
        ]


class PostgresFullText:
    """The stored ``content_tsv`` column, its GIN index and the optional trigram index."""

    dialect = "postgresql"

    def missing(
        self, tables: Collection[str], triggers: Collection[str], indexes: Collection[str]
    ) -> list[str]:
        return [] if ddl.PG_FTS_INDEX in indexes else [ddl.PG_FTS_INDEX]

    def damage(
        self,
        tables: Collection[str],
        triggers: Collection[str],
        indexes: Collection[str],
        columns: Collection[str],
    ) -> list[str]:
        found: list[str] = []
        if ddl.PG_TSV_COLUMN not in columns:
            found.append(f"no messages.{ddl.PG_TSV_COLUMN} column")
        if ddl.PG_FTS_INDEX not in indexes:
            found.append(f"no {ddl.PG_FTS_INDEX} index")
        return found

    def create(self, conn: Connection) -> None:
        """The column and its index; from ``h10_pg_long_text`` on, the chunk table, its index,
        functions and triggers too (triggers replaced, so each exists once)."""
        conn.exec_driver_sql(ddl.PG_FTS_COLUMN_CREATE)
        conn.exec_driver_sql(ddl.PG_FTS_CREATE)
        if long_text_expected(conn):
            statements = (
                ddl.PG_CHUNK_TABLE_CREATE,
                ddl.PG_CHUNK_INDEX_CREATE,
                ddl.PG_CHUNK_CUT_CREATE,
                ddl.PG_CHUNK_FILL_CREATE,
                ddl.PG_CHUNK_SYNC_CREATE,
                *ddl.PG_CHUNK_DROP[: len(ddl.PG_CHUNK_TRIGGERS)],
                *ddl.PG_CHUNK_TRIGGERS_CREATE,
            )
            for statement in statements:
                conn.exec_driver_sql(statement)

    def drop(self, conn: Connection) -> None:
        for statement in ddl.PG_CHUNK_DROP:
            conn.exec_driver_sql(statement)
        for name in (ddl.PG_TRGM_INDEX, ddl.PG_FTS_INDEX):
            conn.exec_driver_sql(f"DROP INDEX IF EXISTS {name}")
        conn.exec_driver_sql(f"ALTER TABLE messages DROP COLUMN IF EXISTS {ddl.PG_TSV_COLUMN}")

    def rebuild(self, conn: Connection) -> None:
        """Reindex, and index every long message's chunks afresh."""
        self.create(conn)
        for name in self.existing_indexes(conn):
            conn.exec_driver_sql(f"REINDEX INDEX {name}")
        if long_text_expected(conn):
            conn.exec_driver_sql(f"DELETE FROM {ddl.PG_CHUNK_TABLE}")
            conn.exec_driver_sql(ddl.PG_CHUNK_FILL_ALL)

    def optimize(self, conn: Connection) -> None:
        """Flush the GIN pending lists and refresh the planner's statistics (VACUUM cannot run
        in a transaction)."""
        for name in self.existing_indexes(conn):
            conn.execute(
                sa.text("SELECT gin_clean_pending_list(CAST(:name AS regclass))"), {"name": name}
            )
        conn.exec_driver_sql("ANALYZE messages")

    def check(self, conn: Connection) -> bool:
        """The tsvector index, and the trigram index if present, exist and are valid (amcheck
        has no GIN check before PostgreSQL 18)."""
        rows = conn.execute(
            sa.text(
                "SELECT c.relname, i.indisvalid AND i.indisready AS ok FROM pg_index i"
                " JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE c.relname IN (:fts, :trgm, :chunks) AND pg_table_is_visible(c.oid)"
            ),
            {"fts": ddl.PG_FTS_INDEX, "trgm": ddl.PG_TRGM_INDEX, "chunks": ddl.PG_CHUNK_INDEX},
        ).all()
        status = {str(name): bool(ok) for name, ok in rows}
        if ddl.PG_FTS_INDEX not in status:
            log.error("full-text index %s is missing", ddl.PG_FTS_INDEX)
            return False
        if long_text_expected(conn):
            missing = self.missing_long_text(conn)
            if missing:
                log.error("the index of long messages lacks %s", ", ".join(missing))
                return False
        broken = sorted(name for name, ok in status.items() if not ok)
        if broken:
            log.error("full-text indexes not valid (an interrupted build?): %s", ", ".join(broken))
            return False
        return True

    def missing_long_text(self, conn: Connection) -> list[str]:
        """What the index of long messages lacks: its table, its GIN index, a trigger on
        ``messages`` (without one, long messages written since are not indexed)."""
        found = conn.execute(
            _LONG_TEXT_OBJECTS,
            {
                "table": ddl.PG_CHUNK_TABLE,
                "index": ddl.PG_CHUNK_INDEX,
                "triggers": list(ddl.PG_CHUNK_TRIGGERS),
            },
        ).one()
        missing = [
            name for name, there in zip(_LONG_TEXT_NAMES, found[:2], strict=True) if not there
        ]
        present = set(found[2] or ())
        return missing + [name for name in ddl.PG_CHUNK_TRIGGERS if name not in present]

    def has_trigram_index(self, conn: Connection) -> bool:
        return (
            conn.scalar(sa.text("SELECT to_regclass(:name)"), {"name": ddl.PG_TRGM_INDEX})
            is not None
        )

    def existing_indexes(self, conn: Connection) -> list[str]:
        names = conn.execute(
            sa.text(
                "SELECT to_regclass(:fts)::text, to_regclass(:trgm)::text,"
                " to_regclass(:chunks)::text"
            ),
            {"fts": ddl.PG_FTS_INDEX, "trgm": ddl.PG_TRGM_INDEX, "chunks": ddl.PG_CHUNK_INDEX},
        ).one()
        return [str(name) for name in names if name is not None]

    def repair(
        self,
        conn: Connection,
        tables: Collection[str],
        triggers: Collection[str],
        indexes: Collection[str],
        columns: Collection[str],
    ) -> list[str]:
        done: list[str] = []
        if ddl.PG_TSV_COLUMN not in columns:
            conn.exec_driver_sql(ddl.PG_FTS_COLUMN_CREATE)
            done.append(f"recreated the messages.{ddl.PG_TSV_COLUMN} column")
        if ddl.PG_FTS_INDEX not in indexes:
            conn.exec_driver_sql(ddl.PG_FTS_CREATE)
            done.append(f"recreated the {ddl.PG_FTS_INDEX} index")
        return done


_LONG_TEXT_OBJECTS = sa.text(
    "SELECT to_regclass(:table) IS NOT NULL, to_regclass(:index) IS NOT NULL,"
    " (SELECT array_agg(tgname::text) FROM pg_trigger"
    "  WHERE tgrelid = to_regclass('messages') AND tgname = ANY(:triggers))"
)
_LONG_TEXT_NAMES = (ddl.PG_CHUNK_TABLE, ddl.PG_CHUNK_INDEX)

SQLITE = SqliteFullText()
POSTGRESQL = PostgresFullText()


def for_dialect(name: str) -> SqliteFullText | PostgresFullText:
    """The strategy of a dialect (``conn.dialect.name``)."""
    if name == "sqlite":
        return SQLITE
    if name == "postgresql":
        return POSTGRESQL
    raise ValueError(f"no full-text strategy for the {name!r} dialect")


def of(conn: Connection) -> SqliteFullText | PostgresFullText:
    """The strategy of a connection's dialect."""
    return for_dialect(conn.dialect.name)


def _is_corrupt(error: sa.exc.DatabaseError) -> bool:
    return bool(getattr(error.orig, "sqlite_errorcode", 0) & 0xFF == SQLITE_CORRUPT)


def _opens(conn: Connection, table: str) -> bool:
    """Whether FTS5 can open ``table`` (its constructor reads the structure record)."""
    try:
        with conn.begin_nested():
            conn.exec_driver_sql(f"SELECT rowid FROM {table} WHERE rowid = 0").all()
    except sa.exc.DatabaseError as error:
        if not _is_corrupt(error):
            raise
        log.warning("full-text table %s cannot be opened: %s", table, error.orig)
        return False
    return True


def reset_shadow_tables(conn: Connection, table: str) -> None:
    """Empty an FTS5 index through its shadow tables (plain tables) and give it the structure
    and averages records of an empty index, as FTS5's own 'delete-all' does: its constructor
    works again, and a 'rebuild' refills it. Its configuration (``_config``) is kept."""
    shadows = set(
        conn.execute(
            sa.text(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN :names"
            ).bindparams(sa.bindparam("names", expanding=True)),
            {"names": [f"{table}_{suffix}" for suffix in ("data", "idx", "docsize")]},
        )
        .scalars()
        .all()
    )
    for name in sorted(shadows):
        conn.exec_driver_sql(f"DELETE FROM {name}")
    conn.execute(
        sa.text(f"INSERT INTO {table}_data(id, block) VALUES (1, x''), (:id, :block)"),
        {"id": STRUCTURE_ROWID, "block": EMPTY_STRUCTURE},
    )
    log.warning("emptied the full-text index %s through its shadow tables", table)


def fts5_integrity(conn: Connection, table: str) -> bool:
    """FTS5's 'integrity-check' (against the content table when it has one), in a savepoint."""
    try:
        with conn.begin_nested():
            conn.exec_driver_sql(integrity_statement(table))
    except sa.exc.DatabaseError as error:
        if not _is_corrupt(error):
            raise
        log.error("full-text index %s failed its integrity check: %s", table, error.orig)
        return False
    return True


def cjk_index_expected(conn: Connection) -> bool:
    """The CJK index belongs to the schema from h7_cjk_index on, where SQLite has trigrams."""
    version_table = placement.of(conn).version_table
    if not has_table(conn, version_table):
        return False
    revision = conn.execute(sa.text(f"SELECT version_num FROM {version_table}")).scalar()
    if revision is None:
        return False
    if CJK_REVISION not in revisions.up_to(revision):  # before h7, or unknown: not ours
        return False
    version = str(conn.exec_driver_sql("SELECT sqlite_version()").scalar())
    return ddl.trigram_supported(version)


def long_text_expected(conn: Connection) -> bool:
    """The chunk index of long messages belongs to a PostgreSQL schema from h10_pg_long_text
    on (the version table's revision says so; before it, or unknown: not ours)."""
    version_table = placement.of(conn).version_table
    if conn.scalar(sa.text("SELECT to_regclass(:name)"), {"name": version_table}) is None:
        return False
    revision = conn.execute(sa.text(f"SELECT version_num FROM {version_table}")).scalar()
    return revision is not None and LONG_TEXT_REVISION in revisions.up_to(str(revision))


def _count(conn: Connection, query: sa.TextClause, over_array: str, ids: Sequence[int]) -> int:
    """The count ``query`` gives for ``ids`` (its ``:ids``): in one statement where SQLite has
    ``json_each`` (``over_array``, the same count over the JSON array ``?1``), else summed
    over chunks of them."""
    if not ids:
        return 0
    if _has_json_each(conn):
        return int(conn.exec_driver_sql(over_array, (json.dumps(list(ids)),)).scalar() or 0)
    total = 0
    for start in range(0, len(ids), _ID_CHUNK):
        params = {"ids": list(ids[start : start + _ID_CHUNK])}
        (row,) = fastpath.rows(conn, query, params, expanding=("ids",))
        total += int(next(iter(row.values())))
    return total


def has_table(conn: Connection, name: str) -> bool:
    """Whether the SQLite database has the table ``name`` (an index's, or a version table)."""
    return bool(
        conn.execute(
            sa.text("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = :n"),
            {"n": name},
        ).scalar()
    )


def _check_cjk_index(conn: Connection) -> bool:
    """The CJK index, when present (or due), has its triggers, passes FTS5's check, and holds
    exactly the messages its triggers select (compared by id)."""
    if not has_table(conn, ddl.CJK_TABLE):
        if cjk_index_expected(conn):
            log.error("the CJK index %s is missing", ddl.CJK_TABLE)
            return False
        return True
    triggers = conn.execute(
        sa.text(
            "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND name IN :names"
        ).bindparams(sa.bindparam("names", expanding=True)),
        {"names": list(ddl.CJK_TRIGGERS)},
    ).scalar_one()
    if triggers != len(ddl.CJK_TRIGGERS):
        log.error("triggers of the CJK index %s are missing", ddl.CJK_TABLE)
        return False
    if not fts5_integrity(conn, ddl.CJK_TABLE):
        return False
    # The triggers' own condition: its length test skips the GLOB for ASCII text (a GLOB of
    # every message took 220 s of CPU at 2 GB, 10 s with the test).
    matches = ddl.cjk_matches("content")
    drift = (
        conn.execute(
            sa.text(
                f"SELECT count(*) FROM (SELECT id FROM messages WHERE {matches}"
                f" EXCEPT SELECT id FROM {ddl.CJK_DOCSIZE}) UNION ALL"
                f" SELECT count(*) FROM (SELECT id FROM {ddl.CJK_DOCSIZE}"
                f" EXCEPT SELECT id FROM messages WHERE {matches})"
            )
        )
        .scalars()
        .all()
    )
    if any(drift):
        log.error("the CJK index misses %d messages and holds %d it should not", drift[0], drift[1])
        return False
    return True


#: FTS5 numbers a segment's leaf pages in ``<table>_data`` as ``segment id << 37 | page``.
_LEAF_ROWID_SHIFT = 37


#: Looks at the index before its lost pages are said: writers beside the doctor (which reads
#: without one snapshot) may change the segments between its reads.
_LOST_PAGE_LOOKS = 3


def lost_pages(conn: Connection, table: str) -> str:
    """The leaf pages that ``table``'s structure record lists as the first or last of a
    segment and that ``<table>_data`` lacks, in words ("" when none); ValueError when the
    structure record is damaged.

    Said only when the structure record read again after the pages is the same: each of its
    changes (a writer's new segment, a merge that drops pages it consumed) rewrites it, so
    pages found missing between two equal reads are lost, not merged away meanwhile (the
    doctor's reads are not one snapshot). An index that changes at every look says nothing."""
    for _ in range(_LOST_PAGE_LOOKS):
        block = structure_block(conn, table)
        if block is None:
            return ""
        lost = _pages_absent(conn, table, index_segments(block))
        if not lost:
            return ""
        if structure_block(conn, table) == block:
            shown = ", ".join(f"segment {segment} page {page}" for segment, page in lost[:3])
            more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
            return f"{len(lost)} leaf page(s) its segments list are missing ({shown}{more})"
    return ""


def _pages_absent(
    conn: Connection, table: str, segments: list[tuple[int, int, int]]
) -> list[tuple[int, int]]:
    """(segment, page) of each segment's first and last leaf page absent from the table."""
    wanted = {
        (segment << _LEAF_ROWID_SHIFT) | page: (segment, page)
        for segment, first, last in segments
        if last > 0
        for page in (first, last)
    }
    rows = list(wanted)
    statement = sa.text(f"SELECT id FROM {table}_data WHERE id IN :ids").bindparams(
        sa.bindparam("ids", expanding=True)
    )
    present: set[int] = set()
    for start in range(0, len(rows), 500):
        chunk = rows[start : start + 500]
        present.update(int(found) for found in conn.scalars(statement, {"ids": chunk}))
    return [wanted[rowid] for rowid in rows if rowid not in present]


def missing_index_pages(conn: Connection) -> list[str]:
    """What a few reads find lost in the full-text indexes (empty: nothing): a structure
    record FTS5 cannot read, or a segment it lists whose first or last leaf page is gone.

    Cheap enough to run before a job writes to a live index of any size (the structure
    record and two rows per segment, by primary key), unlike FTS5's 'integrity-check', which
    reads the whole index and the content (about a second per 100 MB) under the write lock: a
    prune runs it first, so its deletes never go into an index whose pages were lost. It
    does not look inside the pages; the doctor's checks do."""
    problems: list[str] = []
    for table in (ddl.FTS_TABLE, ddl.CJK_TABLE):
        if not has_table(conn, table):
            continue
        try:
            lost = lost_pages(conn, table)
        except ValueError as error:
            problems.append(f"{table}: its structure record is damaged ({error})")
            continue
        if lost:
            problems.append(f"{table}: {lost}")
    return problems
