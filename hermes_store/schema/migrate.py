"""Programmatic migrations and the adoption of ``state.db`` files written by the original store.

The original store tracks its schema in ``schema_version`` (1..6) and knows nothing of Alembic.
Such a file is *adopted*: its tables are checked against that version (a file may already carry
columns of later versions: the revisions skip what exists), it is stamped with the matching
revision and upgraded, all in one write transaction. Anything that is not a database, or whose
shape or version this package does not know, is refused before a single byte is written.

Opening a database at head (:func:`ensure_head`, :func:`check_head`) reads its version table and
compares it with the head revision id, a constant (:mod:`hermes_store.schema.revisions`): Alembic
loads only inside the functions that migrate, so a process that opens and reads never pays for it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from hermes_store.engine import files, placement
from hermes_store.engine.factory import (
    BUSY_OPTION,
    READER_BUSY_TIMEOUT_S,
    WRITE_OPTION,
    WRITER_BUSY_TIMEOUT_S,
    Target,
    create_engine,
    create_private_file,
    display_url,
    make_private_dirs,
    read_only_reason,
    refuse_hot_journal,
    refuse_sqlite_aliases,
    same_connection,
    sqlite_file,
    to_url,
    unreadable_in_wal,
)
from hermes_store.errors import (
    AccessDeniedError,
    DatabaseLockedError,
    HermesStoreError,
    NotADatabaseError,
    SchemaBehindError,
    SchemaError,
    SchemaTooNewError,
    StoreConfigError,
    UnrecognizedSchemaError,
    UnsafePathError,
    is_retryable,
    mapped_errors,
    open_errors,
    translate,
)
from hermes_store.schema import ddl, fulltext, revisions
from hermes_store.tables import write_keys_table
from hermes_store.uow import writequeue
from hermes_store.uow.interrupts import NOTHING_HELD
from hermes_store.uow.unit import QUEUE_HEAD_BUSY_TIMEOUT_S, RetryPolicy

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext

log = logging.getLogger(__name__)

#: Held around every Alembic command: Alembic keeps the running migration's context and
#: config in module globals (``alembic.context``, ``alembic.op``), so two commands in two
#: threads of one process ran on each other's connection (threads opening a new file at once
#: crashed the interpreter). Taken after the file's migration lock, never before it.
ALEMBIC_COMMANDS = threading.RLock()

#: Key of the transaction-level advisory lock that serialises migrations on PostgreSQL.
PG_MIGRATION_LOCK = 0x4865726D6573  # "Hermes"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic Config that needs no alembic.ini (works from an installed wheel).

    Alembic loads here, on the way to a migration: a database at head is opened without it.
    """
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", revisions.script_location())
    config.attributes["placement"] = placement.current()
    if connection is not None:
        config.attributes["connection"] = connection
        config.attributes["placement"] = placement.of(connection)
    return config


def _migration_context(conn: Connection) -> MigrationContext:
    """Alembic's context on ``conn``, with the placement's version table."""
    from alembic.runtime.migration import MigrationContext

    where = placement.of(conn)
    opts = {"version_table": where.version_table, "version_table_schema": where.schema}
    return MigrationContext.configure(conn, opts=opts)


#: This package's own tables past the original store's last schema version, newest first,
#: with the revision that creates each.
OWN_TABLES = (("write_keys", "h9_write_keys"), ("messages_cjk", "h7_cjk_index"))


def legacy_revision(state: DatabaseState) -> str | None:
    """The revision of a database with a ``schema_version`` and no Alembic row.

    The original store's files: their version's. A database this package wrote that lost its
    row (a hand-dropped or emptied ``alembic_version``) also holds tables of later revisions,
    which the upgrade from its version would create again and fail on. On SQLite the newest of
    them tells its revision (the revisions between change nothing there); on PostgreSQL they
    retype columns in place, so it cannot be told: None."""
    assert state.schema_version is not None
    ours = [revision for table, revision in OWN_TABLES if is_own_table(state, table)]
    if not ours:
        return revision_for_version(state.schema_version)
    if state.schema_version != ddl.HEAD_VERSION or state.dialect != "sqlite":
        return None
    return ours[0]


def is_own_table(state: DatabaseState, table: str) -> bool:
    """Whether ``table`` is there with the shape this package gives it (a name alone is
    no proof: another application may have a ``write_keys`` of its own)."""
    if table not in state.tables:
        return False
    if table == ddl.CJK_TABLE:
        return ddl.is_store_cjk(state.definitions.get(table))
    if table == write_keys_table.name and table in state.columns:
        return state.columns[table] == set(write_keys_table.columns.keys())
    return True


def foreign_tables(state: DatabaseState) -> list[str]:
    """The tables that bear a name of this package's own objects without their shape."""
    names = [table for table, _ in OWN_TABLES]
    return [table for table in names if table in state.tables and not is_own_table(state, table)]


def revision_for_version(version: int) -> str:
    """The Alembic revision of the original store's schema version (``v3_session_title`` for 3)."""
    revision = revisions.for_version(version)
    if revision is None:
        raise UnrecognizedSchemaError(f"no revision corresponds to schema_version {version}")
    return revision


def head_revision() -> str:
    """The head revision's id (a constant: no Alembic, no script read)."""
    return revisions.HEAD


#: Alembic's relative form: ``[LABEL@][SYMBOL](+|-)N`` (``head-1``, ``v3_session_title+2``, ``+1``).
_RELATIVE = re.compile(r"(?:(.+?)@)?(\w+)?([+-]\d+)")


def resolve_revision(spec: str) -> str:
    """``spec`` checked before anything is opened or locked, with a step from a named revision
    (``head-1``, ``base+2``) resolved to the revision it names (``base`` included).

    Alembic refuses most bad arguments with its ``CommandError`` ("Can't locate revision"), but
    an empty id (``''``, ``'@'``) or a step past either end (``head+1``, ``base+99``, and an
    upgrade to ``head-10``, which is base) trips an ``assert`` deep inside it instead: those
    raise the same ``CommandError`` here, or reach Alembic resolved. Steps from the database's
    own revision (``+1``, ``-1``) need that revision, so they are left to Alembic, which
    refuses them cleanly inside the migration's transaction (rolled back).
    """
    from alembic.util import CommandError

    if ":" in spec:
        raise CommandError("Range revision not allowed")
    if not spec.rpartition("@")[2].strip():
        raise CommandError(
            f"Can't locate revision identified by {spec!r}: give a revision id, head, base or "
            "a step such as head-1 (`hermes-store db history` lists them)"
        )
    scripts = revisions.scripts()
    relative = _RELATIVE.fullmatch(spec)
    if relative is None:
        if _RELATIVE.match(spec) is not None:  # Alembic would drop what follows the number
            raise CommandError(f"Can't locate revision identified by {spec!r}")
        scripts.get_revisions(spec)  # CommandError when unknown or ambiguous
        return spec
    label, symbol, steps = relative.groups()
    if symbol is None:
        if label:
            scripts.get_revisions(f"{label}@head")  # CommandError when no such label
        return spec
    start = scripts.get_revision(f"{label}@{symbol}" if label else symbol)
    chain = revisions.REVISIONS  # one linear chain: a step is an index
    reached = (chain.index(start.revision) if start is not None else -1) + int(steps)
    if reached >= len(chain):
        raise CommandError(
            f"Can't locate revision identified by {spec!r}: it lies "
            f"{reached - len(chain) + 1} past head ({revisions.HEAD})"
        )
    if reached < -1:
        raise CommandError(
            f"Can't locate revision identified by {spec!r}: it lies {-1 - reached} below base"
        )
    return chain[reached] if reached >= 0 else "base"


# -- looking at a database without changing it -------------------------------------------------


@dataclass
class DatabaseState:
    """What a database holds, read without taking any lock."""

    tables: set[str] = field(default_factory=set)
    revision: str | None = None
    version_table: str = placement.DEFAULT_VERSION_TABLE
    schema_version: int | None = None
    columns: dict[str, set[str]] = field(default_factory=dict)
    #: SQLite: the trigger names; PostgreSQL: the index names on ``messages``.
    triggers: set[str] = field(default_factory=set)
    indexes: set[str] = field(default_factory=set)
    dialect: str = "sqlite"
    #: SQLite: the views (a view may stand where the store keeps a table).
    views: set[str] = field(default_factory=set)
    #: SQLite: the ``CREATE`` statements of the full-text tables, by name.
    definitions: dict[str, str] = field(default_factory=dict)
    #: Every row of the version table (one, normally).
    revision_rows: list[str] = field(default_factory=list)
    #: ``schema_version`` exists without a row (the original store stopped while creating the
    #: file): ``schema_version`` is then the version its tables' shape tells, if any.
    version_row_missing: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.tables - ddl.UNMODELLED_TABLES - {self.version_table}) and not self.views

    @property
    def is_legacy(self) -> bool:
        return self.revision is None and "schema_version" in self.tables


def read_state(conn: Connection) -> DatabaseState:
    """Tables, Alembic revision and the original store's schema_version of the connected
    database."""
    inspector = sa.inspect(conn)
    where = placement.of(conn)
    triggers: set[str] = set()
    indexes: set[str] = set()
    views: set[str] = set()
    definitions: dict[str, str] = {}
    if conn.dialect.name == "sqlite":
        # One read of sqlite_master gives the tables and the FTS triggers (the open-time check).
        rows = conn.exec_driver_sql(_SQLITE_OBJECTS, (ddl.FTS_TABLE, ddl.CJK_TABLE)).all()
        tables = {name for kind, name, _ in rows if kind == "table"}
        triggers = {name for kind, name, _ in rows if kind == "trigger"}
        views = {name for kind, name, _ in rows if kind == "view"}
        definitions = {name: sql for kind, name, sql in rows if kind == "table" and sql}
    else:
        _check_server_encoding(conn)
        tables = set(inspector.get_table_names(schema=where.schema))
        if not tables and where.schema is None:
            _check_search_path(conn)
        if "messages" in tables:
            indexes = set(
                conn.execute(
                    sa.text(
                        "SELECT indexname FROM pg_indexes "
                        "WHERE schemaname = COALESCE(:schema, current_schema()) "
                        "AND tablename = 'messages'"
                    ),
                    {"schema": where.schema},
                ).scalars()
            )
    state = DatabaseState(
        tables=tables,
        triggers=triggers,
        indexes=indexes,
        version_table=where.version_table,
        dialect=conn.dialect.name,
        views=views,
        definitions=definitions,
    )
    if where.version_table in tables:
        state.revision_rows = list(
            conn.execute(
                sa.text(f"SELECT version_num FROM {where.table(where.version_table)}")
            ).scalars()
        )
        state.revision = state.revision_rows[0] if state.revision_rows else None
    # A legacy file's write_keys may be another application's: its columns tell.
    own = (write_keys_table.name,) if state.revision is None else ()
    for table in ("sessions", "messages", *own):
        if table in tables:
            state.columns[table] = {
                c["name"] for c in inspector.get_columns(table, schema=where.schema)
            }
    if "schema_version" in tables:
        versions = conn.execute(sa.text("SELECT version FROM schema_version")).scalars().all()
        state.schema_version = versions[0] if versions else None
        if not versions and state.revision is None:
            state.version_row_missing = True
            state.schema_version = version_by_shape(state.columns)
    return state


#: SQLite's tables, triggers and views, with the statements of the full-text tables.
_SQLITE_OBJECTS = (
    "SELECT type, name, CASE WHEN name IN (?, ?) THEN sql END FROM sqlite_master "
    "WHERE type IN ('table', 'trigger', 'view') AND name NOT LIKE 'sqlite~_%' ESCAPE '~'"
)


def version_by_shape(columns: dict[str, set[str]]) -> int | None:
    """The original store's version whose tables have exactly ``columns`` (the oldest of
    versions that add no column, so the later one's index is made); None: none has."""
    found = None
    for version in range(ddl.HEAD_VERSION, 0, -1):
        shape = ddl.columns_at(version)
        if all(columns.get(table) == shape[table] for table in ("sessions", "messages")):
            found = version
    return found


def _check_search_path(conn: Connection) -> None:
    """Refuse a PostgreSQL connection whose search_path names no schema it can use (missing,
    or without USAGE for its role): it would see no tables, and creating them fails deep in
    a migration. Asked only when no table is visible, so an open at head pays nothing."""
    schema, search_path = conn.exec_driver_sql(
        "SELECT current_schema(), current_setting('search_path')"
    ).one()
    if schema is None:
        raise StoreConfigError(_no_schema_message(_describe(conn), str(search_path)))


def _check_server_encoding(conn: Connection) -> None:
    """Refuse a PostgreSQL database that is not UTF-8: a conversation holds any text (CJK,
    emoji), and a LATIN1 database refused such a message only when it came, long after the
    store opened. Read from the parameters the server sends as the connection starts: no
    round trip."""
    info = conn.connection.driver_connection.info  # type: ignore[union-attr]
    encoding = info.parameter_status("server_encoding")
    if encoding is not None and encoding != "UTF8":
        raise StoreConfigError(
            f"{_describe(conn)}: the database's encoding is {encoding}, which cannot hold "
            "every text a conversation may carry (CJK, emoji); the store needs a UTF8 "
            "database (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0; move rows "
            "over with hermes-store export and import)"
        )


def _no_schema_message(where: str, search_path: str | None) -> str:
    shown = f" ({search_path})" if search_path else ""
    return (
        f"{where}: no schema of its search_path{shown} exists or is usable by this role, so "
        "the store has nowhere to find or create its tables: create the schema (and grant "
        "the role USAGE and CREATE on it), or correct the search_path in the URL's options"
    )


def check_adoptable(state: DatabaseState, where: str) -> None:
    """Raise a clear error unless the database is empty, ours, or a known legacy version."""
    _refuse_stand_ins(state, where)
    version_type = type(state.schema_version)
    if state.schema_version is not None and version_type is not int:
        raise UnrecognizedSchemaError(
            f"{where} has a schema_version that is not a number "
            f"({state.schema_version!r}, {version_type.__name__}): not a Hermes state database"
        )
    if state.schema_version is not None and state.schema_version > ddl.HEAD_VERSION:
        raise SchemaTooNewError(
            f"{where} has schema_version {state.schema_version}; this hermes_store knows "
            f"versions up to {ddl.HEAD_VERSION}. Upgrade hermes_store to open it."
        )
    if state.revision is not None:
        if state.revision not in revisions.REVISIONS:
            raise SchemaTooNewError(
                f"{where} is at Alembic revision {state.revision!r}, which is not one of this "
                f"hermes_store's revisions ({revisions.REVISIONS[0]} .. {revisions.HEAD}): "
                "a newer hermes_store wrote it (upgrade hermes_store to open it), or another "
                "application's migrations did (give the store a database of its own)"
            )
        return
    if state.is_empty:
        return
    if state.schema_version is None and state.version_row_missing:
        shapes = "; ".join(
            f"{table}: {_some(state.columns[table], 4)}"
            if table in state.columns
            else f"no {table}"
            for table in ("sessions", "messages")
        )
        raise UnrecognizedSchemaError(
            f"{where} has a schema_version table without a row (the original store stopped "
            "while creating it?), and its tables have the shape of no version of the original "
            f"store ({shapes}): not a Hermes state database as it is; nothing was changed"
        )
    if state.schema_version is None:
        found = ", ".join(
            sorted(state.tables - ddl.UNMODELLED_TABLES - {state.version_table} | state.views)
        )
        raise UnrecognizedSchemaError(
            f"{where} holds tables ({found}) but no schema_version: not a Hermes state database"
        )
    version = state.schema_version
    if version < 1:
        raise UnrecognizedSchemaError(f"{where} has schema_version {version}, which never existed")
    _refuse_foreign_tables(state, where)
    if legacy_revision(state) is None:
        own = sorted(table for table, _ in OWN_TABLES if table in state.tables)
        raise UnrecognizedSchemaError(
            f"{where} holds hermes_store's own tables ({', '.join(own)}) at schema_version "
            f"{version} but no row in {state.version_table}, so its revision cannot be told. "
            f"Once you know it, store it as the one row of {state.version_table} (its "
            f"version_num column; "
            f"{revisions.HEAD} is this release's head, `hermes-store db history` lists them; "
            "a dropped table comes back as Alembic makes it: version_num varchar(32), the "
            "primary key), then open it"
        )
    need, allowed = ddl.columns_at(version), ddl.columns_at(ddl.HEAD_VERSION)
    for table in ("sessions", "messages"):
        have = state.columns.get(table)
        if have is None:
            raise UnrecognizedSchemaError(
                f"{where} says schema_version {version} but has no {table}"
            )
        missing, unknown = need[table] - have, have - allowed[table]
        if missing or unknown:
            raise UnrecognizedSchemaError(
                f"{where}: table {table} matches no schema version "
                f"(schema_version {version}; missing {sorted(missing)}, unknown {sorted(unknown)})"
            )


#: What the store keeps as tables, besides the version table.
_STORE_TABLES = ("schema_version", "sessions", "messages", ddl.FTS_TABLE, *dict(OWN_TABLES))


def _refuse_stand_ins(state: DatabaseState, where: str) -> None:
    """Refuse what stands where the store keeps its own objects and would make every
    statement on them fail: a view of one of its tables' names, several rows in the version
    table (Alembic cannot tell which one holds)."""
    views = sorted(state.views & {*_STORE_TABLES, state.version_table})
    if views:
        raise UnrecognizedSchemaError(
            f"{where} has a view named {', '.join(views)} where hermes_store keeps a table: "
            "not a Hermes state database as it is; nothing was changed. Drop or rename the "
            "view (another application's?), then open it"
        )
    if len(state.revision_rows) > 1:
        raise UnrecognizedSchemaError(
            f"{where}: its {state.version_table} holds {len(state.revision_rows)} rows "
            f"({', '.join(map(repr, state.revision_rows[:4]))}), where Alembic keeps one, so its "
            "revision cannot be told; nothing was changed. Keep the one row of the revision "
            f"the tables are at ({revisions.HEAD} is this release's head, `hermes-store db "
            "history` lists them), then open it"
        )


def _refuse_foreign_tables(state: DatabaseState, where: str) -> None:
    """Refuse a legacy file whose tables bear the names of this package's own objects without
    their shape (another application's), or whose ``messages_fts`` is not a full-text index
    the store can keep in step (a plain table, FTS4, an FTS5 table of its own content)."""
    foreign = foreign_tables(state)
    if foreign:
        described = "; ".join(
            f"{table} ({_some(state.columns[table], 4)})"
            if table in state.columns
            else f"{table} ({_first_line(state.definitions.get(table))})"
            for table in foreign
        )
        raise UnrecognizedSchemaError(
            f"{where} holds tables named as hermes_store's own but not made by it: "
            f"{described}; nothing was changed. Another application's tables: rename them "
            "or give the store a database of its own"
        )
    if ddl.FTS_TABLE in state.tables and not ddl.is_store_fts(state.definitions.get(ddl.FTS_TABLE)):
        raise UnrecognizedSchemaError(
            f"{where}: its {ddl.FTS_TABLE} is not the original store's full-text index (FTS5 "
            "over messages.content with content=messages, content_rowid=id); it is "
            f"{_first_line(state.definitions.get(ddl.FTS_TABLE))}. Nothing was changed. If it "
            f"holds nothing of yours, drop it and its triggers ({_DROP_FTS}) and open the "
            "file again: the index is rebuilt from the messages; else rename it"
        )


#: What a refusal of a foreign ``messages_fts`` advises (its triggers go with it).
_DROP_FTS = "DROP TABLE " + ddl.FTS_TABLE


def _first_line(sql: str | None) -> str:
    """A table's CREATE statement on one short line (a message quotes it)."""
    if sql is None:
        return "a plain table"
    flat = " ".join(sql.split())
    return flat if len(flat) <= 120 else flat[:117] + "..."


def check_recorded_tables(state: DatabaseState, where: str) -> None:
    """Refuse, before anything runs, a database behind head whose tables do not match its
    recorded revision: the revisions after it would fail half-way on them (tables dropped
    by hand, another application's ``sessions``, a table a later revision creates).

    Only on the way to an upgrade: ``stamp`` and ``downgrade`` stay free to fix the record.
    """
    recorded = state.revision
    if recorded is None or recorded == revisions.HEAD or recorded not in revisions.REVISIONS:
        return
    ran = revisions.up_to(recorded)
    version = max(v for v in range(1, ddl.HEAD_VERSION + 1) if revisions.for_version(v) in ran)
    need = ddl.columns_at(version)
    found: list[str] = []
    for table in ("sessions", "messages"):
        have = state.columns.get(table)
        if have is None:
            found.append(f"no {table} table")
        elif missing := need[table] - have:
            found.append(
                f"table {table} has columns {_some(have, 4)} and lacks {len(missing)} of "
                f"the {len(need[table])} it needs ({_some(missing, 3)})"
            )
    if version < ddl.HEAD_VERSION and "schema_version" not in state.tables:
        found.append("no schema_version table (the later versions update it)")
    # h7 makes messages_cjk IF NOT EXISTS: one already there is kept, so it must be its own.
    if ddl.CJK_TABLE in state.tables and not ddl.is_store_cjk(state.definitions.get(ddl.CJK_TABLE)):
        found.append(
            f"a {ddl.CJK_TABLE} table that is not the CJK index "
            f"({_first_line(state.definitions.get(ddl.CJK_TABLE))})"
        )
    creator = dict(OWN_TABLES)[write_keys_table.name]
    if write_keys_table.name in state.tables and creator not in ran:
        found.append(f"a {write_keys_table.name} table, which the later {creator} creates")
    if found:
        raise UnrecognizedSchemaError(
            f"{where} records revision {recorded!r}, but its tables do not match it: "
            f"{'; '.join(found)}. Nothing was changed. Another "
            "application's tables: give the store a database (or schema) of its own; tables "
            "dropped or changed by hand: restore them from a backup"
        )


def _some(names: set[str], shown: int) -> str:
    """A few of ``names``, sorted, and how many more (a message stays one short line)."""
    first = sorted(names)[:shown]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(first) + more


def _roll_back_hot_journal(path: Path) -> None:
    """A writer in rollback-journal mode killed mid-transaction (the original store's files can
    be in DELETE mode) left a hot journal: the file holds part of a transaction that never
    committed until SQLite rolls it back, and a read-only look (the probe below) is refused
    ("attempt to write a readonly database"). Any read-write SQLite open rolls it back, as the
    original store's next open would: done here, before the look, so the file is adopted with
    exactly what was committed. In a folder that cannot be written that is impossible:
    refused (:func:`refuse_hot_journal`)."""
    if not os.access(path.parent, os.W_OK):
        refuse_hot_journal(path)
        return
    if files.hot_journal(path) is None:
        return
    log.warning("%s: rolling back the hot journal a writer killed mid-transaction left", path)
    connection = files.connect_sqlite(path, timeout=READER_BUSY_TIMEOUT_S)
    try:
        connection.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as error:
        raise NotADatabaseError(
            f"{path}: the hot journal a writer left could not be rolled back: {error}"
        ) from error
    finally:
        connection.close()


def preflight_sqlite(path: Path, *, adoptable: bool = True) -> DatabaseState | None:
    """Refuse files that are not adoptable, reading them only (None: the file does not exist).
    With ``adoptable=False`` a readable database's state is returned whatever its schema (a
    newer release's file included), for reports.

    The file is only ``stat``-ed and read through SQLite, never with a plain file handle:
    closing one would drop the SQLite locks this process's live connections hold on it.
    """
    where = str(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise NotADatabaseError(f"{where} cannot be examined: {error.strerror or error}") from error
    if stat.S_ISDIR(info.st_mode):
        raise NotADatabaseError(f"{where} is a directory, not a SQLite database")
    if not stat.S_ISREG(info.st_mode):  # /dev/null would read as an empty file
        kind = files.kind_of(info.st_mode) or "not a regular file"
        raise NotADatabaseError(f"{where} is {kind}, not a SQLite database")
    if info.st_size == 0:
        raise NotADatabaseError(f"{where} is an empty file (0 bytes), not a SQLite database")
    if not os.access(path, os.R_OK):
        raise AccessDeniedError(
            f"permission denied opening the database: {where} belongs to uid {info.st_uid} "
            f"(mode {stat.S_IMODE(info.st_mode):o})"
        )
    _roll_back_hot_journal(path)
    quiet = not files.sidecars(path)
    before = _signature(path)
    try:
        state = _probe(path, immutable=quiet)
        if quiet and (files.sidecars(path) or _signature(path) != before):
            # Another process opened (and may have written) the file while it was read
            # without locks: that read may be torn, so read it again, properly.
            state = _probe(path, immutable=False)
    except sa.exc.DBAPIError as error:
        if not (quiet and files.sidecars(path)):
            raise _unreadable(where, info.st_size, error) from error
        # Another process opened the file while it was read without locks: read it properly.
        try:
            state = _probe(path, immutable=False)
        except sa.exc.DBAPIError as again:
            raise _unreadable(where, info.st_size, again) from again
    if adoptable:
        try:
            check_adoptable(state, where)
        except SchemaError:
            if not quiet:
                raise
            # Read without locks, the state may still be torn: a writer that migrated the file
            # and checkpointed it within one tick of the file's timestamps leaves its inode,
            # size and mtime as they were (columns of v3, schema_version 6). A refusal stands
            # only when a second read says so too.
            state = _probe(path, immutable=not files.sidecars(path))
            check_adoptable(state, where)
    return state


def _unreadable(where: str, size: int, error: sa.exc.DBAPIError) -> NotADatabaseError:
    if getattr(error.orig, "sqlite_errorname", None) == "SQLITE_NOTADB":
        return NotADatabaseError(
            f"{where} is not a SQLite database ({size:,} bytes without a SQLite header)"
        )
    return NotADatabaseError(f"{where} is not a readable SQLite database: {error.orig}")


def _signature(path: Path) -> tuple[int, int, int]:
    """Inode, size and modification time: a change means another process wrote meanwhile."""
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _probe(path: Path, *, immutable: bool) -> DatabaseState:
    """Read the state without writing. A read-only connection to a WAL file still creates
    -wal and -shm and cannot remove them again, so a file nobody has open (no sidecar files)
    is read with ``immutable=1``, which touches nothing: a refused file is left as it was.
    Either way it is a SQLite connection, whose close keeps this process's other locks."""
    params = {"immutable": "1"} if immutable else {"mode": "ro"}
    probe = sa.create_engine(files.sqlite_uri(path, **params), poolclass=NullPool)
    try:
        with probe.connect() as conn:
            return read_state(conn)
    finally:
        probe.dispose()


# -- changing it ----------------------------------------------------------------------------------


def adopt(conn: Connection) -> DatabaseState:
    """Inside a write transaction: validate, and stamp a legacy file with its revision."""
    state = read_state(conn)
    check_adoptable(state, _describe(conn))
    if state.is_legacy and state.schema_version is not None:
        revision = legacy_revision(state)
        assert revision is not None  # check_adoptable refused it otherwise
        log.info(
            "adopting a legacy database at schema_version %s as %s", state.schema_version, revision
        )
        _migration_context(conn).stamp(revisions.scripts(), revision)
        if state.version_row_missing:
            # What the original store does on opening such a file: it writes the row.
            conn.execute(
                sa.text("INSERT INTO schema_version (version) VALUES (:v)"),
                {"v": state.schema_version},
            )
        # The original store always created the FTS objects and title index; put back any that
        # are gone.
        if conn.dialect.name == "sqlite":
            had_fts = ddl.FTS_TABLE in state.tables
            started = time.monotonic()
            fill = not had_fts or not fulltext.SQLITE.covers_messages(conn)
            fulltext.SQLITE.create_main(conn, fill=fill)
            if fill:
                log.info(
                    "built the full-text index of the adopted file in %.2f s (under the write "
                    "lock: other writers waited behind its heartbeat)",
                    time.monotonic() - started,
                )
        state.revision = revision
    return state


def _describe(conn: Connection) -> str:
    return display_url(conn.engine.url)


@contextmanager
def migration_connection(
    target: Target, *, retry: RetryPolicy | None = None
) -> Iterator[Connection]:
    """One connection holding the write lock, foreign keys off (SQLite rebuilds tables).

    Waiting for the lock is retried with the store's jittered policy (each attempt waits up to
    the writer's busy timeout), so opening a file while another process writes never fails
    before the writes' own retries would; how long the lock was then held is logged.

    On a SQLite file the migration first takes a turn in the fair writer queue, as every write
    does (see :func:`_queues`; a legacy file's first adoption creates the lock file): it
    neither overtakes the writers already in line nor makes them fall back to SQLite's busy
    handler. As the queue's head it asks for the lock with the head's short busy timeout, and
    while it runs it beats every 0.2 s, so the writers and openers behind it keep waiting in
    the kernel instead of spending their retries. An adoption holds the lock in one piece (the
    stamp, the revisions and the full-text rebuild commit together, so a file is either
    untouched or at head): about 3 s for 450,000 messages on a quiet 2-core machine, 15-25 s
    when it is loaded (``bench/adoption.py``); the time is logged. Those behind it wait as long
    as it beats, and give up on a fixed budget only once it has stopped (see
    :func:`_begin_migration`).
    """
    url = target.url if isinstance(target, Engine) else to_url(target)
    placement.current().check_dialect(url.get_backend_name())  # before a file is created
    path = sqlite_file(url)
    if path is not None:
        refuse_sqlite_aliases(url, target)  # before any read (see SessionDB's opening)
        remove_stale_temps(path)
    state = preflight_sqlite(path) if path is not None else None
    created = path is not None and state is None and create_private_file(path)
    engine = create_engine(url, foreign_keys=False, poolclass=NullPool, **same_connection(target))
    # Attached until the end (detached below: the last user closes its descriptors).
    queue = writequeue.attach(path) if path is not None and _queues(path, state) else None
    place = queue.turn() if queue else NOTHING_HELD
    try:
        with _lock_errors(url), mapped_errors(), place as turn:
            line = queue.progress if queue is not None and queue.enabled else None
            conn, transaction = _begin_migration(engine, retry or RetryPolicy(), turn, line)
            locked_at = time.monotonic()
            with conn, transaction:
                if turn is not None and turn.queued:
                    _beat_while_running(conn, turn)
                if conn.dialect.name == "postgresql":
                    # SQLite's BEGIN IMMEDIATE serialises migrations; PostgreSQL needs a lock
                    # of its own, or processes opening one new database at once all run v1.
                    conn.execute(
                        sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK}
                    )
                    placement.create_schema(conn, placement.of(conn))
                yield conn
            log.info(
                "%s: migration committed; it held the write lock for %.2f s",
                _describe_url(url),
                time.monotonic() - locked_at,
            )
    except BaseException:
        place.release()  # an interrupt (Ctrl-C) as the place was given or its with ended
        if created and path is not None and path.stat().st_size == 0:
            path.unlink()  # leave no empty file behind: it would be refused next time
        raise
    finally:
        engine.dispose()
        if queue is not None:
            writequeue.detach(queue)


def _queues(path: Path, state: DatabaseState | None) -> bool:
    """Whether a migration of ``path`` takes a turn in the writer queue (creating its lock file).

    Where the lock file exists, always. Otherwise only for a file that holds tables (a legacy
    file being adopted, one at an older revision): the processes opening such a file at once
    must line up behind the one that migrates it, which beats while it works, instead of each
    spending a fixed retry budget on SQLite's lock while an index rebuild may outlast it. Its
    writers create the lock file at their first write anyway. A new or empty file, and a file
    :func:`preflight_sqlite` refused, are left without a lock file beside them.
    """
    if Path(f"{path}{files.WRITER_LOCK_SUFFIX}").exists():
        return True
    return state is not None and not state.is_empty


def _begin_migration(
    engine: Engine,
    retry: RetryPolicy,
    turn: writequeue.Turn | None = None,
    line: Callable[[], bytes] | None = None,
) -> tuple[Connection, sa.RootTransaction]:
    """A connection with its write transaction begun, waiting for the lock as writes do.

    The queue's head asks with short busy timeouts and beats, within the writes' overall
    budget (``attempts`` x (busy timeout + longest pause)). A waiter outside the line (its
    turn fell back: the line stood still for the queue's bounded wait, e.g. an adopter starved
    of CPU between two statements) that can watch the line (``line``: the queue's progress
    marks) gives up only once the line has not moved for that same budget: a head that is
    alive and working (an adoption rebuilding a big index beats every 0.2 s) is waited for
    however long its work takes, while one that stopped (SIGSTOP, hung) is given up on after
    the budget, as before, and a dead one lets go of SQLite's lock (the kernel drops it). With
    neither a turn nor a line (no queue), the writes' fixed retry policy applies.
    """
    waits = retry.waits()
    head = turn is not None and turn.queued
    budget = retry.attempts * (WRITER_BUSY_TIMEOUT_S + retry.max_wait)
    deadline: float | None = None
    seen: bytes | None = None
    busy_ms = int(QUEUE_HEAD_BUSY_TIMEOUT_S * 1000) if head else None
    while True:
        conn = engine.connect()
        conn.execution_options(**{WRITE_OPTION: True, BUSY_OPTION: busy_ms})
        try:
            return conn, conn.begin()
        except sa.exc.DBAPIError as error:
            conn.close()
            if not is_retryable(error):
                raise
            delay: float | None
            now = time.monotonic()
            if head:
                assert turn is not None
                if deadline is None:
                    deadline = now + budget
                if now >= deadline:
                    raise
                turn.still_trying()
                delay = random.uniform(retry.min_wait, retry.max_wait)
            elif line is not None:
                moved = line()
                if moved != seen:
                    seen, deadline = moved, now + budget
                if deadline is not None and now >= deadline:
                    raise
                delay = random.uniform(retry.min_wait, retry.max_wait)
            else:
                delay = next(waits, None)
            if delay is None:
                raise
            log.debug("migration waits for the write lock (%s); retrying in %.0f ms",
                      error.orig, delay * 1000)  # fmt: skip
            time.sleep(delay)


def _beat_while_running(conn: Connection, turn: writequeue.Turn) -> None:
    """Tell the writer queue, every 0.2 s of a long migration step, that the line is moving
    (SQLite's progress handler runs inside the statements; the connection is the migration's
    own and closed after it)."""
    last = time.monotonic()

    def beat() -> int:
        nonlocal last
        now = time.monotonic()
        if now - last >= 0.2:
            last = now
            turn.still_trying()
        return 0  # go on

    conn.connection.driver_connection.set_progress_handler(beat, 20_000)  # type: ignore[union-attr]


@contextmanager
def _lock_errors(url: sa.URL) -> Iterator[None]:
    """A migration that cannot get the write lock in time fails as DatabaseLockedError."""
    try:
        yield
    except sa.exc.DBAPIError as error:
        if not is_retryable(error):
            raise
        raise DatabaseLockedError(
            f"{_describe_url(url)} stayed locked by another writer; its schema could not be "
            f"brought to head ({error.orig})"
        ) from error


# -- damage on a database Alembic says is at head ------------------------------------------------


def find_damage(state: DatabaseState, dialect: str, where: str) -> list[str]:
    """What must be repaired on a database whose Alembic revision is head (empty: nothing).

    Runs on every open, on the state already read (no further query). Raises
    :class:`UnrecognizedSchemaError` for damage the data cannot repair (columns or tables gone).
    """
    want = ddl.columns_at(ddl.HEAD_VERSION)
    for table in ("sessions", "messages"):
        have = state.columns.get(table)
        if have is None:
            raise UnrecognizedSchemaError(
                f"{where} is at Alembic revision {state.revision!r} but has no {table} table; "
                "it cannot be repaired (restore it from a backup)"
            )
        missing = want[table] - have
        if missing:
            raise UnrecognizedSchemaError(
                f"{where} is at Alembic revision {state.revision!r} but table {table} lacks "
                f"columns {sorted(missing)}; it cannot be repaired (restore it from a backup)"
            )
    damage: list[str] = []
    if state.schema_version != ddl.HEAD_VERSION:
        damage.append(f"schema_version {state.schema_version} (Alembic is at head)")
    if write_keys_table.name not in state.tables:
        damage.append(f"the {write_keys_table.name} table is missing (idempotency keys)")
    damage += fulltext.for_dialect(dialect).damage(
        state.tables, state.triggers, state.indexes, state.columns["messages"]
    )
    return damage


def damage_of(state: DatabaseState, where: str) -> tuple[list[str], bool]:
    """What :func:`find_damage` finds on a database at head, for a report: the damage, and
    whether the next open repairs it from the data (False: columns or tables are gone)."""
    try:
        return find_damage(state, state.dialect, where), True
    except UnrecognizedSchemaError as error:
        return [str(error)], False


def repair_at_head(conn: Connection) -> list[str]:
    """Inside a write transaction: repair what :func:`find_damage` reports, from the data.

    Re-reads the state under the lock (another process may have repaired it meanwhile) and
    logs a WARNING naming every repair. Returns what was repaired (empty: nothing was wrong).
    """
    state = read_state(conn)
    if state.revision != head_revision():
        return []
    where = _describe(conn)
    damage = find_damage(state, conn.dialect.name, where)
    if not damage:
        return []
    done: list[str] = []
    if state.schema_version != ddl.HEAD_VERSION:
        if "schema_version" not in state.tables:
            conn.exec_driver_sql("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.exec_driver_sql("DELETE FROM schema_version")
        conn.execute(
            sa.text("INSERT INTO schema_version (version) VALUES (:v)"), {"v": ddl.HEAD_VERSION}
        )
        done.append(f"set schema_version from {state.schema_version} to {ddl.HEAD_VERSION}")
    if write_keys_table.name not in state.tables:
        # Recreated empty: the keys it held only stopped re-sent writes.
        write_keys_table.create(conn)
        done.append(f"created the missing {write_keys_table.name} table")
    done += fulltext.of(conn).repair(
        conn, state.tables, state.triggers, state.indexes, state.columns["messages"]
    )
    log.warning("%s was damaged and has been repaired: %s", where, "; ".join(done))
    return done


def repair(target: Target, *, retry: RetryPolicy | None = None) -> list[str]:
    """Repair a damaged database at head under the write lock (see :func:`repair_at_head`)."""
    with migration_connection(target, retry=retry) as conn:
        return repair_at_head(conn)


def read_engine(target: Target) -> Engine:
    """An engine for read-only commands (``current``, ``check``, the doctor, analytics) on an
    existing database. A SQLite file in a folder this process cannot write, without a ``-wal``
    file, is read ``immutable``, as the store opens it (SQLite could not create the ``-shm`` a
    WAL read needs there): :func:`reads_immutable` tells."""
    url = target.url if isinstance(target, Engine) else to_url(target)
    path = sqlite_file(url)
    if path is not None:
        if preflight_sqlite(path) is None:
            raise NotADatabaseError(f"there is no database at {path}")
        if unreadable_in_wal(path):
            url = files.sqlite_uri(path, mode="ro", immutable="1")
        return sa.create_engine(url, poolclass=NullPool)
    return create_engine(url, poolclass=NullPool, **same_connection(target))


def reads_immutable(engine: Engine) -> bool:
    """Whether a :func:`read_engine` reads its SQLite file ``immutable`` (no locks, no journal
    mode to ask about)."""
    return engine.url.query.get("immutable") == "1"


def upgrade(
    target: Target, revision: str = "head", *, retry: RetryPolicy | None = None
) -> str | None:
    """Bring ``target`` (a path, URL or Engine) to ``revision``, adopting a legacy file first."""
    from alembic import command

    revision = resolve_revision(revision)
    with _connect_refusals(), migration_connection(target, retry=retry) as conn:
        where = _describe(conn)
        state = read_state(conn)  # under the lock: what the revisions will run on
        check_recorded_tables(state, where)
        with _unexpected_tables(where, state.revision), ALEMBIC_COMMANDS:
            command.upgrade(alembic_config(conn), revision)
        reached = _current_revision(conn)
        if reached == head_revision():
            repair_at_head(conn)
        return reached


#: SQLSTATEs of a revision's statement that met tables other than the ones it was written for:
#: undefined table, column; duplicate table, column, object (a trigger, an index).
_SHAPE_SQLSTATES = frozenset({"42P01", "42703", "42P07", "42701", "42710"})
#: SQLite says the same in words only (and "... already exists").
_SQLITE_SHAPE = ("no such table", "no such column", "duplicate column name")
#: SQLSTATE invalid_schema_name: no schema on the search_path to create the tables in.
_NO_SCHEMA_SQLSTATE = "3F000"


@contextmanager
def _unexpected_tables(where: str, recorded: str | None) -> Iterator[None]:
    """Around the revisions of an upgrade: a statement that fails because the tables are not
    what the recorded revision says raises :class:`UnrecognizedSchemaError` (a missing
    schema :class:`StoreConfigError`), not the raw driver error. What
    :func:`check_recorded_tables` cannot see beforehand lands here; the upgrade's
    transaction is rolled back either way."""
    from_where = f"from its recorded revision {recorded!r}" if recorded else "from an empty schema"
    try:
        yield
    except sa.exc.NoSuchTableError as error:  # a revision's inspection of a missing table
        raise UnrecognizedSchemaError(
            f"{where} cannot be upgraded {from_where}: table {error} does not exist; "
            "nothing was changed"
        ) from error
    except sa.exc.DBAPIError as error:
        orig = error.orig
        sqlstate = getattr(orig, "sqlstate", None)
        first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        if sqlstate == _NO_SCHEMA_SQLSTATE:
            raise StoreConfigError(_no_schema_message(where, None)) from error
        shape = sqlstate in _SHAPE_SQLSTATES or (
            isinstance(orig, sqlite3.OperationalError)
            and (first.startswith(_SQLITE_SHAPE) or first.endswith("already exists"))
        )
        if not shape:
            raise
        raise UnrecognizedSchemaError(
            f"{where}: upgrading it {from_where} failed on its tables ({first}); nothing was "
            "changed. They are not the ones that revision leaves (changed by hand, or another "
            "application's): restore them from a backup, or give the store a database (or "
            "schema) of its own"
        ) from error


@contextmanager
def _connect_refusals() -> Iterator[None]:
    """A driver error raised while connecting (no statement was sent) that the package has no
    name for is a target the driver refuses as configured (psycopg's "invalid connection
    option" for an unknown URL parameter): :class:`StoreConfigError`, not the raw error."""
    try:
        yield
    except sa.exc.DBAPIError as error:
        if error.statement is not None or translate(error) is not None or is_retryable(error):
            raise
        raise StoreConfigError(
            f"the database cannot be opened as configured: {error.orig}"
        ) from error


@dataclass(frozen=True)
class Revision:
    """One revision of the schema, as ``hermes-store db history`` lists it."""

    revision: str
    down_revision: str | None
    description: str
    current: bool
    head: bool


def history(target: Target | None = None) -> list[Revision]:
    """Every revision, oldest first; ``current`` marks the one ``target`` is at (none when
    it cannot be read, or without a target)."""
    at: str | None = None
    if target is not None:
        with contextlib.suppress(HermesStoreError):
            at = current(target)
    scripts = revisions.scripts()
    head = scripts.get_current_head()
    return [
        Revision(
            revision=script.revision,
            down_revision=script.down_revision,  # type: ignore[arg-type]
            description=(script.doc or "").strip().splitlines()[0] if script.doc else "",
            current=script.revision == at,
            head=script.revision == head,
        )
        for script in reversed(list(scripts.walk_revisions()))
    ]


def upgrade_sql(target: Target, revision: str = "head", *, start: str | None = None) -> str:
    """The SQL that upgrades ``target`` from ``start`` to ``revision``, without connecting to
    it (Alembic's offline mode, ``--sql``), for a DBA to review or run. The backend comes from
    the URL; ``start`` defaults to the database's own revision when it can be read, else base.
    """
    from alembic import command
    from alembic.util import CommandError

    if start is None and ":" in revision:  # Alembic's START:END
        start, _, revision = revision.partition(":")
    if ":" in revision or (start and ":" in start):
        raise CommandError(f"{start}:{revision} is no range: give START:END")
    start = resolve_revision(start) if start else None
    revision = resolve_revision(revision)
    url = target.url if isinstance(target, Engine) else to_url(target)
    placement.current().check_dialect(url.get_backend_name())
    buffer = io.StringIO()
    config = alembic_config()
    config.output_buffer = buffer
    config.attributes["url"] = url
    destination = f"{start}:{revision}" if start else revision
    with ALEMBIC_COMMANDS:
        command.upgrade(config, destination, sql=True)
    return buffer.getvalue()


def downgrade(target: Target, revision: str) -> str | None:
    """Step ``target`` down to ``revision`` (``base`` removes every table)."""
    from alembic import command

    revision = resolve_revision(revision)
    with migration_connection(target) as conn:
        with ALEMBIC_COMMANDS:
            command.downgrade(alembic_config(conn), revision)
        return _current_revision(conn)


def stamp(target: Target, revision: str) -> None:
    """Record ``revision`` as ``target``'s without running anything."""
    from alembic import command

    revision = resolve_revision(revision)
    with migration_connection(target) as conn, ALEMBIC_COMMANDS:
        command.stamp(alembic_config(conn), revision)


def current(target: Target) -> str | None:
    """The Alembic revision of ``target``; for an unadopted legacy file, its matching revision.

    Reads only: never takes the write lock and never changes the file.
    """
    return revision_of(state_of(target))


def _describe_url(url: sa.URL) -> str:
    return display_url(url)


def _current_revision(conn: Connection) -> str | None:
    return _migration_context(conn).get_current_revision()


def ensure_head(target: Engine | sa.URL, *, retry: RetryPolicy | None = None) -> None:
    """Open-time check: read the version without locking; migrate only when behind, repair
    (under the write lock) only when damaged.

    Several processes open the same file at once, so the common case (already at head) must
    not queue for the write lock; the upgrade itself re-checks under the lock, and waits for
    it with the writes' retry policy. ``target`` is an Engine, or a SQLite file's URL.
    """
    url = target.url if isinstance(target, Engine) else target
    path = sqlite_file(url)
    where = _describe_url(url)
    with open_errors(path or where):
        if path is None:
            assert isinstance(target, Engine), "ensure_head takes an Engine for servers"
            with mapped_errors(), target.connect() as conn:
                state = read_state(conn)
                # Only a server can be a standby (an in-memory SQLite database reaches here too).
                if target.dialect.name == "postgresql" and opened_read_only(conn, state, where):
                    return
            check_adoptable(state, where)
            _reach_head(target, state, where, where, url.get_backend_name(), retry)
        elif path.exists():
            _reach_head_of_file(target, path, where, retry, created_meanwhile=False)
        elif not _create_sqlite_at_head(path):
            _reach_head_of_file(target, path, where, retry, created_meanwhile=True)


#: How long an opener whose new file lost the race to another process's waits for that
#: process to finish creating its own: the original store creates its tables one statement
#: at a time, so its file is for a moment empty, or holds some of them.
CREATION_GRACE_S = 5.0


def _reach_head_of_file(
    target: Engine | sa.URL,
    path: Path,
    where: str,
    retry: RetryPolicy | None,
    *,
    created_meanwhile: bool,
) -> None:
    """Bring an existing SQLite file to head. One another process created meanwhile (it won
    the race to the path) is opened the same way, under the same lock, whoever made it: a
    file of the original store is adopted. Until its creator is done it may look empty or
    unknown: it is looked at again for a while before it is refused."""
    deadline = time.monotonic() + CREATION_GRACE_S
    while True:
        try:
            _reach_head(target, preflight_sqlite(path), str(path), where, "sqlite", retry)
            return
        except (NotADatabaseError, UnrecognizedSchemaError) as error:
            if not created_meanwhile or time.monotonic() >= deadline:
                raise
            log.debug("%s, created by another process meanwhile, is not ready: %s", path, error)
            time.sleep(0.05)


def _reach_head(
    target: Engine | sa.URL,
    state: DatabaseState | None,
    where: str,
    url_where: str,
    dialect: str,
    retry: RetryPolicy | None,
) -> None:
    """Migrate a database whose state was read and checked only when behind head; repair
    one at head only when damaged."""
    if state is not None and state.revision == head_revision():
        # At head: repair only when something is wrong, so a sound database takes no lock.
        if find_damage(state, dialect, url_where):
            repair(target, retry=retry)
        return
    if state is not None:  # refused before the write lock is taken
        check_recorded_tables(state, where)
    upgrade(target, "head", retry=retry)


def opened_read_only(conn: Connection, state: DatabaseState, where: str) -> bool:
    """On a server that refuses writes (a standby, ``default_transaction_read_only``): never
    migrate or repair, which could only fail there. At head the store opens read-only, saying
    so, and True is returned; behind head it is refused with :class:`SchemaBehindError`
    (migrations run on the primary, and its standbys follow). False on a writable server."""
    standby, read_only_default = conn.exec_driver_sql(
        "SELECT pg_is_in_recovery(), current_setting('default_transaction_read_only') = 'on'"
    ).one()
    reason = read_only_reason(standby=standby, read_only_default=read_only_default)
    if reason is None:
        return False
    check_adoptable(state, where)
    head = head_revision()
    if state.revision != head or state.is_legacy:
        found = state.revision or (
            f"the original store's schema_version {state.schema_version}"
            if state.is_legacy
            else "no schema"
        )
        raise SchemaBehindError(
            f"{where} is at {found}, behind {head}, and it cannot be migrated here: {reason}. "
            "Run `hermes-store db upgrade` against the primary; its standbys follow"
        )
    damage = find_damage(state, conn.dialect.name, where)
    if damage:
        log.warning(
            "%s needs repairs that a read-only server cannot make (%s): run "
            "`hermes-store db upgrade` against the primary",
            where,
            "; ".join(damage),
        )
    log.warning("%s: opened read-only, writes will be refused: %s", where, reason)
    return True


def check_head(target: Engine | sa.URL) -> None:
    """Refuse, changing nothing, a database that is not at head (``migrate="check"``): a
    missing file, a legacy file, or one at an older revision. Reads without any lock."""
    head = head_revision()
    url = target.url if isinstance(target, Engine) else target
    path = sqlite_file(url)
    where = str(path) if path is not None else _describe_url(url)
    with open_errors(where):
        if path is not None:
            state = preflight_sqlite(path)
            if state is None:
                raise NotADatabaseError(
                    f"there is no database at {path} (`hermes-store db upgrade` creates one)"
                )
        else:
            assert isinstance(target, Engine), "check_head takes an Engine for servers"
            with mapped_errors(), target.connect() as conn:
                state = read_state(conn)
            check_adoptable(state, where)
    if state.revision != head:
        check_recorded_tables(state, where)  # `db upgrade` would refuse it: say why now
        found = state.revision or (
            f"the original store's schema_version {state.schema_version}"
            if state.is_legacy
            else "no schema"
        )
        behind = f"{where} is at {found}, behind {head}; it was opened without migrating: "
        raise SchemaBehindError(
            behind + 'run `hermes-store db upgrade` (or open it with migrate="auto")'
        ).with_cli_message(behind + "run `hermes-store db upgrade`")


def _create_sqlite_at_head(path: Path) -> bool:
    """Build a new file beside ``path`` and link it into place, so a path either does not
    exist or holds a complete database whatever other processes do meanwhile. False when
    another process created ``path`` first: that file may be anything (the original store's,
    or one it is still creating), and is opened as any existing file is."""
    from alembic import command

    make_private_dirs(path.parent)
    remove_stale_temps(path)
    temp = files.partial_path(path, "new")
    if not create_private_file(temp):  # a random name: planted (a link?) or left
        raise UnsafePathError(f"{temp} exists already: no database is built through it")
    try:
        _format_incremental(temp)
        engine = create_engine(temp, poolclass=NullPool)
        try:
            with mapped_errors(), engine.connect() as conn:
                conn.execution_options(**{WRITE_OPTION: True})
                with conn.begin(), ALEMBIC_COMMANDS:
                    command.upgrade(alembic_config(conn), "head")
        finally:
            engine.dispose()
        _close_wal(temp)
        try:
            os.link(temp, path)
        except FileExistsError:
            log.debug("%s was created by another process meanwhile", path)
            return False
        return True
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{temp}{suffix}").unlink(missing_ok=True)


def _format_incremental(path: Path) -> None:
    """Write the empty file's first page with ``auto_vacuum=INCREMENTAL``, so ``db optimize``
    can hand freed pages back in short steps instead of only by rewriting the whole file.

    It must come first: the page size and this setting are fixed once the first page exists
    (switching to WAL writes it). The setting lives in the file's header; the original store
    reads and writes such a file as any other.
    """
    plain = sa.create_engine(files.sqlite_uri(path), poolclass=NullPool)
    try:
        with mapped_errors(), plain.connect() as conn:
            conn.exec_driver_sql("PRAGMA auto_vacuum = INCREMENTAL")
            conn.exec_driver_sql("PRAGMA journal_mode = WAL")
    finally:
        plain.dispose()


#: A database is created in well under a second: a temporary file this old whose creator is
#: gone was left by a process that was killed (or lost power) while creating it.
STALE_TEMP_AFTER_S = 3600.0


def remove_stale_temps(path: Path, *, older_than: float = STALE_TEMP_AFTER_S) -> list[Path]:
    """Delete what killed creators and importers left beside ``path``: ``.NAME.PID.HEX.new``
    and ``.NAME.PID.HEX.import`` (with their side files) whose process no longer exists on
    this machine AND that are older than ``older_than`` seconds (see
    :func:`files.remove_dead_partials`); ``.NAME.HEX.new``, the name of older releases, has no
    pid: only the age applies. Anything else is never touched."""
    return files.remove_dead_partials(path, files.LINKED_KINDS, older_than=older_than)


def _close_wal(path: Path) -> None:
    """Fold the WAL into the main file so the file alone is the whole database."""
    with closing(sqlite3.connect(path)) as raw:
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")


# -- what the ``db`` commands report ---------------------------------------------------------


def state_of(target: Target, *, adoptable: bool = True) -> DatabaseState | None:
    """The database's tables and versions, read without any lock (None: no such file).

    A schema this release cannot open is refused unless ``adoptable`` is False, which describes
    a newer release's file instead (for reports).
    """
    url = target.url if isinstance(target, Engine) else to_url(target)
    path = sqlite_file(url)
    if path is not None:
        with open_errors(path):  # a full disk is not "an unreadable file"
            return preflight_sqlite(path, adoptable=adoptable)
    engine = read_engine(target)
    try:
        with mapped_errors(), engine.connect() as conn:
            state = read_state(conn)
    finally:
        engine.dispose()
    if adoptable:
        check_adoptable(state, _describe_url(url))
    return state


def revision_of(state: DatabaseState | None) -> str | None:
    """The revision a database is at: a legacy file's is its schema_version's revision."""
    if state is None:
        return None
    if state.revision is not None:
        return state.revision
    if state.is_legacy and state.schema_version is not None:
        return legacy_revision(state)
    return None


@dataclass(frozen=True)
class UpgradeReport:
    """What :func:`run_upgrade` did (``hermes-store db upgrade``)."""

    #: The revision before (a legacy file's: its schema_version's); None: no schema yet.
    before: str | None
    #: The revision reached.
    after: str | None
    #: The original store's schema_version of a file this upgrade adopted, else None.
    adopted_version: int | None


def run_upgrade(
    target: Target, revision: str = "head", *, retry: RetryPolicy | None = None
) -> UpgradeReport:
    """:func:`upgrade`, saying where the database started and whether a file written by the
    original store was adopted on the way. What is refused is refused before the upgrade,
    by the lock-free read of the starting point."""
    before = state_of(target)  # upgrade() checks the revision before it takes any lock
    after = upgrade(target, revision, retry=retry)
    adopted = before.schema_version if before is not None and before.is_legacy else None
    return UpgradeReport(before=revision_of(before), after=after, adopted_version=adopted)


@dataclass(frozen=True)
class DriftReport:
    """What :func:`check_drift` found (``hermes-store db check``)."""

    #: A schema is there (False: no database, or one without this package's tables).
    exists: bool
    #: Where the database is (a legacy file: its schema_version's revision), and head.
    revision: str | None
    head: str
    #: Whether it was compared with the models: only a database at head is (a legacy file at
    #: the original store's last version counts: it is at head once adopted).
    compared: bool = False
    #: Alembic's account of the differences; None when there are none (or not compared).
    differences: str | None = None

    @property
    def drifted(self) -> bool:
        return self.differences is not None


def check_drift(target: Target) -> DriftReport:
    """Compare the database's tables with the models (Alembic's ``check``), changing nothing.

    A legacy file is adopted (and this package's later revisions applied) inside a transaction
    that is rolled back: the comparison sees what an upgrade makes of it, and the file is left
    as it was. A database behind head is not compared (``compared`` is False): its differences
    are the revisions it lacks.
    """
    from alembic import command
    from alembic.util import AutogenerateDiffsDetected

    state = state_of(target)
    head = head_revision()
    revision = revision_of(state)
    if state is None or state.is_empty:
        return DriftReport(exists=False, revision=revision, head=head)
    # A legacy file at the original store's last version is current for it; this package's
    # own later revisions (the CJK index) are applied in the rolled-back transaction below.
    current_legacy = state.is_legacy and state.schema_version == ddl.HEAD_VERSION
    if revision != head and not current_legacy:
        return DriftReport(exists=True, revision=revision, head=head)
    url = target.url if isinstance(target, Engine) else to_url(target)
    engine = create_engine(url, foreign_keys=False, poolclass=NullPool, **same_connection(target))
    differences: str | None = None
    try:
        with _lock_errors(url), mapped_errors():
            if state.is_legacy:  # adopted (then rolled back): waits for the lock as migrations do
                conn, transaction = _begin_migration(engine, RetryPolicy())
            else:
                conn = engine.connect()
                transaction = conn.begin()
        with mapped_errors(), conn:
            try:
                adopt(conn)
                config = alembic_config(conn)
                config.stdout = io.StringIO()
                if current_legacy:
                    with ALEMBIC_COMMANDS:
                        command.upgrade(config, "head")
                with ALEMBIC_COMMANDS:
                    command.check(config)
            except AutogenerateDiffsDetected as error:
                differences = str(error)
            finally:
                transaction.rollback()
    finally:
        engine.dispose()
    if not state.is_legacy:  # what the models do not describe: the index, write_keys ...
        damage, _ = damage_of(state, display_url(url))
        if damage:
            differences = "\n".join([*filter(None, [differences]), *damage])
    return DriftReport(
        exists=True, revision=revision, head=head, compared=True, differences=differences
    )
