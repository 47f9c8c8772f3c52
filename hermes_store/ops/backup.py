"""Online backup and restore of a SQLite store, while other processes keep writing.

**Backup** copies a consistent snapshot: the copy runs inside one read transaction on the live
file, so it holds exactly what was committed when it began (whatever writers commit meanwhile
goes to the WAL, which readers never block in WAL mode) and it never takes the write lock.
Two ways, same guarantee: SQLite's backup API (``method="backup"``, the default: a page-exact
copy made in steps, so it can report progress) or ``VACUUM INTO`` (``method="vacuum"``: a
compacted copy, one statement). The copy is written to an owner-only (0600) temporary file
beside the destination and linked into place when complete, so a destination path is either
absent or a whole snapshot.

**Restore** writes a snapshot *into* the live database with the backup API, which holds the
live file's write lock until the last page is in: other processes that keep the file open see
the restored content on their next transaction. The file is never replaced (processes holding
it open would go on writing into the old, unlinked one). A snapshot this release could not open
(a newer release's schema) is refused; a live file it cannot open is not, when named by its
path: restore is how such a file is put back.

PostgreSQL: these functions refuse and name the server's own tools (``pg_dump``/``pg_restore``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sqlalchemy.engine import Engine

from hermes_store.echo import echoed
from hermes_store.engine import files
from hermes_store.engine.factory import (
    Target,
    create_private_file,
    expand_home,
    sqlite_file,
    to_url,
    unreadable_in_wal,
)
from hermes_store.errors import (
    DatabaseLockedError,
    HermesStoreError,
    InvalidInputError,
    NotADatabaseError,
    SchemaError,
    StorageFullError,
    StorageIOError,
    UnsafePathError,
    map_driver_error,
    mapped_driver_errors,
    open_errors,
    sqlite_interrupted,
)
from hermes_store.schema import ddl, fulltext, migrate

#: Pages per backup step (4 MiB with 4 KiB pages): the unit of progress reports.
BACKUP_PAGES = 1024
#: Bytes the copy writes before it flushes them to disk. Writers fsync their WAL on every
#: commit; a copy that leaves a gigabyte of dirty pages for the kernel (or for one final fsync)
#: makes those commits queue behind its writeback for hundreds of milliseconds, so the copy
#: writes in small flushed increments instead.
SYNC_BYTES = 4 * 1024 * 1024
#: The private name's kind of a copy being written (``.NAME.PID.HEX.backup`` beside the target).
_BUILD_KIND = "backup"
#: Seconds since its last change after which the copy a killed backup left under ANOTHER name
#: in the target's folder (``.state-2026-12-07.db.PID.HEX.backup``: dated names are never
#: backed up to again) is removed, once its process is gone from this machine. A live copy is
#: written (and so touched) as it goes; the age keeps a backup that runs elsewhere (another pid
#: namespace, another host sharing the folder: its pid means nothing here) from losing its
#: copy, as :data:`hermes_store.schema.migrate.STALE_TEMP_AFTER_S` does for new databases.
OTHER_COPIES_STALE_AFTER_S = 3600.0
#: How long (seconds) a restore waits for another process's write to end before it gives up:
#: the copy takes the live file's write lock at its first step, waiting this busy timeout.
RESTORE_LOCK_WAIT_S = 30.0
#: How often (SQLite virtual-machine instructions) ``VACUUM INTO`` looks at what it has written.
VACUUM_CHECK_OPS = 20_000
Method = Literal["backup", "vacuum"]
#: Called with (pages done, pages in total).
Progress = Callable[[int, int], None]


class NotSupportedError(HermesStoreError, ValueError):
    """The operation does not exist on this backend (the message says what to use instead)."""


class SnapshotError(HermesStoreError, ValueError):
    """A snapshot failed its checks: it is not written anywhere."""


PG_BACKUP_HINT = (
    "PostgreSQL keeps its own consistent snapshots: back up with "
    "`pg_dump --format=custom --file=hermes.dump DBNAME` (online, no lock on writers) and "
    "restore with `pg_restore --clean --if-exists --dbname=DBNAME hermes.dump`"
)


@dataclass
class BackupReport:
    """What :func:`backup` wrote."""

    source: str
    destination: str
    method: str
    bytes: int
    pages: int
    seconds: float
    verified: bool | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class RestoreReport:
    """What :func:`restore` wrote into the live database."""

    database: str
    snapshot: str
    pages: int
    seconds: float
    sessions: int
    messages: int


def _live_file(target: Target, what: str) -> Path:
    url = target.url if isinstance(target, Engine) else to_url(target)
    path = sqlite_file(url)
    if path is None:
        if url.get_backend_name() == "sqlite":
            raise NotSupportedError(f"an in-memory database has no file to {what}")
        raise NotSupportedError(f"{what} works on SQLite files only. {PG_BACKUP_HINT}")
    return path


def _is_database_or_sidecar(candidate: Path, database: Path) -> bool:
    live = database.resolve()
    return candidate.resolve() in {Path(f"{live}{s}") for s in ("", *files.SIDECAR_SUFFIXES)}


def backup(
    engine: Engine,
    destination: str | os.PathLike[str],
    *,
    method: Method = "backup",
    overwrite: bool = False,
    verify: bool = False,
    progress: Progress | None = None,
    pages_per_step: int = BACKUP_PAGES,
    sync_bytes: int = SYNC_BYTES,
    pause: float = 0.0,
) -> BackupReport:
    """Copy a consistent snapshot of the database ``engine`` opens to ``destination`` (0600).

    Writers keep writing throughout; the copy holds every transaction committed before it
    began and nothing committed after. ``verify`` opens the copy and runs the integrity
    checks (:func:`check_snapshot`); a copy that fails them is removed and
    :class:`SnapshotError` raised. An existing destination is refused unless ``overwrite``.
    The copy is flushed to disk every ``sync_bytes`` (0: once, at the end) and ``pause``
    seconds are slept after each flush, so writers' own fsyncs never wait behind a backlog of
    the copy's dirty pages. A full disk raises :class:`StorageFullError`, another failed write
    or flush :class:`StorageIOError`; nothing of the copy is left beside ``destination``.
    """
    source = _live_file(engine, "back up")
    if method not in ("backup", "vacuum"):
        raise InvalidInputError(f"method must be 'backup' or 'vacuum', not {echoed(method)}")
    if isinstance(pages_per_step, bool) or not isinstance(pages_per_step, int):
        raise InvalidInputError("pages_per_step must be a whole number")
    if isinstance(sync_bytes, bool) or not isinstance(sync_bytes, int) or sync_bytes < 0:
        raise InvalidInputError("sync_bytes must be a whole number >= 0")
    if isinstance(pause, bool) or not isinstance(pause, int | float) or not 0 <= pause <= 10:
        raise InvalidInputError("pause must be a number of seconds from 0 to 10")
    if not isinstance(destination, str | os.PathLike) or isinstance(destination, bytes):
        raise InvalidInputError(f"destination must be a path, not {type(destination).__name__}")
    raw = os.fspath(destination)
    if not isinstance(raw, str):
        raise InvalidInputError("destination must be a text path, not bytes")
    if "\x00" in raw:  # the OS would refuse it later with a bare ValueError
        raise InvalidInputError("destination contains a NUL character")
    try:
        os.fsencode(raw)
    except UnicodeEncodeError:  # a lone surrogate: no file system can hold that name
        raise InvalidInputError("destination is not a valid file name") from None
    target = expand_home(raw, "destination")
    if _is_database_or_sidecar(target, source):
        raise InvalidInputError(f"refusing to back up onto the database itself ({target})")
    if target.is_dir():
        raise InvalidInputError(f"{target} is a folder: give the backup file's name")
    kind = files.special_kind(target)
    if kind is not None:  # /dev/null, a FIFO: the rename would replace it with the snapshot
        raise InvalidInputError(f"refusing to back up onto {target}: it is {kind}, not a file")
    if os.path.lexists(target) and not overwrite:
        # A link is replaced itself (never written through), dangling or not: say so.
        what, it = _existing(target)
        raise InvalidInputError(
            f"{target} {what} (pass overwrite=True to replace {it})"
        ).with_cli_message(f"{target} {what} (use --force to replace {it})")
    if overwrite and files.sidecars(target):
        raise InvalidInputError(
            f"{target} has -wal/-shm files beside it: it looks like a database in use; "
            "refusing to replace it"
        )
    if not target.parent.is_dir():
        raise InvalidInputError(f"the folder {target.parent} does not exist")

    # What killed backups left goes first (their process gone): nothing else would ever
    # remove it. A copy of this target at once; those of other names in its folder (a dated
    # name is never backed up to again) once they are old enough to be no live backup's.
    files.remove_dead_partials(target, (_BUILD_KIND,))
    files.remove_dead_partials_in(
        target.parent, (_BUILD_KIND,), older_than=OTHER_COPIES_STALE_AFTER_S
    )
    partial = files.partial_path(target, _BUILD_KIND)
    started = time.monotonic()
    if not create_private_file(partial):  # a random name: planted (a link?) or left
        raise UnsafePathError(f"{partial} exists already: the copy is not written through it")
    try:
        # SQLite's errors (a full disk, a failed write) come out as the package names them.
        with mapped_driver_errors(dbapi_error=sqlite3.Error):
            pages = _copy(
                source, partial, method, progress, pages_per_step, _Flusher(sync_bytes, pause)
            )
        report = BackupReport(str(source), str(target), method, partial.stat().st_size, pages, 0.0)
        if verify:
            report.problems = check_snapshot(partial)
            report.verified = not report.problems
            if report.problems:
                raise SnapshotError(
                    f"the copy failed its checks and was removed: {'; '.join(report.problems)}"
                )
        for sidecar in files.sidecars(partial):  # left by the checks' connection, if any
            sidecar.unlink()
        if overwrite:
            os.replace(partial, target)
        else:
            try:  # fails rather than replace a file that appeared meanwhile
                os.link(partial, target)
            except FileExistsError:
                raise InvalidInputError(
                    f"{target} was created while the backup ran: it was left as it was"
                ) from None
    except (StorageFullError, StorageIOError) as error:
        raise _stopped(error, f"the backup to {target} was not written") from error
    finally:
        partial.unlink(missing_ok=True)
        # A VACUUM INTO that failed leaves the copy's -journal (a -wal, a -shm) beside it.
        for sidecar in files.sidecars(partial):
            sidecar.unlink(missing_ok=True)
    report.seconds = time.monotonic() - started
    return report


def _existing(target: Path) -> tuple[str, str]:
    """What is at ``target`` (there, if only as a link) and what a replacement replaces, in
    words for a refusal: a symbolic link is named as one, dangling or not, since it is the
    link that is replaced, never what it names."""
    if not target.is_symlink():
        return "exists", "it"
    try:
        points = os.readlink(target)
    except OSError:
        points = "?"
    if target.exists():
        return f"is a symbolic link to {points}", "the link itself"
    return f"is a dangling symbolic link: {points} does not exist", "the link itself"


def _stopped(error: StorageFullError | StorageIOError, what: str) -> HermesStoreError:
    """The same kind of error, saying which operation it stopped: the driver's words name only
    "the database", which would have a reader believe the live file is the one in trouble."""
    kind = StorageFullError if isinstance(error, StorageFullError) else StorageIOError
    return kind(f"{what}: {error}")


def _flush_error(error: OSError) -> HermesStoreError:
    """The package error for a failed flush of the copy (a full disk often says so only at
    ``fsync``, a failing one with ``EIO``)."""
    reason = error.strerror or str(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StorageFullError(f"no space left for the copy: {reason}")
    return StorageIOError(f"the operating system failed to flush the copy to disk: {reason}")


class _Flusher:
    """Flushes the copy's file to disk each time it has grown by ``every`` bytes."""

    def __init__(self, every: int, pause: float) -> None:
        self.every, self.pause = every, pause
        self.fd = -1
        self.flushed = 0
        #: A flush that failed inside SQLite's callback, which can only stop the copy: raised
        #: by :meth:`check` once SQLite has returned.
        self.failed: HermesStoreError | None = None

    def __call__(self, *_: object) -> int:
        """Also the ``VACUUM INTO`` progress handler: returning 0 lets the statement go on,
        1 (a flush failed) interrupts it, since an exception raised there would be lost."""
        if self.failed is not None:
            return 1
        if self.every and self.fd >= 0:
            size = os.fstat(self.fd).st_size
            if size - self.flushed >= self.every:
                try:
                    os.fdatasync(self.fd)
                except OSError as error:
                    self.failed = _flush_error(error)
                    self.failed.__cause__ = error
                    return 1
                self.flushed = size
                if self.pause:
                    time.sleep(self.pause)  # not synchronisation: leaves the disk to writers
        return 0

    def check(self) -> None:
        """Raise the error of a flush that failed inside SQLite's callback, if one did."""
        if self.failed is not None:
            raise self.failed

    def finish(self) -> None:
        if self.fd >= 0:
            try:
                os.fsync(self.fd)
            except OSError as error:
                raise _flush_error(error) from error


def _copy(
    source: Path,
    partial: Path,
    method: Method,
    progress: Progress | None,
    step: int,
    flusher: _Flusher,
) -> int:
    """Copy ``source`` into the empty file ``partial``; returns the pages copied."""
    # A file in a folder this process cannot write is read as the stores read it: immutable.
    live = files.connect_sqlite(source, immutable=unreadable_in_wal(source))
    # Our own descriptor on our own private copy, only to flush it: closed after the copy's
    # connection (closing a descriptor drops this process's locks on that file).
    flusher.fd = os.open(partial, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if method == "vacuum":
            # One statement, one read transaction: a consistent, compacted copy. The progress
            # handler flushes what it has written so far.
            live.set_progress_handler(flusher, VACUUM_CHECK_OPS)
            try:
                live.execute("VACUUM INTO ?", (str(files.sqlite_uri(partial).database),))
            except sqlite3.Error as error:
                flusher.check()  # a failed flush interrupted it: that is the error to tell
                if sqlite_interrupted(error):  # Ctrl-C (or SIGTERM), raised in the handler
                    raise KeyboardInterrupt from None
                raise
            live.set_progress_handler(None, 0)
            flusher.finish()
            pages = int(live.execute("PRAGMA page_count").fetchone()[0])
            if progress is not None:
                progress(pages, pages)
            return pages
        # Pin one snapshot for every step: with a read transaction open on the source
        # connection, the steps never see (nor restart on) what writers commit meanwhile.
        live.execute("BEGIN")
        live.execute("SELECT count(*) FROM sqlite_master").fetchone()
        copy = files.connect_sqlite(partial)
        total = 0
        try:
            # The copy is private until it is linked into place: no journal, and we flush.
            copy.execute("PRAGMA journal_mode=OFF")
            copy.execute("PRAGMA synchronous=OFF")

            def report(status: int, remaining: int, pages: int) -> None:
                nonlocal total
                total = pages
                flusher()
                flusher.check()  # raised here, SQLite stops the copy and passes it on
                if progress is not None:
                    progress(pages - remaining, pages)

            live.backup(copy, pages=step if step > 0 else -1, progress=report)
        finally:
            copy.close()
        flusher.finish()
        live.execute("ROLLBACK")
        return total
    finally:
        os.close(flusher.fd)
        flusher.fd = -1
        live.close()


def check_snapshot(path: Path) -> list[str]:
    """The problems of a database file (empty list: sound): SQLite's ``integrity_check`` and
    ``foreign_key_check``, the full-text indexes against their content, the schema at head
    and known to this release (the checks that refuse to open a newer release's file)."""
    problems: list[str] = []
    connection = files.connect_sqlite(path)
    try:
        rows = [r[0] for r in connection.execute("PRAGMA integrity_check")]
        if rows != ["ok"]:
            problems.extend(f"integrity_check: {r}" for r in rows[:5])
            return problems
        if connection.execute("PRAGMA foreign_key_check").fetchone() is not None:
            problems.append("foreign_key_check: rows reference missing sessions")
        tables = {r[0] for r in connection.execute("SELECT name FROM sqlite_master")}
        if not {"sessions", "messages", "alembic_version", ddl.FTS_TABLE} <= tables:
            problems.append("not a hermes-store database at head (tables are missing)")
            return problems
        try:  # the checks that refuse to open a newer release's file: no upgrade helps
            with open_errors(path):  # a failed read is the disk's fault, not the file's
                state = migrate.preflight_sqlite(path)
        except SchemaError as error:
            problems.append(str(error))
            return problems
        revision = state.revision if state is not None else None
        head = migrate.head_revision()
        if revision != head:
            problems.append(
                f"schema at {revision or 'no revision'}, head is {head} "
                "(`hermes-store --db SNAPSHOT db upgrade` brings it to head)"
            )
        problems += fulltext.index_damage(connection)
    except sqlite3.DatabaseError as error:
        mapped = map_driver_error(None, None, error, None, sqlite3.Error)
        if isinstance(mapped, StorageFullError | StorageIOError):
            raise mapped from error  # the disk failed (or is full): the file may be sound
        problems.append(f"not a readable SQLite database: {error}")
    finally:
        connection.close()
    return problems


def _check_live(live: Path) -> None:
    """Refuse to restore over nothing or over a file that is not a SQLite database (a mistyped
    path); any schema is fine. Read through SQLite only, writing nothing."""
    with open_errors(live):
        if migrate.preflight_sqlite(live, adoptable=False) is None:
            raise NotADatabaseError(f"there is no database at {live} to restore into")


def restore(
    engine: Target,
    snapshot: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    pages_per_step: int = BACKUP_PAGES,
) -> RestoreReport:
    """Write ``snapshot`` into the database ``engine`` opens (or the file a path or URL names),
    replacing its content, under its write lock.

    The snapshot is checked first (:func:`check_snapshot`): a damaged file, another schema
    revision, a newer release's schema or a different page size is refused before anything is
    written. Other processes keep their connections; their next transaction reads the restored
    content. Whatever they committed after the snapshot was taken is gone, which is what a
    restore means.

    A live file named by its path need only be a SQLite database: its schema may be one this
    release refuses to open (a newer release's, a damaged one), since restoring a snapshot is
    how such a file is put back. A missing file, or one that is no SQLite database, is refused.
    A full disk raises :class:`StorageFullError`, another failed write :class:`StorageIOError`:
    the copy is one transaction, so the live database keeps its content.
    """
    live = _live_file(engine, "restore")
    source = expand_home(snapshot, "snapshot")
    if not source.is_file():
        raise InvalidInputError(f"there is no snapshot file at {source}")
    if _is_database_or_sidecar(source, live):
        raise InvalidInputError("the snapshot is the live database itself")
    problems = check_snapshot(source)
    if problems:
        raise SnapshotError(f"refusing to restore {source}: {'; '.join(problems)}")
    if not isinstance(engine, Engine):
        _check_live(live)
    started = time.monotonic()
    try:
        with mapped_driver_errors(dbapi_error=sqlite3.Error), contextlib.ExitStack() as stack:
            reader = stack.enter_context(contextlib.closing(files.connect_sqlite(source)))
            writer = stack.enter_context(
                contextlib.closing(files.connect_sqlite(live, timeout=RESTORE_LOCK_WAIT_S))
            )
            total, sessions, messages = _restore_pages(
                reader, writer, source, progress, pages_per_step
            )
    except (StorageFullError, StorageIOError) as error:
        raise _stopped(error, f"restoring {source} into {live} failed") from error
    return RestoreReport(
        str(live), str(source), total, time.monotonic() - started, sessions, messages
    )


def _restore_pages(
    reader: sqlite3.Connection,
    writer: sqlite3.Connection,
    source: Path,
    progress: Progress | None,
    pages_per_step: int,
) -> tuple[int, int, int]:
    """Copy the snapshot ``reader`` opens into ``writer``'s database; returns the pages
    copied and the sessions and messages the live database then holds."""
    theirs = reader.execute("PRAGMA page_size").fetchone()[0]
    ours = writer.execute("PRAGMA page_size").fetchone()[0]
    if theirs != ours:
        raise SnapshotError(
            f"refusing to restore {source}: its page size is {theirs} bytes, the live "
            f"database's {ours}; SQLite cannot restore across page sizes in WAL mode"
        )
    total = 0

    def report(status: int, remaining: int, pages: int) -> None:
        # A step that met another process's write lock had waited the busy timeout already;
        # Python's backup() would sleep and step again forever (a stuck writer: a hang).
        if status in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            raise DatabaseLockedError(
                f"another process kept the live database locked for {RESTORE_LOCK_WAIT_S:g} s "
                f"(a write in progress): nothing of {source} was restored; try again once it "
                "is done"
            )
        nonlocal total
        total = pages
        if progress is not None:
            progress(pages - remaining, pages)

    # The destination's write lock is taken by the first step and held to the last.
    reader.backup(writer, pages=pages_per_step if pages_per_step > 0 else -1, progress=report)
    sessions = writer.execute("SELECT count(*) FROM sessions").fetchone()[0]
    messages = writer.execute("SELECT count(*) FROM messages").fetchone()[0]
    return total, int(sessions), int(messages)
