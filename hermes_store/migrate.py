"""Programmatic migrations and the adoption of ``state.db`` files written by the original store.

The original store tracks its schema in ``schema_version`` (1..6) and knows nothing of Alembic.
Such a file is *adopted*: its tables are checked against that version (a file may already carry
columns of later versions: the revisions skip what exists), it is stamped with the matching
revision and upgraded, all in one write transaction. Anything that is not a database, or whose
shape or version this package does not know, is refused before a single byte is written.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from hermes_store import ddl
from hermes_store.engine import (
    WRITE_OPTION,
    Target,
    create_engine,
    create_private_file,
    sqlite_file,
    to_url,
)
from hermes_store.errors import (
    DatabaseLockedError,
    NotADatabaseError,
    SchemaTooNewError,
    UnrecognizedSchemaError,
    is_retryable,
    mapped_errors,
)
from hermes_store.uow import RetryPolicy

log = logging.getLogger(__name__)

SQLITE_HEADER = b"SQLite format 3\x00"
#: Key of the transaction-level advisory lock that serialises migrations on PostgreSQL.
PG_MIGRATION_LOCK = 0x4865726D6573  # "Hermes"
_PACKAGE_DIR = Path(__file__).resolve().parent


def script_location() -> str:
    """The revisions: inside the installed package, else the checkout's ``migrations/``."""
    for candidate in (_PACKAGE_DIR / "migrations", _PACKAGE_DIR.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return str(candidate)
    raise FileNotFoundError("hermes_store's Alembic revisions are missing from this install")


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic Config that needs no alembic.ini (works from an installed wheel)."""
    config = Config()
    config.set_main_option("script_location", script_location())
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def _scripts() -> ScriptDirectory:
    """The revisions, read once per process: opening a database consults them every time."""
    return ScriptDirectory(script_location())


def revision_for_version(version: int) -> str:
    """The Alembic revision id of the seed's schema version (``v3_session_title`` for 3)."""
    for script in _scripts().walk_revisions():
        if script.revision.startswith(f"v{version}_"):
            return script.revision
    raise UnrecognizedSchemaError(f"no revision corresponds to schema_version {version}")


def head_revision() -> str:
    head = _scripts().get_current_head()
    assert head is not None
    return head


# -- looking at a database without changing it -------------------------------------------------


@dataclass
class DatabaseState:
    """What a database holds, read without taking any lock."""

    tables: set[str] = field(default_factory=set)
    revision: str | None = None
    schema_version: int | None = None
    columns: dict[str, set[str]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.tables - ddl.UNMODELLED_TABLES)

    @property
    def is_legacy(self) -> bool:
        return self.revision is None and "schema_version" in self.tables


def read_state(conn: Connection) -> DatabaseState:
    """Tables, Alembic revision and the seed's schema_version of the connected database."""
    inspector = sa.inspect(conn)
    tables = set(inspector.get_table_names())
    state = DatabaseState(tables=tables)
    if "alembic_version" in tables:
        state.revision = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
    if "schema_version" in tables:
        state.schema_version = conn.execute(sa.text("SELECT version FROM schema_version")).scalar()
    for table in ("sessions", "messages"):
        if table in tables:
            state.columns[table] = {c["name"] for c in inspector.get_columns(table)}
    return state


def check_adoptable(state: DatabaseState, where: str) -> None:
    """Raise a clear error unless the database is empty, ours, or a known legacy version."""
    known = {s.revision for s in _scripts().walk_revisions()}
    if state.schema_version is not None and state.schema_version > ddl.HEAD_VERSION:
        raise SchemaTooNewError(
            f"{where} has schema_version {state.schema_version}; this hermes_store knows "
            f"versions up to {ddl.HEAD_VERSION}. Upgrade hermes_store to open it."
        )
    if state.revision is not None:
        if state.revision not in known:
            raise SchemaTooNewError(
                f"{where} is at Alembic revision {state.revision!r}, unknown to this "
                "hermes_store (written by a newer release?)"
            )
        return
    if state.is_empty:
        return
    if state.schema_version is None:
        found = ", ".join(sorted(state.tables - ddl.UNMODELLED_TABLES))
        raise UnrecognizedSchemaError(
            f"{where} holds tables ({found}) but no schema_version: not a Hermes state database"
        )
    version = state.schema_version
    if version < 1:
        raise UnrecognizedSchemaError(f"{where} has schema_version {version}, which never existed")
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


def preflight_sqlite(path: Path) -> DatabaseState | None:
    """Refuse files that are not adoptable, reading them only (None: the file does not exist)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    where = str(path)
    if size == 0:
        raise NotADatabaseError(f"{where} is an empty file (0 bytes), not a SQLite database")
    quiet = not _sidecars(path)
    before = _signature(path)
    try:
        state = _probe(path, immutable=quiet)
        if quiet and (_sidecars(path) or _signature(path) != before):
            # Another process opened (and may have written) the file while it was read
            # without locks: that read may be torn, so read it again, properly.
            state = _probe(path, immutable=False)
    except sa.exc.DBAPIError as error:
        _refuse_unless_sqlite(path, size)
        if not (quiet and _sidecars(path)):
            raise NotADatabaseError(
                f"{where} is not a readable SQLite database: {error.orig}"
            ) from error
        # Another process opened the file while it was read without locks: read it properly.
        try:
            state = _probe(path, immutable=False)
        except sa.exc.DBAPIError as again:
            raise NotADatabaseError(
                f"{where} is not a readable SQLite database: {again.orig}"
            ) from again
    check_adoptable(state, where)
    return state


def _refuse_unless_sqlite(path: Path, size: int) -> None:
    """Name a file that SQLite could not open by its first bytes. Read only after SQLite failed:
    closing any descriptor of a file drops every POSIX lock this process holds on it, so a
    file this process has open through SQLite is never opened directly."""
    with path.open("rb") as handle:
        header = handle.read(len(SQLITE_HEADER))
    if header != SQLITE_HEADER:
        raise NotADatabaseError(
            f"{path} is not a SQLite database (starts with {header[:16]!r}, {size} bytes)"
        )


def _signature(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _sidecars(path: Path) -> list[Path]:
    """The -wal, -shm and -journal files beside ``path`` (someone has or had it open)."""
    found = (Path(f"{path}{suffix}") for suffix in ("-wal", "-shm", "-journal"))
    return [p for p in found if p.exists()]


def _probe(path: Path, *, immutable: bool) -> DatabaseState:
    """Read the state without writing. A read-only connection to a WAL file still creates
    -wal and -shm and cannot remove them again, so a file nobody has open (no sidecar files)
    is read with ``immutable=1``, which touches nothing: a refused file is left as it was."""
    mode = "immutable=1" if immutable else "mode=ro"
    probe = sa.create_engine(f"sqlite:///file:{path}?{mode}&uri=true", poolclass=NullPool)
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
        revision = revision_for_version(state.schema_version)
        log.info(
            "adopting a legacy database at schema_version %s as %s", state.schema_version, revision
        )
        MigrationContext.configure(conn).stamp(_scripts(), revision)
        # The seed always created the FTS objects and title index; put back any that are gone.
        if conn.dialect.name == "sqlite":
            had_fts = ddl.FTS_TABLE in state.tables
            conn.exec_driver_sql(ddl.SQLITE_FTS_TABLE)
            for trigger in ddl.SQLITE_FTS_TRIGGERS:
                conn.exec_driver_sql(trigger)
            if not had_fts:
                started = time.monotonic()
                conn.exec_driver_sql(ddl.SQLITE_FTS_REBUILD)
                log.info(
                    "built the full-text index of the adopted file in %.2f s (under the write "
                    "lock: other writers waited)",
                    time.monotonic() - started,
                )
        state.revision = revision
    return state


def _describe(conn: Connection) -> str:
    return conn.engine.url.render_as_string(hide_password=True)


@contextmanager
def migration_connection(
    target: Target, *, retry: RetryPolicy | None = None
) -> Iterator[Connection]:
    """One connection holding the write lock, foreign keys off (SQLite rebuilds tables).

    Waiting for the lock is retried with the store's jittered policy (each attempt waits up to
    the writer's busy timeout), so opening a file while another process writes never fails
    before the writes' own retries would; how long the lock was then held is logged.
    """
    url = target.url if isinstance(target, Engine) else to_url(target)
    path = sqlite_file(url)
    created = path is not None and preflight_sqlite(path) is None and create_private_file(path)
    engine = create_engine(url, foreign_keys=False, poolclass=NullPool)
    try:
        with _lock_errors(url), mapped_errors():
            conn, transaction = _begin_migration(engine, retry or RetryPolicy())
            locked_at = time.monotonic()
            with conn, transaction:
                if conn.dialect.name == "postgresql":
                    # SQLite's BEGIN IMMEDIATE serialises migrations; PostgreSQL needs a lock
                    # of its own, or processes opening one new database at once all run v1.
                    conn.execute(
                        sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK}
                    )
                yield conn
            log.info(
                "%s: migration committed; it held the write lock for %.2f s",
                _describe_url(url),
                time.monotonic() - locked_at,
            )
    except BaseException:
        if created and path is not None and path.stat().st_size == 0:
            path.unlink()  # leave no empty file behind: it would be refused next time
        raise
    finally:
        engine.dispose()


def _begin_migration(engine: Engine, retry: RetryPolicy) -> tuple[Connection, sa.RootTransaction]:
    """A connection with its write transaction begun, waiting for the lock as writes do."""
    waits = retry.waits()
    while True:
        conn = engine.connect()
        conn.execution_options(**{WRITE_OPTION: True})
        try:
            return conn, conn.begin()
        except sa.exc.DBAPIError as error:
            conn.close()
            if not is_retryable(error):
                raise
            delay = next(waits, None)
            if delay is None:
                raise
            log.debug("migration waits for the write lock (%s); retrying in %.0f ms",
                      error.orig, delay * 1000)  # fmt: skip
            time.sleep(delay)


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


def read_engine(target: Target) -> Engine:
    """An engine for read-only commands (``current``, ``check``) on an existing database."""
    url = target.url if isinstance(target, Engine) else to_url(target)
    path = sqlite_file(url)
    if path is not None:
        if preflight_sqlite(path) is None:
            raise NotADatabaseError(f"there is no database at {path}")
        return sa.create_engine(url, poolclass=NullPool)
    return create_engine(url, poolclass=NullPool)


def upgrade(
    target: Target, revision: str = "head", *, retry: RetryPolicy | None = None
) -> str | None:
    """Bring ``target`` (a path, URL or Engine) to ``revision``, adopting a legacy file first."""
    with migration_connection(target, retry=retry) as conn:
        command.upgrade(alembic_config(conn), revision)
        return _current_revision(conn)


def downgrade(target: Target, revision: str) -> str | None:
    """Step ``target`` down to ``revision`` (``base`` removes every table)."""
    with migration_connection(target) as conn:
        command.downgrade(alembic_config(conn), revision)
        return _current_revision(conn)


def stamp(target: Target, revision: str) -> None:
    with migration_connection(target) as conn:
        command.stamp(alembic_config(conn), revision)


def current(target: Target) -> str | None:
    """The Alembic revision of ``target``; for an unadopted legacy file, its matching revision.

    Reads only: never takes the write lock and never changes the file.
    """
    url = target.url if isinstance(target, Engine) else to_url(target)
    path = sqlite_file(url)
    if path is not None:
        state = preflight_sqlite(path)
        if state is None:
            return None
    else:
        engine = create_engine(url, poolclass=NullPool)
        try:
            with mapped_errors(), engine.connect() as conn:
                state = read_state(conn)
        finally:
            engine.dispose()
        check_adoptable(state, _describe_url(url))
    if state.revision is not None:
        return state.revision
    if state.is_legacy and state.schema_version is not None:
        return revision_for_version(state.schema_version)
    return None


def _describe_url(url: sa.URL) -> str:
    return url.render_as_string(hide_password=True)


def _current_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def ensure_head(target: Engine | sa.URL, *, retry: RetryPolicy | None = None) -> None:
    """Open-time check: read the version without locking; migrate only when behind.

    Several processes open the same file at once, so the common case (already at head) must
    not queue for the write lock; the upgrade itself re-checks under the lock, and waits for
    it with the writes' retry policy. ``target`` is an Engine, or a SQLite file's URL.
    """
    head = head_revision()
    url = target.url if isinstance(target, Engine) else target
    path = sqlite_file(url)
    if path is not None and not path.exists():
        _create_sqlite_at_head(path)
        return
    if path is not None:
        state = preflight_sqlite(path)
    else:
        assert isinstance(target, Engine), "ensure_head takes an Engine for servers"
        with mapped_errors(), target.connect() as conn:
            state = read_state(conn)
        check_adoptable(state, _describe_url(url))
    if state is not None and state.revision == head and state.schema_version == ddl.HEAD_VERSION:
        return
    upgrade(target, "head", retry=retry)


def _create_sqlite_at_head(path: Path) -> None:
    """Build a new file beside ``path`` and link it into place, so a path either does not
    exist or holds a complete database at head, whatever other processes do meanwhile."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.new")
    try:
        create_private_file(temp)
        engine = create_engine(temp, poolclass=NullPool)
        try:
            with mapped_errors(), engine.connect() as conn:
                conn.execution_options(**{WRITE_OPTION: True})
                with conn.begin():
                    command.upgrade(alembic_config(conn), "head")
        finally:
            engine.dispose()
        _close_wal(temp)
        try:
            os.link(temp, path)
        except FileExistsError:
            # Another process linked its complete database first; it is at head too.
            log.debug("%s was created by another process meanwhile", path)
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{temp}{suffix}").unlink(missing_ok=True)


def _close_wal(path: Path) -> None:
    """Fold the WAL into the main file so the file alone is the whole database."""
    with closing(sqlite3.connect(path)) as raw:
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
