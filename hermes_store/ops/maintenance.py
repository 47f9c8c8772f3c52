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
only when no other connection has the database open, and refuses otherwise.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from hermes_store.engine import files
from hermes_store.engine.factory import sqlite_file
from hermes_store.errors import (
    DatabaseLockedError,
    InvalidInputError,
    NotADatabaseError,
    mapped_errors,
)
from hermes_store.schema import fulltext
from hermes_store.uow.unit import UnitOfWork

T = TypeVar("T")

#: FTS5 'merge' work per unit (leaf pages written); a few ms of lock each on a 2-core machine.
MERGE_PAGES = 64
#: Freed pages handed back to the file system per unit (``PRAGMA incremental_vacuum``).
VACUUM_PAGES = 2048
#: ``PRAGMA secure_delete`` values by number (0 off, 1 on, 2 fast).
SECURE_DELETE_VALUES = {0: "0", 1: "1", 2: "2"}
#: A guard against an index that never reports "done": plenty for a multi-GB index.
MAX_STEPS = 100_000


@dataclass
class Report:
    """What :func:`optimize` did and how long any one step held the write lock."""

    backend: str
    bytes_before: int
    bytes_after: int = 0
    merge_steps: int = 0
    vacuum_steps: int = 0
    pages_freed: int = 0
    longest_step_s: float = 0.0
    notes: list[str] = field(default_factory=list)


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


def _timed(report: Report, fn: Callable[[Connection], T]) -> Callable[[Connection], T]:
    """``fn`` recording how long it ran inside its unit (the lock is held that long)."""

    def unit(conn: Connection) -> T:
        started = time.monotonic()
        try:
            return fn(conn)
        finally:
            report.longest_step_s = max(report.longest_step_s, time.monotonic() - started)

    return unit


def _merge_step(conn: Connection, secure_delete: bool = False, *, start: bool = False) -> bool:
    """One bounded FTS5 merge; True while it still found work (FTS5 says "done" by changing
    fewer than two rows). ``start``: begin a merge of every segment, as 'optimize' does (a
    negative count); otherwise continue the merge in progress, or merge a level that has
    ``usermerge`` segments."""
    driver: Any = conn.connection.driver_connection
    before = driver.total_changes
    with secure_deletes(conn, secure_delete):
        fulltext.SQLITE.merge_step(conn, -MERGE_PAGES if start else MERGE_PAGES)
    return bool(driver.total_changes - before >= 2)


def index_shape(conn: Connection) -> fulltext.IndexShape | None:
    """The full-text index's levels and segments; :class:`NotADatabaseError` when its
    structure record is damaged (FTS5 would fail every statement on the table)."""
    try:
        return fulltext.structure(conn)
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


def merge_index(
    uow: UnitOfWork, report: Report | None = None, *, secure_delete: bool = False
) -> int:
    """Merge the full-text index's segments in bounded steps until it is compact.

    Deleted rows only leave an FTS5 index when the segments holding them are merged, so this
    is also what makes pruned text disappear from the index. Returns the number of steps.
    PostgreSQL: one unit that flushes the GIN pending lists and refreshes statistics.
    """
    report = report or Report(uow.engine.dialect.name, 0)
    if not uow.is_sqlite:
        uow.run(_timed(report, fulltext.POSTGRESQL.optimize))
        report.merge_steps += 1
        return 1
    # Writers keep adding small segments, so "no work left" may never come under load: the
    # budget is what merging the index as it stands would take.
    with uow.connect(write=False) as conn:
        leaves = fulltext.SQLITE.leaf_pages(conn)
        shape = index_shape(conn)
    # One start per job (see the module's docstring); the steps after it continue that merge.
    start = shape is not None and shape.levels + 2 <= fulltext.DEEP_LEVELS
    if shape is not None and not start:
        report.notes.append(
            f"the full-text index has {shape.levels} levels, so no full merge was started "
            f"(each start adds levels; FTS5 fails past {fulltext.FTS5_MAX_STRUCTURE:,}): "
            "`hermes-store doctor "
            "--rebuild-index` makes it shallow again"
        )
    steps = 0
    for _ in range(min(MAX_STEPS, leaves // MERGE_PAGES + 16)):
        first = start and steps == 0
        steps += 1
        step = _timed(report, partial(_merge_step, secure_delete=secure_delete, start=first))
        if not uow.run(step):
            break
    report.merge_steps += steps
    return steps


def _vacuum_step(conn: Connection) -> int:
    """Up to ``VACUUM_PAGES`` freed pages handed back. The statement frees one page per step
    of it, and Python's driver steps a statement that returns no columns once and resets it
    (so one execution freed one page: a transaction per page): it is run once per page."""
    before = int(conn.exec_driver_sql("PRAGMA freelist_count").scalar() or 0)
    if before <= 0:
        return 0
    driver: Any = conn.connection.driver_connection
    cursor = driver.cursor()
    try:
        cursor.executemany("PRAGMA incremental_vacuum", [()] * min(before, VACUUM_PAGES))
    finally:
        cursor.close()
    after = int(conn.exec_driver_sql("PRAGMA freelist_count").scalar() or 0)
    return before - after


def optimize(uow: UnitOfWork) -> Report:
    """Compact what can be compacted online, one short write unit at a time.

    SQLite: merge the full-text index, ``PRAGMA optimize`` (statistics for the planner), give
    freed pages back with ``incremental_vacuum`` when the file allows it (``auto_vacuum`` is
    INCREMENTAL: :func:`vacuum_offline` turns it on), then a PASSIVE checkpoint. PostgreSQL:
    the GIN pending lists and ``ANALYZE``; autovacuum returns the space.
    """
    report = Report(uow.engine.dialect.name, database_bytes(uow))
    merge_index(uow, report)
    if uow.is_sqlite:
        uow.run(_timed(report, lambda conn: conn.exec_driver_sql("PRAGMA optimize")))
        with uow.connect(write=False) as conn:
            auto_vacuum = int(conn.exec_driver_sql("PRAGMA auto_vacuum").scalar() or 0)
        if auto_vacuum == 2:
            for _ in range(MAX_STEPS):
                freed = uow.run(_timed(report, _vacuum_step))
                report.vacuum_steps += 1
                report.pages_freed += freed
                if freed <= 0:
                    break
        else:
            report.notes.append(
                "auto_vacuum is not INCREMENTAL, so freed pages stay in the file for reuse; "
                "`hermes-store db optimize --vacuum` (with every other process stopped) "
                "rewrites the file and turns it on"
            )
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
        with mapped_errors():
            connection.execute("PRAGMA locking_mode=EXCLUSIVE")
            try:
                connection.execute("BEGIN EXCLUSIVE")
            except sqlite3.OperationalError as error:
                raise DatabaseLockedError(
                    f"{path} is open in another process or connection: stop every agent, "
                    "gateway and job using it before a full vacuum (or run `hermes-store db "
                    "optimize` without --vacuum, which works online)"
                ) from error
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
