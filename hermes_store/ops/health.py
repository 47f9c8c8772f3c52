"""Health checks of a database (``hermes-store doctor``), read without migrating or writing.

Also the database state as the ``db`` commands report it: read without taking a lock, so
looking at a database never changes or blocks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy import func, select
from sqlalchemy.engine import URL, Connection

from hermes_store.engine import files
from hermes_store.engine.factory import display_url, sqlite_file
from hermes_store.errors import (
    AccessDeniedError,
    DatabaseLockedError,
    DatabaseUnavailableError,
    HermesStoreError,
    SchemaTooNewError,
    mapped_errors,
    open_errors,
)
from hermes_store.schema import ddl, fulltext, migrate
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S


def one_line(error: object) -> str:
    """The first line of an error's message (at most 500 characters)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return first if len(first) <= 500 else first[:497] + "..."


def read_state(url: URL, *, adoptable: bool = True) -> migrate.DatabaseState | None:
    """The database's tables and versions, read without locking (None: no such file).

    Refuses a schema this release cannot open unless ``adoptable`` is False.
    """
    path = sqlite_file(url)
    if path is not None:
        with open_errors(path):  # a full disk is not "an unreadable file"
            return migrate.preflight_sqlite(path, adoptable=adoptable)
    engine = migrate.read_engine(url)
    try:
        with mapped_errors(), engine.connect() as conn:
            state = migrate.read_state(conn)
    finally:
        engine.dispose()
    if adoptable:
        migrate.check_adoptable(state, display_url(url))
    return state


@dataclass(frozen=True)
class SchemaStatus:
    """Where a database's schema stands against this release (``hermes-store db current``)."""

    exists: bool
    revision: str | None
    schema_version: int | None
    head: str
    at_head: bool
    legacy: bool
    #: Written by a newer release (a revision or schema_version this one does not know).
    too_new: bool


def schema_status(url: URL) -> SchemaStatus:
    """The database's revision and versions, read only; a newer release's file is reported,
    not refused."""
    too_new = False
    try:
        state = read_state(url)
    except SchemaTooNewError:
        state = read_state(url, adoptable=False)
        too_new = True
    revision = revision_of(state)
    head = migrate.head_revision()
    return SchemaStatus(
        exists=state is not None and not state.is_empty,
        revision=revision,
        schema_version=state.schema_version if state else None,
        head=head,
        at_head=revision == head and state is not None and not state.is_legacy,
        legacy=bool(state and state.is_legacy),
        too_new=too_new,
    )


def revision_of(state: migrate.DatabaseState | None) -> str | None:
    """The Alembic revision a database is at (a legacy file: its schema_version's revision)."""
    if state is None:
        return None
    if state.revision is not None:
        return state.revision
    if state.is_legacy and state.schema_version is not None:
        return migrate.revision_for_version(state.schema_version)
    return None


Status = Literal["ok", "info", "warn", "error"]
WAL_WARN_BYTES = 64 * 1024 * 1024


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: Status
    detail: str


def _schema_check(state: migrate.DatabaseState) -> Check:
    head = migrate.head_revision()
    revision = revision_of(state)
    version = state.schema_version
    if state.is_legacy:
        return Check(
            "schema",
            "error",
            f"legacy file at schema_version {version}, not adopted: run `hermes-store db upgrade`",
        )
    if revision == head and version == ddl.HEAD_VERSION:
        return Check("schema", "ok", f"{revision} (head), schema_version {version}")
    return Check(
        "schema",
        "error",
        f"at {revision} (schema_version {version}), head is {head}: run `hermes-store db upgrade`",
    )


def _sqlite_checks(conn: Connection, path: Path) -> list[Check]:
    checks = []
    mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
    checks.append(
        Check(
            "journal mode",
            "ok" if mode == "wal" else "warn",
            str(mode) + ("" if mode == "wal" else " (the store expects WAL)"),
        )
    )
    wal = Path(f"{path}-wal")
    size = wal.stat().st_size if wal.exists() else 0
    checks.append(
        Check(
            "WAL size",
            "warn" if size > WAL_WARN_BYTES else "info",
            f"{size:,} bytes"
            + (" (a long reader blocks checkpoints?)" if size > WAL_WARN_BYTES else ""),
        )
    )
    checks.append(_wal_file_check(path, str(mode)))
    problems = [row[0] for row in conn.exec_driver_sql("PRAGMA integrity_check")]
    ok = problems == ["ok"]
    checks.append(Check("integrity_check", "ok" if ok else "error", "; ".join(problems[:3])))
    return checks


def _wal_file_check(path: Path, mode: str) -> Check:
    """Run while the doctor's own connection is open: the WAL must exist, and no process may
    still be writing into one that was unlinked (it lost its locks; its commits will vanish)."""
    name = "WAL file"
    holders = files.deleted_wal_holders(path)
    if holders:
        who = "; ".join(f"pid {pid} ({command})" for pid, command in holders)
        return Check(
            name,
            "error",
            f"{who} writes into a deleted WAL: its commits since then are invisible to other "
            "processes and are lost when it exits; stop it and check what closed a file "
            "handle on the database",
        )
    if mode == "wal" and not Path(f"{path}-wal").exists():
        return Check(name, "warn", "missing although the database is open in WAL mode")
    return Check(name, "ok", "present, used by no process that lost its locks")


def _postgresql_checks(conn: Connection) -> list[Check]:
    version = conn.exec_driver_sql("SHOW server_version").scalar()
    trigram = fulltext.POSTGRESQL.has_trigram_index(conn)
    return [
        Check("server", "info", f"PostgreSQL {version}"),
        Check(
            "substring index",
            "ok" if trigram else "warn",
            f"{ddl.PG_TRGM_INDEX} " + ("present" if trigram else "missing: CJK search scans"),
        ),
        _prepared_statements_check(conn),
    ]


def _prepared_statements_check(conn: Connection) -> Check:
    """Whether a connection pooler answers for the server (the server process differs from
    the one the connection's startup named): the store then prepares no statements, which
    is what keeps gateways behind PgBouncer's transaction pooling from colliding."""
    driver: Any = conn.connection.driver_connection
    server_pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    if server_pid == driver.info.backend_pid:
        return Check("prepared statements", "ok", "direct connection: prepared from the 5th run")
    return Check(
        "prepared statements",
        "ok",
        "a connection pooler answers for the server: the store prepares no statements there "
        "(safe with PgBouncer's transaction pooling)",
    )


#: PgBouncer's ``server_login_retry`` above this strands writers after a server restart.
MAX_SERVER_LOGIN_RETRY_S = 2.0
POOLER_ADVICE = (
    "after a server restart PgBouncer refuses every client for server_login_retry seconds "
    "(default 15) once a server login failed; set server_login_retry = 1"
)


def pooler_checks(url: URL) -> list[Check]:
    """PgBouncer in front of the server (its admin console, the ``pgbouncer`` database on the
    same address, answers): the settings that strand writers after a server restart. A
    server that is no PgBouncer gives no check; a console this user may not read, advice."""
    import psycopg  # the postgresql extra: only server URLs get here

    console = url.set(drivername="postgresql+psycopg", database="pgbouncer")
    console = console.difference_update_query(["prepare_threshold", "options"])
    cargs, cparams = sa.create_engine(console).dialect.create_connect_args(console)
    cparams.setdefault("connect_timeout", 5)
    try:
        with psycopg.connect(*cargs, autocommit=True, **cparams) as conn:
            cursor = conn.cursor()
            cursor.execute("SHOW CONFIG")
            config = {str(row[0]): str(row[1]) for row in cursor.fetchall()}
    except psycopg.Error as error:
        if "not allowed" in str(error):
            return [
                Check(
                    "connection pooler",
                    "info",
                    "PgBouncer in front; its settings are not readable by this user (add it to "
                    f"stats_users to have them checked): {POOLER_ADVICE}",
                )
            ]
        return []  # no PgBouncer answers there (a database server says "does not exist")
    if "server_login_retry" not in config:
        return []
    retry = config["server_login_retry"]
    try:
        stranded = float(retry.rstrip("s")) > MAX_SERVER_LOGIN_RETRY_S
    except ValueError:
        stranded = False
    mode = config.get("pool_mode", "?")
    if stranded:
        return [
            Check(
                "connection pooler",
                "warn",
                f"PgBouncer ({mode} pooling), server_login_retry = {retry} s strands writers: "
                f"{POOLER_ADVICE}",
            )
        ]
    return [
        Check(
            "connection pooler",
            "ok",
            f"PgBouncer ({mode} pooling), server_login_retry = {retry} s",
        )
    ]


#: ``synchronous_commit`` levels at which a commit waits for a synchronous standby.
_WAITS_FOR_STANDBY = {"on": "flushed", "remote_apply": "applied", "remote_write": "written"}


def replication_check(conn: Connection) -> Check:
    """The replication mode, and whether a write acknowledged here can be lost on failover:
    a standby is named; on a primary, ``synchronous_standby_names``, ``synchronous_commit``
    (as this user's sessions get it) and the standbys in ``pg_stat_replication`` say whether
    a commit waits until a standby has it (their state is visible to superusers and members
    of ``pg_monitor``; others see only that they exist)."""
    name = "replication"
    in_recovery = conn.exec_driver_sql("SELECT pg_is_in_recovery()").scalar()
    if in_recovery:
        sender = conn.exec_driver_sql(
            "SELECT status, sender_host, sender_port FROM pg_stat_wal_receiver"
        ).first()
        source = (
            f"receiving from {sender.sender_host}:{sender.sender_port} ({sender.status})"
            if sender is not None and sender.sender_host is not None
            else "not receiving from any primary now"
        )
        return Check(
            name,
            "info",
            f"this server is a read-only standby, {source}: the store reads here and refuses "
            "to write or migrate; write through the primary",
        )
    names = str(conn.exec_driver_sql("SHOW synchronous_standby_names").scalar() or "")
    commit = str(conn.exec_driver_sql("SHOW synchronous_commit").scalar())
    standbys = conn.exec_driver_sql(
        "SELECT application_name, state, sync_state FROM pg_stat_replication "
        "ORDER BY application_name"
    ).all()
    listed = ", ".join(
        f"{row.application_name or '?'} ({row.state or 'state hidden'}, "
        f"{row.sync_state or 'mode hidden'})"
        for row in standbys
    )
    seen = f"{len(standbys)} standby(s): {listed}" if standbys else "no standby connected"
    settings = f"synchronous_standby_names = '{names}', synchronous_commit = {commit}"
    if not names.strip() or commit not in _WAITS_FOR_STANDBY:
        if not standbys:
            return Check(name, "info", f"{seen}; {settings}: a failover has nothing to promote")
        return Check(
            name,
            "warn",
            f"asynchronous replication ({settings}; {seen}): a write acknowledged here can be "
            "lost on failover, if the standby had not received it yet; set "
            "synchronous_standby_names (e.g. 'ANY 1 (*)') with synchronous_commit = on to "
            "have every acknowledged write on a standby",
        )
    waiting = [row for row in standbys if row.sync_state in ("sync", "quorum")]
    if standbys and not waiting and all(row.sync_state for row in standbys):
        return Check(
            name,
            "warn",
            f"synchronous replication is asked for ({settings}) but no connected standby is "
            f"synchronous ({seen}): commits wait until one is",
        )
    if not standbys:
        return Check(
            name,
            "warn",
            f"synchronous replication is asked for ({settings}) but no standby is connected: "
            "every commit waits until one is",
        )
    return Check(
        name,
        "ok",
        f"synchronous replication ({settings}; {seen}): a commit is acknowledged once a "
        f"standby has {_WAITS_FOR_STANDBY[commit]} it, so a failover to it loses no "
        "acknowledged write",
    )


def _index_check(conn: Connection) -> Check:
    """The full-text index is complete and in step with ``messages`` (see search.check_index)."""
    name = "full-text index"
    strategy = fulltext.of(conn)
    deep = ""
    if isinstance(strategy, fulltext.SqliteFullText):
        missing = strategy.present(conn)
        if missing:
            return Check(name, "error", f"missing {', '.join(missing)}: search will miss messages")
        shape = _structure_check(conn)
        if isinstance(shape, Check):
            return shape
        deep = shape
    try:
        ok = strategy.check(conn)
    finally:
        conn.rollback()  # SQLite's integrity-check writes nothing but holds the write lock
    if ok and deep:
        return Check(name, "warn", deep)
    if ok:
        return Check(name, "ok", "in step with messages")
    return Check(
        name, "error", "does not match messages: run `hermes-store doctor --rebuild-index`"
    )


def _structure_check(conn: Connection) -> Check | str:
    """Each FTS5 table's structure record (read as a plain row): an error Check when FTS5
    cannot read it (every write to ``messages`` fails then), else a warning text when it is
    so deep that merging stops starting ("" when fine)."""
    deep = []
    for table in (ddl.FTS_TABLE, ddl.CJK_TABLE):
        if not conn.exec_driver_sql(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).scalar():
            continue
        try:
            shape = fulltext.structure(conn, table)
        except ValueError as error:
            return Check(
                "full-text index",
                "error",
                f"{table}: structure record damaged ({error}); appends, search and even "
                "dropping the table fail on it: run `hermes-store doctor --rebuild-index`",
            )
        if shape is not None and shape.levels >= fulltext.DEEP_LEVELS:
            deep.append(f"{table} has {shape.levels} levels")
    if not deep:
        return ""
    return (
        f"in step with messages, but {', '.join(deep)} (FTS5 fails past "
        f"{fulltext.FTS5_MAX_STRUCTURE:,}; merging no longer compacts it): run "
        "`hermes-store doctor --rebuild-index`"
    )


def _row_checks(conn: Connection) -> list[Check]:
    orphan_messages = (
        conn.scalar(
            select(func.count())
            .select_from(M)
            .where(~select(S.c.id).where(S.c.id == M.c.session_id).exists())
        )
        or 0
    )
    parent = S.alias("parent")
    orphan_sessions = (
        conn.scalar(
            select(func.count())
            .select_from(S)
            .where(
                S.c.parent_session_id.is_not(None),
                ~select(parent.c.id).where(parent.c.id == S.c.parent_session_id).exists(),
            )
        )
        or 0
    )
    actual = select(func.count()).where(M.c.session_id == S.c.id).scalar_subquery()
    drifted = (
        conn.scalar(
            select(func.count()).select_from(S).where(func.coalesce(S.c.message_count, 0) != actual)
        )
        or 0
    )
    return [
        Check(
            "orphan messages",
            "error" if orphan_messages else "ok",
            f"{orphan_messages} message(s) whose session is gone",
        ),
        Check(
            "orphan sessions",
            "error" if orphan_sessions else "ok",
            f"{orphan_sessions} session(s) whose parent is gone",
        ),
        Check(
            "message counters",
            "warn" if drifted else "ok",
            f"{drifted} session(s) whose message_count differs from their messages",
        ),
    ]


def run_doctor(url: URL) -> list[Check]:
    """Every health check of ``url``, reading only (no migration, nothing written).

    A database that cannot be reached at all (server down, access denied, locked) raises, as
    every other call does: there is nothing to examine. What the checks find, an unusable file
    included, is reported.
    """
    try:
        state = read_state(url)
    except (DatabaseUnavailableError, AccessDeniedError, DatabaseLockedError):
        raise
    except HermesStoreError as error:
        return [Check("database", "error", one_line(error))]
    if state is None or state.is_empty:
        return [Check("database", "error", "no schema yet: run `hermes-store db upgrade`")]
    checks = [_schema_check(state)]
    if not {"sessions", "messages"} <= state.tables:
        return checks
    engine = migrate.read_engine(url)
    path = sqlite_file(url)
    try:
        with mapped_errors(), engine.connect() as conn:
            if path is not None:
                checks += _sqlite_checks(conn, path)
            else:
                checks += _postgresql_checks(conn)
                checks.append(replication_check(conn))
            checks.append(_index_check(conn))
            checks += _row_checks(conn)
    finally:
        engine.dispose()
    if path is None:
        checks += pooler_checks(url)
    return checks


def rebuild_index(url: URL) -> None:
    """Rebuild the full-text index from ``messages`` in one migration transaction."""
    with migrate.migration_connection(url) as conn:
        fulltext.of(conn).rebuild(conn)
