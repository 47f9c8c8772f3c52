"""Bounded growth of a long-lived store: index merges, planner statistics, freed pages.

Every online step is a short write unit, so writers wait for at most one step, never for the
whole job: the full-text index is merged ``MERGE_PAGES`` pages of work at a time (FTS5
``'merge'``), freed pages are returned ``VACUUM_PAGES`` at a time (``incremental_vacuum``), and
the WAL is checkpointed PASSIVE only. A TRUNCATE checkpoint is never issued while other
processes may write (the original project damaged B-trees that way); the WAL is kept bounded
by ``journal_size_limit`` instead (see :mod:`hermes_store.engine.factory`).

A full merge is started once per job (``'merge'`` with a negative count) and then continued
(positive counts). Starting it again at every step, as this module once did, broke the index
beside a writer: each start moves every segment to a new level when a writer's insert has put
one elsewhere, so each step added two levels (SQLite 3.40 caps nothing), the merge never
finished, and at 2,001 levels FTS5 could no longer read its structure record: every
statement on the table, the writer's appends and DROP TABLE included, failed as corrupt.

A full ``VACUUM`` rewrites the whole file under an exclusive lock: :func:`vacuum_offline` runs it
only when no other connection has the database open, and refuses otherwise. A replica that
ships the WAL (Litestream) cannot follow a file rewritten in place: :func:`vacuum_swap` writes
a compacted copy instead and renames it over the file.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from hermes_store.engine import files
from hermes_store.engine.factory import create_private_file, sqlite_file
from hermes_store.errors import (
    AccessDeniedError,
    DatabaseLockedError,
    InvalidInputError,
    NotADatabaseError,
    UnsafePathError,
    mapped_driver_errors,
)
from hermes_store.ops import backup, pacing
from hermes_store.schema import ddl, fulltext
from hermes_store.uow.unit import UnitOfWork

#: FTS5 'merge' work of a first step (leaf pages written); later steps follow the pace.
MERGE_PAGES = 64
#: Pages one 'merge' statement writes at most: a step looks at its clock between statements.
MERGE_STATEMENT_PAGES = 32
MIN_MERGE_PAGES = 2
MAX_MERGE_PAGES = 16_384
#: Freed pages handed back by a first step (``PRAGMA incremental_vacuum``), then paced.
VACUUM_PAGES = 256
#: Pages freed between two looks at the step's clock.
VACUUM_STATEMENT_PAGES = 64
MIN_VACUUM_PAGES = 16
MAX_VACUUM_PAGES = 1 << 20
#: ``PRAGMA secure_delete`` values by number (0 off, 1 on, 2 fast).
SECURE_DELETE_VALUES = {0: "0", 1: "1", 2: "2"}
#: A guard against an index that never reports "done": plenty for a multi-GB index.
MAX_STEPS = 1_000_000
#: Rows ``PRAGMA optimize``'s ANALYZE reads per index: its statistics in milliseconds, where a
#: full ANALYZE of a multi-GB file held the write lock for tens of seconds.
ANALYSIS_LIMIT = "PRAGMA analysis_limit=1000"
NO_ANALYSIS_LIMIT = "PRAGMA analysis_limit=0"
#: The full-text tables merged, the main one first.
FTS_TABLES = (ddl.FTS_TABLE, ddl.CJK_TABLE)
_MERGE = {table: fulltext.merge_statement(table) for table in FTS_TABLES}
_LEAVES = {
    ddl.FTS_TABLE: f"SELECT count(*) FROM {ddl.FTS_TABLE}_data",
    ddl.CJK_TABLE: f"SELECT count(*) FROM {ddl.CJK_TABLE}_data",
}
#: Called after each step with (kind, work done): "merge" (pages), "vacuum" (pages freed) or
#: "analyze"; for progress bars.
OnStep = Callable[[str, int], None]


@dataclass
class Report(pacing.StepTally):
    """What :func:`optimize` did and how long its steps held the write lock (the tally: the
    longest one and what it did, and how many went over the bound a writer may wait for)."""

    backend: str
    bytes_before: int
    bytes_after: int = 0
    merge_steps: int = 0
    vacuum_steps: int = 0
    pages_freed: int = 0
    notes: list[str] = field(default_factory=list)
    #: The file's free pages left after the job (SQLite; 0 elsewhere): what a file whose
    #: ``auto_vacuum`` is not INCREMENTAL keeps for reuse.
    free_pages: int = 0


def database_bytes(uow: UnitOfWork) -> int:
    """What the database occupies: the SQLite file and its WAL (``stat`` only), or PostgreSQL's
    size of the two tables with their indexes and TOAST."""
    path = sqlite_file(uow.engine.url)
    if path is not None:
        wal = Path(f"{path}-wal")
        return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
    if not uow.is_sqlite:
        with uow.connect(write=False) as conn:
            return int(
                conn.scalar(
                    sa.text(
                        "SELECT pg_total_relation_size('sessions') "
                        "+ pg_total_relation_size('messages')"
                    )
                )
                or 0
            )
    return 0


#: FTS5's own merging while a paced job runs. FTS5 merges inside the transaction that writes:
#: every 64 leaf pages written, 64 pages per level of merging ('automerge'; an index of seven
#: levels merged ~450 pages, hundreds of milliseconds, inside one prune step or one writer's
#: append), and a level reaching ``crisismerge`` segments is merged whole at once. A job turns
#: the first off and puts the second far off, and merges in paced steps itself; it puts both
#: back when it ends. Settings of the table, shared by every connection (writers beside the
#: job skip the lumps too).
JOB_FTS5_SETTINGS = {"automerge": 0, "crisismerge": 64}
#: FTS5's defaults, put back when a table had no setting of its own.
FTS5_DEFAULT_SETTINGS = {"automerge": 4, "crisismerge": 16}


def fts5_settings(conn: Connection, table: str) -> dict[str, int]:
    """The table's own 'automerge' and 'crisismerge' (FTS5's defaults where unset)."""
    rows = conn.exec_driver_sql(
        f"SELECT k, v FROM {table}_config WHERE k IN ('automerge', 'crisismerge')"
    ).all()
    found = {str(k): int(v) for k, v in rows}
    return {key: found.get(key, default) for key, default in FTS5_DEFAULT_SETTINGS.items()}


def _set_fts5(conn: Connection, table: str, settings: dict[str, int]) -> None:
    for key, value in settings.items():
        conn.exec_driver_sql(f"INSERT INTO {table}({table}, rank) VALUES (?, ?)", (key, int(value)))


@contextmanager
def paced_index_merging(uow: UnitOfWork) -> Iterator[list[str]]:
    """While a paced job runs: FTS5's in-transaction merging off (see
    :data:`JOB_FTS5_SETTINGS`), the previous settings put back after, each change one short
    write unit. Settings equal to a job's were left by a job whose process was killed: FTS5's
    defaults are put back then. Yields the full-text tables present (SQLite), for
    :func:`tidy_step`."""
    if not uow.is_sqlite:
        yield []
        return
    with uow.connect(write=False) as conn:
        tables = _present_tables(conn)
        for table in tables:  # a damaged index is said so before anything is written to it
            index_shape(conn, table)
        previous = {table: fts5_settings(conn, table) for table in tables}
    for table, settings in previous.items():
        if settings == JOB_FTS5_SETTINGS:  # a job's, left by a process that was killed
            previous[table] = dict(FTS5_DEFAULT_SETTINGS)

    def apply(conn: Connection, settings: dict[str, dict[str, int]]) -> None:
        for table, values in settings.items():
            _set_fts5(conn, table, values)

    uow.run(lambda conn: apply(conn, {table: dict(JOB_FTS5_SETTINGS) for table in tables}))
    try:
        yield tables
    finally:
        uow.run(lambda conn: apply(conn, previous))


def tidy_step(
    uow: UnitOfWork,
    pace: pacing.Pace,
    log: pacing.StepLog,
    tables: list[str],
    *,
    secure_delete: bool = False,
) -> pacing.Step:
    """One paced merge step over ``tables`` ('merge' with a positive count: the merge in
    progress continues, or a level holding ``usermerge`` segments is merged), so the segments
    a job's deletes and the writers' appends add are merged as they come, in bounded pieces."""
    return _tidy(uow, pace, log, tables, secure_delete)[1]


def _tidy(
    uow: UnitOfWork,
    pace: pacing.Pace,
    log: pacing.StepLog,
    tables: list[str],
    secure_delete: bool,
) -> tuple[bool, pacing.Step]:
    """:func:`tidy_step`, and whether work may be left: a statement of it found some, or
    the budget ended before every table was looked at."""

    def body(conn: Connection, budget: pacing.Budget) -> tuple[bool, int]:
        pages = 0
        worked = False
        for number, table in enumerate(tables, 1):
            while True:
                piece = max(1, min(MERGE_STATEMENT_PAGES, budget.size - pages))
                found = _merge_step(conn, piece, table=table, secure=secure_delete, start=False)
                worked = worked or found
                pages += piece
                if not found or pages >= budget.size or not budget.left():
                    break
            if pages >= budget.size or not budget.left():
                return worked or number < len(tables), pages
        return worked, pages

    return pacing.run_step(uow, pace, log, body)


def settle_index(
    uow: UnitOfWork,
    tables: list[str],
    report: Report | None = None,
    *,
    secure_delete: bool = False,
    step_seconds: float = pacing.STEP_SECONDS,
    step_log: pacing.StepLog | None = None,
    pause: float | None = None,
    on_step: OnStep | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Merge only the levels holding ``usermerge`` segments ('merge' with a positive count),
    in paced steps, until none does: what a prune leaves (its delete records, the writers'
    small segments) is folded into a few segments, and the index's big segments are left
    alone. Their merge (:func:`merge_index`, what ``db optimize`` runs) writes each common
    word's whole list of rows in one statement, which no bound can cut (SQLite 3.40 stops a
    merge between words only), so a prune does not run it. Call it inside
    :func:`paced_index_merging` (``tables``: what it yields). Returns the number of steps."""
    bound = pacing.check_bound(step_seconds)
    report = report or Report("sqlite", 0)
    report.bound_s = bound
    log = step_log if step_log is not None else pacing.StepLog()
    if not tables:
        return 0
    with uow.connect(write=False) as conn:
        leaves = sum(int(conn.exec_driver_sql(_LEAVES[table]).scalar() or 0) for table in tables)
    pace = pacing.Pace("merge", MERGE_PAGES, MIN_MERGE_PAGES, 4096, bound)
    steps = _merge_steps(
        uow,
        lambda _first: _tidy(uow, pace, log, tables, secure_delete),
        report,
        budget=leaves + 16 * MERGE_PAGES,
        max_steps=MAX_STEPS,
        on_step=on_step,
        pause=pause,
        stop=stop,
    )
    report.merge_steps += steps
    return steps


def _merge_steps(
    uow: UnitOfWork,
    step: Callable[[bool], tuple[bool, pacing.Step]],
    report: Report,
    *,
    budget: int,
    max_steps: int,
    on_step: OnStep | None,
    pause: float | None,
    stop: threading.Event | None,
) -> int:
    """Paced merge steps (``step(first)``: whether work may be left, and the step) until one
    finds no work, ``stop`` is set, or ``budget`` pages or ``max_steps`` steps are spent:
    writers keep adding small segments, so "no work left" may never come under load, and the
    budget is what merging the index as it stands would take. Returns the number of steps."""
    steps = done = 0
    while steps < max_steps and done <= budget:
        if stop is not None and stop.is_set():
            break
        found, ran = step(steps == 0)
        steps += 1
        done += ran.work
        report.record(ran)
        if on_step is not None:
            on_step("merge", ran.work)
        pacing.between_steps(uow, ran, pause)
        if not found:
            break
    return steps


def _merge_step(
    conn: Connection, pages: int, *, table: str = ddl.FTS_TABLE, secure: bool, start: bool
) -> bool:
    """One FTS5 merge of about ``pages`` leaf pages written; True while it still found work
    (FTS5 says "done" by changing fewer than two rows). ``start``: begin a merge of every
    segment, as 'optimize' does (a negative count); otherwise continue the merge in progress,
    or merge a level that has ``usermerge`` segments."""
    driver: Any = conn.connection.driver_connection
    before = driver.total_changes
    with secure_deletes(conn, secure):
        conn.execute(sa.text(_MERGE[table]), {"pages": -pages if start else pages})
    return bool(driver.total_changes - before >= 2)


def index_shape(conn: Connection, table: str = ddl.FTS_TABLE) -> fulltext.IndexShape | None:
    """The full-text index's levels and segments; :class:`NotADatabaseError` when its
    structure record is damaged (FTS5 would fail every statement on the table)."""
    try:
        return fulltext.structure(conn, table)
    except ValueError as error:
        raise NotADatabaseError(
            f"the full-text index is damaged (its structure record: {error}): run "
            "`hermes-store doctor --rebuild-index`"
        ) from None


@contextmanager
def secure_deletes(conn: Connection, on: bool = True) -> Iterator[None]:
    """SQLite's ``secure_delete`` for this unit: freed pages are zeroed, so deleted text does
    not linger in the file (the setting belongs to the pooled connection: reset after)."""
    if not on or conn.dialect.name != "sqlite":
        yield
        return
    previous = int(conn.exec_driver_sql("PRAGMA secure_delete").scalar() or 0)
    conn.exec_driver_sql("PRAGMA secure_delete=1")
    try:
        yield
    finally:
        if previous != 1:  # some builds (Debian's) default to ON: put back what was there
            conn.exec_driver_sql(f"PRAGMA secure_delete={SECURE_DELETE_VALUES[previous]}")


def _present_tables(conn: Connection) -> list[str]:
    found = set(
        conn.scalars(
            sa.text("SELECT name FROM sqlite_master WHERE type = 'table' AND name IN (:a, :b)"),
            {"a": ddl.FTS_TABLE, "b": ddl.CJK_TABLE},
        )
    )
    return [table for table in FTS_TABLES if table in found]


def merge_index(
    uow: UnitOfWork,
    report: Report | None = None,
    *,
    secure_delete: bool = False,
    step_seconds: float = pacing.STEP_SECONDS,
    step_log: pacing.StepLog | None = None,
    pause: float | None = None,
    on_step: OnStep | None = None,
    stop: threading.Event | None = None,
    full: bool = True,
) -> int:
    """Merge each full-text index's segments in paced steps until it is compact.

    Deleted rows only leave an FTS5 index when the segments holding them are merged, so this
    is also what makes pruned text disappear from the index (the main index and the CJK one).
    Each step is one write unit of at most about ``step_seconds`` (see
    :mod:`hermes_store.ops.pacing`); ``stop``, once set, ends it between two steps. Returns
    the number of steps. PostgreSQL: one unit that flushes the GIN pending lists and refreshes
    statistics.

    ``full=False`` starts no merge of every segment: it finishes a merge in progress and merges
    the levels holding ``usermerge`` segments or more (what FTS5's automerge would have done
    as it went), so its work follows what was added, not the size of the whole index (an
    import that ran with automerge off).
    """
    bound = pacing.check_bound(step_seconds)
    report = report or Report(uow.engine.dialect.name, 0)
    report.bound_s = bound
    log = step_log if step_log is not None else pacing.StepLog()
    if not uow.is_sqlite:
        pace = pacing.Pace("merge", 1, 1, 1, bound)

        def flush(conn: Connection, _: pacing.Budget) -> tuple[None, int]:
            fulltext.POSTGRESQL.optimize(conn)
            return None, 1

        _, step = pacing.run_step(uow, pace, log, flush)
        report.record(step)
        report.merge_steps += 1
        return 1
    with uow.connect(write=False) as conn:
        tables = _present_tables(conn)
        plans = [
            (table, int(conn.exec_driver_sql(_LEAVES[table]).scalar() or 0), shape)
            for table in tables
            for shape in [index_shape(conn, table)]
        ]
    steps = 0
    for table, leaves, shape in plans:
        # One start per job (see the module's docstring); the steps after it continue it.
        start = full and shape is not None and shape.levels + 2 <= fulltext.DEEP_LEVELS
        if full and shape is not None and not start:
            report.notes.append(
                f"the full-text index {table} has {shape.levels} levels, so no full merge was "
                f"started (each start adds levels; FTS5 fails past "
                f"{fulltext.FTS5_MAX_STRUCTURE:,}): `hermes-store doctor --rebuild-index` "
                "makes it shallow again"
            )
        pace = pacing.Pace("merge", MERGE_PAGES, MIN_MERGE_PAGES, MAX_MERGE_PAGES, bound)

        def merge(
            first: bool, table: str = table, start: bool = start, pace: pacing.Pace = pace
        ) -> tuple[bool, pacing.Step]:
            def body(conn: Connection, budget: pacing.Budget) -> tuple[bool, int]:
                pages = 0
                while True:
                    piece = max(1, min(MERGE_STATEMENT_PAGES, budget.size - pages))
                    found = _merge_step(
                        conn,
                        piece,
                        table=table,
                        secure=secure_delete,
                        start=start and first and not pages,
                    )
                    pages += piece
                    if not found or pages >= budget.size or not budget.left():
                        return found, pages

            return pacing.run_step(uow, pace, log, body)

        steps += _merge_steps(
            uow,
            merge,
            report,
            budget=leaves + 16 * MERGE_PAGES,
            max_steps=MAX_STEPS - steps,
            on_step=on_step,
            pause=pause,
            stop=stop,
        )
    report.merge_steps += steps
    return steps


def _vacuum_step(conn: Connection, pages: int) -> int:
    """Up to ``pages`` freed pages handed back. The statement frees one page per step of
    it, and Python's driver steps a statement that returns no columns once and resets it (so
    one execution freed one page: a transaction per page): it is run once per page."""
    before = int(conn.exec_driver_sql("PRAGMA freelist_count").scalar() or 0)
    if before <= 0:
        return 0
    driver: Any = conn.connection.driver_connection
    cursor = driver.cursor()
    try:
        cursor.executemany("PRAGMA incremental_vacuum", [()] * min(before, pages))
    finally:
        cursor.close()
    after = int(conn.exec_driver_sql("PRAGMA freelist_count").scalar() or 0)
    return before - after


def _analyze_step(conn: Connection, _: pacing.Budget) -> tuple[None, int]:
    """``PRAGMA optimize`` with ANALYZE reading a sample of each index (bounded)."""
    conn.exec_driver_sql(ANALYSIS_LIMIT)
    try:
        conn.exec_driver_sql("PRAGMA optimize")
    finally:
        conn.exec_driver_sql(NO_ANALYSIS_LIMIT)
    return None, 1


def free_space(uow: UnitOfWork) -> tuple[int, int, int]:
    """(``auto_vacuum`` mode, free pages, page size) of a SQLite database."""
    with uow.connect(write=False) as conn:
        mode = int(conn.exec_driver_sql("PRAGMA auto_vacuum").scalar() or 0)
        free = int(conn.exec_driver_sql("PRAGMA freelist_count").scalar() or 0)
        size = int(conn.exec_driver_sql("PRAGMA page_size").scalar() or 4096)
    return mode, free, size


def optimize(
    uow: UnitOfWork,
    *,
    step_seconds: float = pacing.STEP_SECONDS,
    step_log: pacing.StepLog | None = None,
    pause: float | None = None,
    on_step: OnStep | None = None,
) -> Report:
    """Compact what can be compacted online, one short write unit at a time.

    SQLite: merge the full-text indexes, ``PRAGMA optimize`` (statistics for the planner, from
    a sample), give freed pages back with ``incremental_vacuum`` when the file allows it
    (``auto_vacuum`` is INCREMENTAL: :func:`vacuum_offline` turns it on), each step sized to
    hold the write lock about ``step_seconds`` at most and followed by a PASSIVE checkpoint
    (see :mod:`hermes_store.ops.pacing`). PostgreSQL: the GIN pending lists and ``ANALYZE``;
    autovacuum returns the space.
    """
    bound = pacing.check_bound(step_seconds)
    log = step_log if step_log is not None else pacing.StepLog()
    report = Report(uow.engine.dialect.name, database_bytes(uow), bound_s=bound)
    with paced_index_merging(uow):
        merge_index(uow, report, step_seconds=bound, step_log=log, pause=pause, on_step=on_step)
    if uow.is_sqlite:
        _, step = pacing.run_step(uow, pacing.Pace("analyze", 1, 1, 1, bound), log, _analyze_step)
        report.record(step)
        if on_step is not None:
            on_step("analyze", 1)
        pacing.between_steps(uow, step, pause)
        auto_vacuum, free, page_size = free_space(uow)
        if auto_vacuum == 2:
            pace = pacing.Pace("vacuum", VACUUM_PAGES, MIN_VACUUM_PAGES, MAX_VACUUM_PAGES, bound)

            def body(conn: Connection, budget: pacing.Budget) -> tuple[int, int]:
                freed = 0
                while True:
                    piece = max(1, min(VACUUM_STATEMENT_PAGES, budget.size - freed))
                    now = _vacuum_step(conn, piece)
                    freed += now
                    if now < piece or freed >= budget.size or not budget.left():
                        return freed, freed

            # Bounded by the free pages found now: writers beside the job free pages too.
            while report.pages_freed < free + MAX_VACUUM_PAGES and report.vacuum_steps < MAX_STEPS:
                freed, step = pacing.run_step(uow, pace, log, body)
                report.vacuum_steps += 1
                report.pages_freed += freed
                report.record(step)
                if on_step is not None:
                    on_step("vacuum", freed)
                pacing.between_steps(uow, step, pause)
                if freed <= 0:
                    break
        elif free:
            report.notes.append(
                f"{free * page_size:,} bytes of free pages stay in the file for reuse: its "
                "auto_vacuum is not INCREMENTAL (it was created by the original store or an "
                "older release), which only a full rewrite can change. Run `hermes-store db "
                "optimize --vacuum` once, with every agent and gateway using the file stopped; "
                "from then on `db optimize` returns freed pages online"
            )
        report.free_pages = free_space(uow)[1]
        if not uow.checkpoint():
            report.notes.append("the WAL checkpoint did not run; it is retried by later writes")
    else:
        report.notes.append("PostgreSQL: autovacuum returns freed space (VACUUM FULL offline)")
    report.bytes_after = database_bytes(uow)
    _explain_growth(uow, report)
    return report


def _explain_growth(uow: UnitOfWork, report: Report) -> None:
    """Say why a file that was optimised occupies more than before: merging writes the new
    index segments before the old pages are freed, through the WAL, which then keeps its size
    (SQLite writes over it) until a checkpoint finds no reader and cuts it back."""
    path = sqlite_file(uow.engine.url)
    if path is None or report.bytes_after <= report.bytes_before:
        return
    wal = Path(f"{path}-wal")
    wal_bytes = wal.stat().st_size if wal.exists() else 0
    report.notes.append(
        f"{report.bytes_after - report.bytes_before:,} bytes more than before: the WAL holds "
        f"{wal_bytes:,} bytes of pages already copied into the file, which later writes reuse "
        "(it is removed when the last connection closes); the file itself is "
        f"{path.stat().st_size:,} bytes"
    )


def _damage(connection: sqlite3.Connection) -> list[str]:
    """What a check finds damaged: ``PRAGMA quick_check`` (b-trees) and each full-text
    index's own check (see :func:`fulltext.index_damage`)."""
    problems = [str(row[0]) for row in connection.execute("PRAGMA quick_check")]
    return ([] if problems == ["ok"] else problems[:3]) + fulltext.index_damage(connection)


def vacuum_offline(path: Path) -> tuple[int, int]:
    """A full ``VACUUM`` of a SQLite file nobody else has open; turns on incremental vacuum.

    Refuses with :class:`DatabaseLockedError` when any other connection (any process) has the
    file open: the exclusive locking mode cannot take the file then, and with
    :class:`NotADatabaseError` when the file fails ``quick_check`` or a full-text index fails
    FTS5's integrity-check (nothing is changed then). Returns bytes before and after (the WAL
    included).
    """
    if not path.exists():
        raise InvalidInputError(f"there is no database at {path}")

    def size() -> int:
        wal = Path(f"{path}-wal")
        return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

    before = size()
    connection = files.connect_sqlite(path, timeout=0)
    try:
        with mapped_driver_errors(dbapi_error=sqlite3.Error):
            _take_alone(connection, path)
            connection.execute("COMMIT")
            damage = _damage(connection)
            if damage:
                raise NotADatabaseError(
                    f"{path} is damaged, so it was not vacuumed (a vacuum copies the damage "
                    f"into the new file): {'; '.join(damage)}. Run `hermes-store doctor` "
                    "(`--rebuild-index` repairs the full-text index)"
                )
            connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
            connection.execute("VACUUM")
            connection.execute("PRAGMA wal_checkpoint(PASSIVE)")
            connection.execute("PRAGMA locking_mode=NORMAL")
            connection.execute("SELECT count(*) FROM sqlite_master").fetchall()
    finally:
        connection.close()
    return before, size()


def _size(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def _take_alone(connection: sqlite3.Connection, path: Path) -> None:
    """SQLite's exclusive lock on the file, in an open transaction; :class:`DatabaseLockedError`
    at once when any other connection (any process) has the file open: in WAL mode each one
    holds a shared lock on it for as long as it is open."""
    connection.execute("PRAGMA locking_mode=EXCLUSIVE")
    try:
        connection.execute("BEGIN EXCLUSIVE")
    except sqlite3.OperationalError as error:
        raise DatabaseLockedError(
            f"{path} is open in another process or connection: stop every agent, gateway and "
            "job using it before a full vacuum (or run `hermes-store db optimize` without "
            "--vacuum, which works online)"
        ) from error


def vacuum_swap(path: Path) -> tuple[int, int]:
    """A compacted copy of a SQLite file swapped in for it: the file is never rewritten in
    place (a replica following its WAL, such as Litestream, sees a new file instead of pages
    changing under it). Turns on incremental vacuum in the copy.

    Refuses with :class:`DatabaseLockedError` while any other connection (any process) has
    the file open. ``VACUUM INTO`` writes the copy beside the file (owner-only, then given
    the file's mode and owner) from one read snapshot, without the write lock; the copy is
    checked (:func:`backup.check_snapshot`, :class:`NotADatabaseError` when it fails), put in
    WAL mode and flushed to disk. Only then is the file taken alone, under SQLite's exclusive
    lock: refused with :class:`DatabaseLockedError`, nothing changed and the copy removed,
    when that lock cannot be had, when anything was committed after the snapshot (``PRAGMA
    data_version`` moved) or when the path names another file than the one copied (another
    swap landed meanwhile). Under the lock the old file leaves WAL mode (its WAL
    checkpointed into it and removed, its ``-shm`` removed), so no side file of it is left
    under the names the new file's WAL and shared memory take, and the copy is renamed over
    it: a crash at any point leaves the old file or the new one, each whole (and perhaps the
    copy, ``.NAME.PID.HEX.compact``, which the next swap removes). A symbolic link stays a
    link, to the new file. A connection opened before the swap but not yet used (so holding
    no lock) reads the old file afterwards and cannot write it (SQLite refuses writes to a
    file moved away). Returns bytes before and after (the WAL included).
    """
    if not path.exists():
        raise InvalidInputError(f"there is no database at {path}")
    real = Path(os.path.realpath(path))  # a symlink stays a symlink to the new file
    old = real.stat()
    before = _size(real)
    probe = files.connect_sqlite(real, timeout=0)
    try:  # the cheap refusal first: a copy of a file in use would be made for nothing
        with mapped_driver_errors(dbapi_error=sqlite3.Error):
            _take_alone(probe, path)
            probe.execute("ROLLBACK")
    finally:
        probe.close()
    files.remove_dead_partials(real, ("compact",))
    partial = files.partial_path(real, "compact")
    if not create_private_file(partial):  # a random name: planted (a link?) or left
        raise UnsafePathError(f"{partial} exists already: the copy is not written through it")
    try:
        _take_mode_and_owner(partial, old, path)
        copied = files.file_key(real)  # the file the connection opens, unless swapped meanwhile
        connection = files.connect_sqlite(real)  # the copy only reads: it waits as a reader
        try:
            with mapped_driver_errors(dbapi_error=sqlite3.Error):
                version = connection.execute("PRAGMA data_version").fetchone()[0]
                if connection.execute("PRAGMA auto_vacuum").fetchone()[0] == 0:
                    # Read by VACUUM INTO for its copy; on a file without auto-vacuum the
                    # pragma cannot change the file itself and takes no lock (on a file with
                    # it, it would write the file: the copy is set instead, below).
                    connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
                connection.execute("VACUUM INTO ?", (str(files.sqlite_uri(partial).database),))
                _ready_copy(partial, path)
                connection.execute("PRAGMA busy_timeout=0")
                _take_alone(connection, path)
                moved = files.file_key(real) != copied
                if moved or connection.execute("PRAGMA data_version").fetchone()[0] != version:
                    connection.execute("ROLLBACK")
                    raise DatabaseLockedError(
                        f"{path} was {'replaced' if moved else 'written'} while its compacted "
                        "copy was made, so the copy is not swapped in: stop every process "
                        "using it and run this again"
                    )
                connection.execute("COMMIT")  # the exclusive lock stays (locking_mode)
                # The WAL checkpointed into the old file and removed: nothing of the old file
                # is left under the new one's -wal; a crash from here leaves the old file
                # whole, in rollback-journal mode (the store's next open puts it back in WAL).
                connection.execute("PRAGMA journal_mode=DELETE")
                for sidecar in files.sidecars(real):  # the -shm (and the emptied -journal)
                    sidecar.unlink()
                os.replace(partial, real)
                files.fsync_path(real.parent)
        finally:
            # The old inode, in rollback-journal mode: its close touches no side file by name.
            connection.close()
    finally:
        partial.unlink(missing_ok=True)
        for sidecar in files.sidecars(partial):
            sidecar.unlink(missing_ok=True)
    return before, _size(real)


def _take_mode_and_owner(partial: Path, old: os.stat_result, path: Path) -> None:
    """Give the (still empty) copy the replaced file's permission bits and owner: a file a
    group or another user's process reads (a replicator, a backup job) stays readable by it,
    and SQLite gives the new -wal and -shm the same. :class:`AccessDeniedError` when this
    process may not give it that owner (the file would change hands)."""
    descriptor = os.open(partial, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:  # no SQLite connection has the copy open yet: closing drops no lock
        mine = os.fstat(descriptor)
        if (mine.st_uid, mine.st_gid) != (old.st_uid, old.st_gid):
            try:
                os.fchown(descriptor, old.st_uid, old.st_gid)
            except PermissionError:
                raise AccessDeniedError(
                    f"{path} belongs to uid {old.st_uid} gid {old.st_gid}: its compacted copy "
                    "cannot be given that owner by this user, so it is not swapped; run this "
                    "as the file's owner"
                ) from None
        os.fchmod(descriptor, stat.S_IMODE(old.st_mode))
    finally:
        os.close(descriptor)


def _ready_copy(partial: Path, path: Path) -> None:
    """Check the copy, put it in WAL mode with incremental vacuum, and flush it to disk; it
    is still our private file, not the database, so this happens before the lock is taken."""
    problems = backup.check_snapshot(partial)
    if problems:
        raise NotADatabaseError(
            f"{path} was not swapped: its compacted copy failed the checks "
            f"({'; '.join(problems[:3])}). Run `hermes-store doctor`"
        )
    copy = files.connect_sqlite(partial)
    try:
        # From full to incremental is a header change; from none it would need a VACUUM
        # (the copy of such a file got incremental from VACUUM INTO already).
        copy.execute("PRAGMA auto_vacuum=INCREMENTAL")
        copy.execute("PRAGMA journal_mode=WAL")
        mode = copy.execute("PRAGMA auto_vacuum").fetchone()[0]
    finally:
        copy.close()
    if mode != 2:
        raise NotADatabaseError(f"{path} was not swapped: its copy has auto_vacuum={mode}")
    for sidecar in files.sidecars(partial):  # left by the connections, if any
        sidecar.unlink()
    files.fsync_path(partial)  # our own copy, every connection on it closed: no lock to lose
