"""Health checks of a database (``hermes-store doctor``), read without migrating or writing.

Also the database state as the ``db`` commands report it: read without taking a lock, so
looking at a database never changes or blocks it.

The doctor never takes the write lock, at any size, and stays bounded. It once ran FTS5's
'integrity-check' on the live file: that command is an ``INSERT``, so it took the write lock and
held it while it read the whole index, and the CJK index's comparison with ``messages`` (a GLOB
over every message: minutes at 2 GB) ran inside that same write transaction; writers beside it
waited, and gave up. Now every check of the live file is a read, each table's
``integrity_check`` its own statement (so checkpoints progress between them), within a time
budget. The full-text indexes of a file up to :data:`SMALL_FILE_BYTES` are checked whole by
FTS5 on a snapshot copy (the backup API: a read of the live file); those of a larger file by
reads only: their document counts against ``messages`` and a random sample of messages looked up
by one of their words (or, for the CJK index, a substring). ``--full`` checks every entry on a
snapshot copy.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy import func, select
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.pool import NullPool

from hermes_store.echo import one_line
from hermes_store.engine import files
from hermes_store.engine.factory import display_url, sqlite_file
from hermes_store.errors import (
    AccessDeniedError,
    DatabaseAliasError,
    DatabaseLockedError,
    DatabaseUnavailableError,
    HermesStoreError,
    SchemaTooNewError,
    mapped_errors,
    sqlite_interrupted,
)
from hermes_store.ops import maintenance
from hermes_store.schema import ddl, fulltext, migrate
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S


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
        state = migrate.state_of(url)
    except SchemaTooNewError:
        state = migrate.state_of(url, adoptable=False)
        too_new = True
    revision = migrate.revision_of(state)
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


Status = Literal["ok", "info", "warn", "error"]
WAL_WARN_BYTES = 64 * 1024 * 1024


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: Status
    detail: str


def _schema_check(state: migrate.DatabaseState, where: str) -> Check:
    head = migrate.head_revision()
    revision = migrate.revision_of(state)
    version = state.schema_version
    if state.is_legacy:
        return Check(
            "schema",
            "error",
            f"legacy file at schema_version {version}, not adopted: run `hermes-store db upgrade`",
        )
    if revision == head:
        damage, repairable = migrate.damage_of(state, where)
        if not damage:
            return Check("schema", "ok", f"{revision} (head), schema_version {version}")
        advice = (
            "the next open for writing repairs it from the data (`hermes-store db upgrade`)"
            if repairable
            else "restore it from a backup"
        )
        return Check("schema", "error", f"{revision} (head), but {'; '.join(damage)}: {advice}")
    return Check(
        "schema",
        "error",
        f"at {revision} (schema_version {version}), head is {head}: run `hermes-store db upgrade`",
    )


def _sqlite_checks(conn: Connection, path: Path, immutable: bool) -> list[Check]:
    if immutable:
        return _read_only_folder_checks(path)
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
    return checks


def _read_only_folder_checks(path: Path) -> list[Check]:
    """The file checks of a database read ``immutable`` (see :func:`migrate.read_engine`). SQLite
    reports no journal mode then, and without a ``-wal`` file nothing committed lives outside
    the main file, so what matters is that writes will be refused here."""
    return [
        Check(
            "folder",
            "warn",
            f"{path.parent} is read-only for this process: the database was read as it is on "
            "disk (immutable, without locks) and every write to it fails here",
        ),
        Check(
            "journal mode",
            "info",
            "not read: SQLite reports none for a file read immutable (it matters to writers "
            "only, and none can write here)",
        ),
        _no_wal_file_check(path),
    ]


def _no_wal_file_check(path: Path) -> Check:
    """:func:`_wal_file_check` of a file without a ``-wal`` file, which is expected here."""
    found = _wal_file_check(path, "")
    if found.status != "ok":
        return found
    return Check(found.name, "ok", "none: everything committed is in the main file")


#: A file up to this size gets the checks of a small one: one ``integrity_check`` of the whole
#: file, and FTS5's own 'integrity-check' of each index with the CJK index compared against
#: ``messages``, on a snapshot copy (a write statement: never on the live file).
SMALL_FILE_BYTES = 64 * 1024 * 1024
#: The doctor's default time budget for its slow checks (seconds); 0: none.
DEFAULT_BUDGET_S = 120.0
#: The largest tables of a large file: checked last (a budget that runs out leaves the fewest
#: tables unchecked). ``integrity_check`` of ``messages`` at 2 GB: 1.1 s, ``quick_check`` (no
#: cross-check of the index entries) 0.85 s: the full check is worth its cost.
LARGE_TABLES = ("messages", f"{ddl.FTS_TABLE}_data", f"{ddl.CJK_TABLE}_data")
#: Messages looked up in the full-text index when it is sampled.
SAMPLES = 300
#: SQLite virtual-machine steps between two looks at the clock.
CLOCK_EVERY_OPS = 50_000
_WORD = re.compile(r"[0-9A-Za-z]{3,24}")


class _OutOfTime(Exception):
    """A check stopped at the doctor's time budget."""


class _Clock:
    """The doctor's deadline: long statements are interrupted at it (SQLite's progress
    handler), so a check of a huge file reports "not finished" instead of running on."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s if budget_s > 0 else float("inf")

    def left(self) -> bool:
        return time.monotonic() < self.deadline

    @contextmanager
    def watching(self, conn: Connection) -> Iterator[None]:
        driver: Any = conn.connection.driver_connection
        if not isinstance(driver, sqlite3.Connection) or self.deadline == float("inf"):
            yield
            return
        driver.set_progress_handler(lambda: int(not self.left()), CLOCK_EVERY_OPS)
        try:
            yield
        except sa.exc.OperationalError as error:
            if sqlite_interrupted(error):
                if not self.left():
                    raise _OutOfTime() from None
                # Ctrl-C (or SIGTERM) raised in the handler, which SQLite turns into "interrupted"
                raise KeyboardInterrupt from None
            raise
        finally:
            driver.set_progress_handler(None, 0)


def _file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _integrity_check(engine: Engine, path: Path, clock: _Clock) -> Check:
    """``integrity_check`` of a small file; of a large one, each table and its indexes in its
    own statement, the largest last, within the time budget."""
    name = "integrity_check"
    with engine.connect() as conn:
        if _file_bytes(path) <= SMALL_FILE_BYTES:
            try:
                with clock.watching(conn):
                    rows = [str(r[0]) for r in conn.exec_driver_sql("PRAGMA integrity_check")]
            except _OutOfTime:
                return Check(name, "warn", "not finished within the time budget (--budget)")
            ok = rows == ["ok"]
            return Check(name, "ok" if ok else "error", "; ".join(rows[:3]))
        tables = list(
            conn.scalars(
                sa.text(
                    "SELECT name FROM sqlite_master WHERE type = 'table' "
                    "AND sql NOT LIKE 'CREATE VIRTUAL TABLE%' ORDER BY name"
                )
            )
        )
    # Small tables first: a budget that runs out leaves the fewest bytes unchecked.
    order = {table: rank for rank, table in enumerate(LARGE_TABLES, 1)}
    tables.sort(key=lambda table: order.get(table, 0))
    found: list[str] = []
    checked: list[str] = []
    for table in tables:
        if not clock.left():
            break
        with engine.connect() as conn:  # its own statement: checkpoints go on between them
            try:
                with clock.watching(conn):
                    rows = [
                        str(row[0]) for row in conn.execute(sa.text(_TABLE_CHECK), {"t": table})
                    ]
            except _OutOfTime:
                break
        checked.append(table)
        if rows != ["ok"]:
            found += [f"{table}: {row}" for row in rows[:3]]
    if found:
        return Check(name, "error", "; ".join(found[:5]))
    skipped = [table for table in tables if table not in checked]
    if skipped:
        return Check(
            name,
            "warn",
            f"ok for {len(checked)} of {len(tables)} tables; not finished within the time "
            f"budget: {', '.join(skipped)} (`--budget 0`: no limit; `--full`: everything, "
            "on a snapshot copy)",
        )
    return Check(name, "ok", f"ok ({len(tables)} tables and their indexes, one by one)")


_TABLE_CHECK = "SELECT * FROM pragma_integrity_check(:t)"


def _names_check(path: Path) -> Check:
    """A file with a second name (a hard link) is a problem: every other command refuses it
    (:func:`files.refuse_aliases`: a writer through each name would keep its own WAL). The
    other name is looked for beside the file and beside the path given (a symlink's)."""
    try:
        files.refuse_aliases(Path(os.path.realpath(path)), path)
    except DatabaseAliasError as error:
        return Check("file names", "error", one_line(error))
    return Check("file names", "ok", "one name (no hard link)")


#: The leftover files the doctor names, at most (it counts them all).
SHOWN_LEFTOVERS = 5


def _leftovers_check(path: Path) -> Check:
    """Files the package's builds left in the database's folder (beside the path given, and
    beside the file a symlink names) when their process was killed: ``.NAME.PID.HEX.KIND`` of
    any name, a new database (``new``), an import's new file (``import``), a backup's copy
    (``backup``), a vacuum swap's copy (``compact``), and their side files, whose process is
    gone from this machine (:func:`files.dead_partials`). Nothing uses them, and each holds
    (part of) a copy of the data: disk space, and text a deletion meant to remove. Only
    listed and ``lstat``\\ ed: never opened, never removed."""
    name = "leftover files"
    folders = {
        Path(os.path.realpath(folder))
        for folder in (path.parent, Path(os.path.realpath(path)).parent)
    }
    found = sorted(
        {left for folder in folders for left in files.dead_partials(folder, files.PARTIAL_KINDS)}
    )
    if not found:
        return Check(name, "ok", "none left by killed builds or backups")
    shown = ", ".join(str(left) for left in found[:SHOWN_LEFTOVERS])
    more = f" and {len(found) - SHOWN_LEFTOVERS} more" if len(found) > SHOWN_LEFTOVERS else ""
    return Check(
        name,
        "warn",
        f"{len(found)} file(s) left by killed builds or backups (their process is gone from "
        f"this machine; each holds part of a copy of the data): {shown}{more}; nothing uses "
        "them: delete them",
    )


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
    if commit == "off":
        return Check(
            name,
            "warn",
            f"synchronous_commit = off ({seen}): a commit is acknowledged before it is on disk, "
            "so a crash of this server loses the writes of its last moments; set it to on for "
            "the role the store connects as",
        )
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


def _index_check(conn: Connection, clock: _Clock | None = None) -> Check:
    """The full-text index is complete and in step with ``messages`` (see search.check_index).
    With ``clock`` (a large SQLite file): sampled by reads only, within its budget; without,
    on SQLite, FTS5's own check (it takes the write lock: a snapshot copy's, see
    :func:`_whole_index_check`)."""
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
        if clock is not None:
            return _sampled_index_check(conn, clock, deep)
    try:
        ok = strategy.check(conn)
    finally:
        conn.rollback()  # SQLite's integrity-check writes nothing but takes the write lock
    if ok and deep:
        return Check(name, "warn", deep)
    if ok:
        return Check(name, "ok", "in step with messages")
    return Check(
        name, "error", "does not match messages: run `hermes-store doctor --rebuild-index`"
    )


_COUNTS = f"SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM {ddl.FTS_TABLE}_docsize)"
_SAMPLE = "SELECT id, substr(content, 1, 2000) FROM messages WHERE id >= :id ORDER BY id LIMIT 1"
_LOOKUP = f"SELECT count(*) FROM {ddl.FTS_TABLE} WHERE {ddl.FTS_TABLE} MATCH :q AND rowid = :id"
_CJK_HOLDS = f"SELECT count(*) FROM {ddl.CJK_DOCSIZE} WHERE id = :id"
_CJK_LOOKUP = f"SELECT count(*) FROM {ddl.CJK_TABLE} WHERE {ddl.CJK_TABLE} MATCH :q AND rowid = :id"
_UNSEGMENTED = re.compile(ddl.UNSEGMENTED_CLASS + "{3}")
_REBUILD = "run `hermes-store doctor --rebuild-index`"


def _words(text: str, cut: bool) -> list[str]:
    """Whole words of ASCII letters and digits (FTS5's unicode61 tokens, folded as it folds
    them): never part of a longer token, nor the last word of a text cut short."""
    found = []
    for match in _WORD.finditer(text):
        before = text[match.start() - 1] if match.start() else " "
        after = text[match.end()] if match.end() < len(text) else ("x" if cut else " ")
        if not before.isalnum() and not after.isalnum():
            found.append(match.group())
    return found


def _sampled_index_check(conn: Connection, clock: _Clock, deep: str) -> Check:
    """Reads only: each index holds as many documents as ``messages`` has rows (one
    statement, one snapshot), and messages drawn at random are found by one of their words
    (the CJK index: by three of their characters, and it holds exactly the messages written
    in those scripts among them)."""
    name = "full-text index"
    try:
        with clock.watching(conn):
            messages, indexed = conn.execute(sa.text(_COUNTS)).one()
            if messages != indexed:
                return Check(
                    name,
                    "error",
                    f"holds {indexed:,} documents for {messages:,} messages: {_REBUILD}",
                )
            low, high = conn.execute(sa.text("SELECT min(id), max(id) FROM messages")).one()
            cjk = bool(
                conn.scalar(
                    sa.text("SELECT count(*) FROM sqlite_master WHERE name = :t"),
                    {"t": ddl.CJK_TABLE},
                )
            )
            draw = random.Random()
            looked = 0
            # As many messages as the sample, or fewer: every one of them, in order.
            every = messages <= SAMPLES
            after = low
            for _ in range(SAMPLES if low is not None else 0):
                if not clock.left():
                    break
                start = after if every else draw.randint(low, high)
                row = conn.execute(sa.text(_SAMPLE), {"id": start}).first()
                if row is None:
                    if every:
                        break
                    continue
                after = int(row[0]) + 1
                if not row[1]:
                    continue
                message_id, text = int(row[0]), str(row[1])
                words = _words(text, cut=len(text) >= 2000)
                if words:
                    word = draw.choice(words)
                    found = conn.scalar(sa.text(_LOOKUP), {"q": f'"{word}"', "id": message_id})
                    looked += 1
                    if not found:
                        return Check(
                            name,
                            "error",
                            f"message {message_id} is not found by its word {word!r}: {_REBUILD}",
                        )
                if cjk:
                    problem = _cjk_sample(conn, message_id, text, draw)
                    if problem:
                        return Check(name, "error", f"{problem}: {_REBUILD}")
    except _OutOfTime:
        return Check(name, "warn", "not finished within the time budget (--budget)")
    detail = (
        f"in step with messages ({messages:,} documents; {looked} sampled messages found by "
        "their words; `--full` checks every entry on a snapshot copy)"
    )
    return Check(name, "warn", deep) if deep else Check(name, "ok", detail)


def _cjk_sample(conn: Connection, message_id: int, text: str, draw: random.Random) -> str:
    """What is wrong with the CJK index about this message ("" when nothing)."""
    runs = _UNSEGMENTED.findall(text)
    held = bool(conn.scalar(sa.text(_CJK_HOLDS), {"id": message_id}))
    if not runs:
        # A text cut at 2,000 characters may have such characters further on: not judged.
        return (
            ""
            if len(text) >= 2000 or not held
            else (f"the CJK index holds message {message_id}, which has no such characters")
        )
    if not held:
        return f"the CJK index misses message {message_id}"
    piece = draw.choice(runs)
    if not conn.scalar(sa.text(_CJK_LOOKUP), {"q": f'"{piece}"', "id": message_id}):
        return f"message {message_id} is not found in the CJK index by {piece!r}"
    return ""


def _structure_check(conn: Connection) -> Check | str:
    """Each FTS5 table's structure record (read as a plain row): an error Check when FTS5
    cannot read it (every write to ``messages`` fails then) or when leaf pages it lists are
    gone (:func:`fulltext.missing_index_pages`: a large file's sampled check may miss that), else a
    warning text when it is so deep that merging stops starting, or left with a maintenance
    job's merge settings ("" when fine)."""
    deep: list[str] = []
    merging_off: list[str] = []
    for table in (ddl.FTS_TABLE, ddl.CJK_TABLE):
        if not fulltext.has_table(conn, table):
            continue
        try:
            shape = fulltext.structure(conn, table)
            lost = fulltext.lost_pages(conn, table)
        except ValueError as error:
            return Check(
                "full-text index",
                "error",
                f"{table}: structure record damaged ({error}); appends, search and even "
                "dropping the table fail on it: run `hermes-store doctor --rebuild-index`",
            )
        if lost:
            return Check(
                "full-text index",
                "error",
                f"{table}: {lost}; search and merging fail on them: {_REBUILD}",
            )
        if shape is not None and shape.levels >= fulltext.DEEP_LEVELS:
            deep.append(f"{table} has {shape.levels} levels")
        if maintenance.fts5_settings(conn, table) == maintenance.JOB_FTS5_SETTINGS:
            merging_off.append(table)
    warnings = []
    if deep:
        warnings.append(
            f"{', '.join(deep)} (FTS5 fails past {fulltext.FTS5_MAX_STRUCTURE:,}; merging no "
            "longer compacts it): run `hermes-store doctor --rebuild-index`"
        )
    if merging_off:
        warnings.append(
            f"FTS5's automatic merging is off for {', '.join(merging_off)} (a maintenance "
            "job's setting: a prune, optimize or import is running, or was killed; search "
            "slows as segments pile up): `hermes-store db optimize` puts it back"
        )
    return f"in step with messages, but {'; and '.join(warnings)}" if warnings else ""


_ORPHAN_MESSAGES = (
    select(func.count())
    .select_from(M)
    .where(~select(S.c.id).where(S.c.id == M.c.session_id).exists())
)
_PARENT = S.alias("parent")
_ORPHAN_SESSIONS = (
    select(func.count())
    .select_from(S)
    .where(
        S.c.parent_session_id.is_not(None),
        ~select(_PARENT.c.id).where(_PARENT.c.id == S.c.parent_session_id).exists(),
    )
)
_DRIFTED = (
    select(func.count())
    .select_from(S)
    .where(
        func.coalesce(S.c.message_count, 0)
        != select(func.count()).where(M.c.session_id == S.c.id).scalar_subquery()
    )
)


def _row_checks(conn: Connection, clock: _Clock | None = None) -> list[Check]:
    """Orphan rows and drifted counters, each one statement (one snapshot), within the
    time budget."""
    checks = []
    rows: tuple[tuple[str, Any, Status, str], ...] = (
        ("orphan messages", _ORPHAN_MESSAGES, "error", "message(s) whose session is gone"),
        ("orphan sessions", _ORPHAN_SESSIONS, "error", "session(s) whose parent is gone"),
        (
            "message counters",
            _DRIFTED,
            "warn",
            "session(s) whose message_count differs from their messages",
        ),
    )
    for name, statement, status, what in rows:
        try:
            with clock.watching(conn) if clock is not None else _nothing():
                found = int(conn.scalar(statement) or 0)
        except _OutOfTime:
            checks.append(Check(name, "warn", "not finished within the time budget (--budget)"))
            continue
        checks.append(Check(name, status if found else "ok", f"{found} {what}"))
    return checks


@contextmanager
def _nothing() -> Iterator[None]:
    yield


#: Called with the name of each group of checks as it starts (progress on a terminal).
Progress = Callable[[str], None]


@contextmanager
def _snapshot(engine: Engine, path: Path) -> Iterator[Path]:
    """A snapshot copy of the file (SQLite's backup API: a read of the live file, never its
    write lock) in a private folder beside it (or in the temp folder when that one cannot be
    written), removed after."""
    from hermes_store.ops import backup

    try:
        folder = Path(tempfile.mkdtemp(prefix=".hermes-doctor-", dir=path.parent))
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="hermes-doctor-"))
    try:
        copy = folder / "snapshot.db"
        backup.backup(engine, copy)
        yield copy
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _snapshot_check(engine: Engine, path: Path) -> Check:
    """Every check, every entry, on a snapshot copy of the file: the backup's checks, then
    the full-text indexes whole (the CJK index against ``messages`` too)."""
    from hermes_store.ops import backup

    name = "full check (snapshot)"
    with _snapshot(engine, path) as copy:
        problems = backup.check_snapshot(copy)
        if not problems:
            snapshot = sa.create_engine(
                URL.create("sqlite", database=str(copy)), poolclass=NullPool
            )
            try:
                with snapshot.connect() as conn:
                    index = _index_check(conn)
            finally:
                snapshot.dispose()
            if index.status == "error":
                problems.append(index.detail)
    if problems:
        return Check(name, "error", "; ".join(problems[:5]))
    return Check(
        name,
        "ok",
        "integrity_check, foreign keys and every full-text entry on a copy: ok",
    )


def _whole_index_check(engine: Engine, path: Path, clock: _Clock) -> Check:
    """The full-text indexes of a small file, every entry (FTS5's 'integrity-check', a write
    statement) and the CJK index against ``messages``, on a snapshot copy: the live file's
    write lock is never taken. When no copy can be made, the sampled reads of a large file."""
    name = "full-text index"
    try:
        with _snapshot(engine, path) as copy:
            snapshot = sa.create_engine(
                URL.create("sqlite", database=str(copy)), poolclass=NullPool
            )
            try:
                with snapshot.connect() as conn, clock.watching(conn):
                    return _index_check(conn)
            except _OutOfTime:
                return Check(name, "warn", "not finished within the time budget (--budget)")
            finally:
                snapshot.dispose()
    except (OSError, sqlite3.Error, HermesStoreError) as error:
        # A second name is its own check's error: said once, there.
        aliased = isinstance(error, DatabaseAliasError)
        reason = "the file has another name: see file names" if aliased else one_line(error)
    with engine.connect() as conn:
        sampled = _index_check(conn, clock)
    if sampled.status == "error":
        return sampled
    return Check(name, "warn", f"{sampled.detail}; sampled only: no snapshot copy ({reason})")


def run_doctor(
    url: URL,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    full: bool = False,
    progress: Progress | None = None,
) -> list[Check]:
    """Every health check of ``url``, reading only (no migration, nothing written).

    A database that cannot be reached at all (server down, access denied, locked) raises, as
    every other call does: there is nothing to examine. What the checks find, an unusable file
    included, is reported. A SQLite file larger than :data:`SMALL_FILE_BYTES` is checked in
    bounded time (``budget_s`` seconds for the slow checks, 0: no limit; what did not finish
    is reported as a warning) by reads only; ``full`` adds every check of every entry on a
    snapshot copy. ``progress(name)`` is called as each group of checks starts.
    """
    say = progress or (lambda _name: None)
    try:
        state = migrate.state_of(url)
    except (DatabaseUnavailableError, AccessDeniedError, DatabaseLockedError):
        raise
    except HermesStoreError as error:
        return [Check("database", "error", one_line(error))]
    if state is None or state.is_empty:
        return [Check("database", "error", "no schema yet: run `hermes-store db upgrade`")]
    checks = [_schema_check(state, display_url(url))]
    if not {"sessions", "messages"} <= state.tables:
        return checks
    path = sqlite_file(url)
    engine = migrate.read_engine(url)
    immutable = migrate.reads_immutable(engine)
    clock = _Clock(budget_s)
    large = path is not None and _file_bytes(path) > SMALL_FILE_BYTES
    try:
        with mapped_errors():
            say("files")
            names = _names_check(path) if path is not None else None
            if names is not None:
                checks.append(names)
            if path is not None:
                checks.append(_leftovers_check(path))
            with engine.connect() as conn:
                if path is not None:
                    checks += _sqlite_checks(conn, path, immutable)
                else:
                    checks += _postgresql_checks(conn)
                    checks.append(replication_check(conn))
            if path is not None:
                say("integrity")
                checks.append(_integrity_check(engine, path, clock))
            say("full-text index")
            if path is not None and not large:
                checks.append(_whole_index_check(engine, path, clock))
            else:
                with engine.connect() as conn:
                    checks.append(_index_check(conn, clock if large else None))
            say("rows")
            with engine.connect() as conn:
                checks += _row_checks(conn, clock if path is not None else None)
            if full and path is not None:
                say("snapshot")
                if names is not None and names.status == "error":  # no copy through an alias
                    checks.append(
                        Check(
                            "full check (snapshot)",
                            "warn",
                            "not run: the file has another name (see file names)",
                        )
                    )
                else:
                    checks.append(_snapshot_check(engine, path))
    finally:
        engine.dispose()
    if path is None:
        checks += pooler_checks(url)
    return checks


def rebuild_index(url: URL) -> None:
    """Rebuild the full-text index from ``messages`` in one migration transaction.

    Ctrl-C while SQLite rebuilds reaches Python in the migration's progress handler, and the
    driver turns it into SQLite's "interrupted" error: it is raised as ``KeyboardInterrupt``
    (the transaction rolled back, nothing changed), not as a database error."""
    try:
        with migrate.migration_connection(url) as conn:
            fulltext.of(conn).rebuild(conn)
    except Exception as error:
        if sqlite_interrupted(error):
            raise KeyboardInterrupt from None
        raise
