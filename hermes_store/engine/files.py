"""The database's files on disk, looked at without disturbing SQLite's locks.

SQLite's POSIX advisory locks belong to the process, not to the connection: closing *any*
descriptor on the database file releases every lock this process holds on it, including those
of live connections. Another process may then believe it is the last user, checkpoint and unlink
the WAL, and this process's later commits go into an unlinked file and vanish. So this package
never opens the database, its ``-wal`` or its ``-shm`` with a plain file handle: it reads them
through SQLite (whose connections in one process share their locks), and only ``stat``\\ s paths.

Paths reach SQLite as URIs (``file:...?mode=ro``) where a connection needs flags; they are
percent-encoded here, so folders named ``My%20Files`` or ``a#b?c`` open the file they name.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sqlite3
import stat
import time
from pathlib import Path
from urllib.parse import quote, unquote, unquote_to_bytes

from sqlalchemy.engine import URL

from hermes_store.errors import DatabaseAliasError, InvalidInputError

log = logging.getLogger(__name__)

#: The files SQLite keeps beside a database while it is (or was) open.
SIDECAR_SUFFIXES = ("-wal", "-shm", "-journal")
#: The writer queue's lock file beside a database (:mod:`hermes_store.uow.writequeue`); only ever
#: locked through descriptors held while a store has the file open, and harmless to leave behind.
WRITER_LOCK_SUFFIX = "-writer.lock"
#: Folder entries looked at (per folder) to name a database's other hard link.
MAX_ALIAS_SCAN = 10_000


def sqlite_uri(path: Path, **params: str) -> URL:
    """A SQLAlchemy URL that hands SQLite ``file:<path>?<params>`` with the path percent-encoded.

    ``URL.create`` keeps the database string as given (``make_url`` would decode it first),
    and SQLite decodes the ``%XX`` escapes itself, so any character of a path survives (``?``,
    ``#``, ``%``); a path that is not UTF-8 is refused (:func:`refuse_undecodable`).
    """
    refuse_undecodable(os.fspath(path), "the database path")
    encoded = quote(os.fspath(path), safe="/")
    return URL.create("sqlite", database=f"file:{encoded}", query={**params, "uri": "true"})


def refuse_undecodable(text: str, what: str, *, show: bool = True) -> None:
    """Refuse a path or URL holding bytes that are not UTF-8 (Python carries them as lone
    surrogates: a folder ``b\\xffd`` arrives as ``b\\udcffd``). The store hands SQLite its
    paths as UTF-8 URIs and prints and logs them, so such a name cannot be used faithfully:
    it is refused before anything is created, its bytes shown as escapes (``show``; never
    for a URL, which may hold a password)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = f" {os.fsencode(text).decode('utf-8', 'backslashreplace')}" if show else ""
        raise InvalidInputError(
            f"{what}{shown} is not valid UTF-8; rename the folder (or file) so that its name "
            "is UTF-8: the store opens database paths as UTF-8 URIs"
        ) from None


def connect_sqlite(
    path: Path, *, timeout: float = 5.0, read_only: bool = False, immutable: bool = False
) -> sqlite3.Connection:
    """A plain ``sqlite3`` connection (autocommit: the caller issues BEGIN) through a
    percent-encoded ``file:`` URI: for the backup API and maintenance, which need the driver's
    own connection. A SQLite connection shares this process's locks; a file handle would not.
    ``read_only`` opens it ``mode=ro``; ``immutable`` also without locks (a file in a
    read-only folder)."""
    refuse_aliases(path)
    database = str(sqlite_uri(path).database)
    if immutable:
        database += "?mode=ro&immutable=1"
    elif read_only:
        database += "?mode=ro"
    return sqlite3.connect(
        database,
        uri=True,
        isolation_level=None,
        timeout=timeout,
        check_same_thread=False,
    )


def path_from_uri(database: str) -> Path:
    """The file a ``file:`` URI names, decoded the way SQLite decodes it (see
    :func:`uri_file_name`)."""
    return Path(uri_file_name(database))


def uri_file_name(database: str) -> str:
    """The file name a ``file:`` URI holds, decoded the way SQLite decodes it (``""`` or
    ``":memory:"``: no file). A URI that SQLite would open as another file than the one
    decoded here is refused: an authority other than none or ``localhost`` (SQLite refuses it
    at connect), a ``%00`` (SQLite cuts the name there; ``stat`` refuses it) and escapes that
    decode to bytes which are not UTF-8 (decoded here, they would name another file)."""
    rest = database[len("file:") :]
    if rest.startswith("//"):  # an authority (empty or ``localhost`` on Unix) before the path
        authority, _, path = rest[2:].partition("/")
        if authority not in ("", "localhost"):
            raise InvalidInputError(
                f"the SQLite URI names the host {authority!r}: SQLite opens only local files "
                "(file:/path, file:///path or file://localhost/path)"
            )
        rest = "/" + path
    for stop in ("?", "#"):
        rest = rest.split(stop, 1)[0]
    raw = unquote_to_bytes(rest)
    if b"\x00" in raw:
        raise InvalidInputError(
            "the database path holds a NUL character (%00): no file has such a name"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError(
            "the database path's %-escapes are not valid UTF-8; rename the folder (or file) so "
            "that its name is UTF-8: the store opens database paths as UTF-8 URIs"
        ) from None


def uri_parameters(database: str) -> list[tuple[str, str]]:
    """The parameters written into a ``file:`` URI's own text (``file:x.db?mode=ro``, what a
    ``%3F`` in a SQLAlchemy URL leaves there), decoded as SQLite decodes them."""
    query = database.split("#", 1)[0].partition("?")[2]
    found: list[tuple[str, str]] = []
    for item in query.split("&"):
        if item:
            key, _, value = item.partition("=")
            found.append((unquote(key), unquote(value)))
    return found


def sidecars(path: Path) -> list[Path]:
    """The ``-wal``, ``-shm`` and ``-journal`` files beside ``path`` (someone has or had it
    open). Only ``stat``: never a descriptor on them. Beside the file a symlink names: SQLite
    resolves the link and keeps them there."""
    try:
        real = os.path.realpath(path)
    except ValueError:  # a name no file can have (a lone surrogate): no sidecars either
        return []
    found = (Path(f"{real}{suffix}") for suffix in SIDECAR_SUFFIXES)
    return [p for p in found if p.exists()]


def hot_journal(path: Path, *, timeout: float = 1.0) -> Path | None:
    """The hot rollback journal beside ``path``, if any: a writer in rollback-journal mode died
    mid-transaction, so the file holds part of a transaction that never committed until
    SQLite rolls it back. An ``immutable`` reader ignores the journal and reads that torn file.

    SQLite decides what is hot (a non-empty journal, a header not zeroed, no writer holding the
    RESERVED lock, a non-empty database), so ask it: a ``mode=ro`` read meets a hot journal as
    ``SQLITE_READONLY_ROLLBACK`` and rolls nothing back. Only ``stat`` and a SQLite connection:
    never a descriptor of our own on the files. Errors other than that one say nothing about
    the journal and are left to the open that follows."""
    try:
        journal = Path(f"{os.path.realpath(path)}-journal")
        if journal.stat().st_size == 0:  # SQLite treats an empty journal as absent
            return None
    except (OSError, ValueError):  # no journal, or a name no file can have
        return None
    try:
        connection = connect_sqlite(path, timeout=timeout, read_only=True)
    except sqlite3.Error as error:
        log.debug("%s: cannot look for a hot journal (%s); the open will say", path, error)
        return None
    try:
        connection.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as error:
        if error.sqlite_errorcode == sqlite3.SQLITE_READONLY_ROLLBACK:
            return journal
        log.debug("%s: cannot look for a hot journal (%s); the open will say", path, error)
    finally:
        connection.close()
    return None


#: A file's identity, whatever path names it: (device, inode).
FileKey = tuple[int, int]


def file_key(path: Path) -> FileKey:
    """The identity of an existing file: (device, inode), whatever path names it."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process here (another user's counts as alive): whether a
    temporary file named after its creator's pid may still be in use."""
    if pid <= 0 or pid == os.getpid():  # ours, or no creator's at all: keep the file
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def fsync_path(path: Path) -> None:
    """Flush a file (or a folder: its entries) to disk. Only for a file no SQLite connection
    of this process has open (closing the descriptor would drop its locks: see above)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    descriptor = os.open(path, flags | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


#: What the package builds beside a database under a private name, ``.NAME.PID.HEX.KIND``,
#: before the file takes the real name: a new database (``new``), an import's new file
#: (``import``) and a backup's copy (``backup``) are hard-linked into place, then their private
#: name removed (a backup that may replace its target is renamed over it); a vacuum swap's
#: compacted copy (``compact``) is renamed over the database.
PARTIAL_KINDS = ("new", "import", "backup", "compact")
#: The kinds hard-linked into place: for a moment (or for good, if the process is killed
#: then) the database has that second name, which is no alias (see :func:`refuse_aliases`).
LINKED_KINDS = ("new", "import", "backup")


def partial_path(real: Path, kind: str) -> Path:
    """A private name beside ``real`` for a file this process builds before it takes the
    real name (``.NAME.PID.HEX.KIND``): the pid says whose it is (:func:`remove_dead_partials`)."""
    return real.parent / f".{real.name}.{os.getpid()}.{secrets.token_hex(8)}.{kind}"


def _partial_names(name: str, kinds: tuple[str, ...]) -> str:
    """The regular expression of :func:`partial_path`'s names for ``name`` and ``kinds`` (the
    pid is absent from the ``new`` files of older releases; copies of older releases had 12
    hexadecimal digits)."""
    return (
        rf"\.{re.escape(name)}\.(?:(?P<pid>\d{{1,10}})\.)?[0-9a-f]{{12,16}}"
        rf"\.(?:{'|'.join(map(re.escape, kinds))})"
    )


#: What follows a partial's name when it is one of its side files (SQLite's, the queue's lock).
_SIDE_FILES = rf"(?:{'|'.join(map(re.escape, (*SIDECAR_SUFFIXES, WRITER_LOCK_SUFFIX)))})?"


def _any_partial_names(kinds: tuple[str, ...]) -> str:
    """The regular expression of :func:`partial_path`'s names of ANY file's builds of
    ``kinds``: ``.NAME.PID.HEX.KIND``, the pid required (a name without one cannot be told
    from a name that merely ends in digits, so it is never matched here). The pid, the hex
    and the kind hold no dot, so they are always the last three parts of the name."""
    return (
        rf"\.(?P<name>.+)\.(?P<pid>\d{{1,10}})\.[0-9a-f]{{12,16}}"
        rf"\.(?:{'|'.join(map(re.escape, kinds))})"
    )


def remove_dead_partials(
    real: Path, kinds: tuple[str, ...], *, older_than: float = 0.0
) -> list[Path]:
    """Remove what killed builds of ``kinds`` left beside ``real``: ``.NAME.PID.HEX.KIND`` (and
    its side files) whose process no longer exists on this machine AND that is older than
    ``older_than`` seconds (the age also covers builders in other pid namespaces or on other
    hosts sharing the folder); a name without a pid (older releases) goes on its age alone,
    and only with one given. Anything else is never touched, nor a link or a folder. Returns
    what was removed."""
    pattern = re.compile(_partial_names(real.name, kinds) + _SIDE_FILES)
    return _remove(real.parent, pattern, older_than, f"beside {real}")


def remove_dead_partials_in(
    folder: Path, kinds: tuple[str, ...], *, older_than: float
) -> list[Path]:
    """:func:`remove_dead_partials` for the builds of ``kinds`` of ANY name in ``folder``
    (``.NAME.PID.HEX.KIND`` and its side files, the pid required: see
    :func:`_any_partial_names`), whose process no longer exists on this machine AND that are
    older than ``older_than`` seconds: the copies killed backups left under names no later
    backup takes again (``state-2026-12-07.db``). The age keeps them from a build that is
    alive elsewhere (another pid namespace, another host sharing the folder), which goes on
    writing (and so touching) its file. Returns what was removed."""
    pattern = re.compile(_any_partial_names(kinds) + _SIDE_FILES)
    return _remove(folder, pattern, older_than, f"in {folder}")


def dead_partials(folder: Path, kinds: tuple[str, ...]) -> list[Path]:
    """What :func:`remove_dead_partials_in` would remove from ``folder`` regardless of age,
    removing nothing: the builds of ``kinds`` of any name (and their side files) whose
    process no longer exists on this machine. Only ``lstat`` and ``kill(pid, 0)``."""
    pattern = re.compile(_any_partial_names(kinds) + _SIDE_FILES)
    return [Path(entry.path) for entry in _dead_entries(folder, pattern, 0.0)]


def _dead_entries(
    folder: Path, pattern: re.Pattern[str], older_than: float
) -> list[os.DirEntry[str]]:
    """The regular files (never a link or a folder) of ``folder`` whose whole name matches
    ``pattern``, whose ``pid`` (when the name has one) names no live process here, and whose
    last change is older than ``older_than`` seconds; a name without a pid only with an age."""
    try:
        with os.scandir(folder) as listing:
            entries = list(listing)
    except OSError as error:  # no folder yet (nothing left in it), or not ours to list
        log.debug("cannot list %s for what dead builds left: %s", folder, error)
        return []
    found: list[os.DirEntry[str]] = []
    now = time.time()
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        pid = match.group("pid")
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if now - entry.stat(follow_symlinks=False).st_mtime <= older_than:
                continue
        except OSError:  # removed meanwhile
            continue
        if (pid is None and older_than <= 0) or (pid is not None and pid_alive(int(pid))):
            continue
        found.append(entry)
    return found


def _remove(folder: Path, pattern: re.Pattern[str], older_than: float, where: str) -> list[Path]:
    """Unlink :func:`_dead_entries` (never following a link: ``unlink`` removes a name)."""
    removed: list[Path] = []
    for entry in _dead_entries(folder, pattern, older_than):
        try:
            os.unlink(entry.path)
        except FileNotFoundError:  # removed meanwhile
            continue
        except OSError as error:  # another user's, in a shared folder: theirs to remove
            log.warning("left %s, which a dead build left: %s", entry.path, error)
            continue
        removed.append(Path(entry.path))
    if removed:
        log.info("removed %d file(s) dead builds left %s", len(removed), where)
    return removed


def deleted_wal_holders(path: Path) -> list[tuple[int, str]]:
    """Processes holding this database's WAL open although the file was unlinked.

    Such a process lost its locks (something closed a descriptor on the database), another
    process checkpointed and deleted the WAL, and every commit it makes since lands in a file
    nobody else can see and that vanishes when it exits. Linux only (reads ``/proc``); other
    systems and processes this user may not inspect are skipped. Returns (pid, command line).
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    wanted = f"{Path(path).resolve()}-wal (deleted)"
    found: list[tuple[int, str]] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            targets = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:  # gone meanwhile, or not ours to inspect
            continue
        if wanted in targets:
            found.append((int(entry.name), _command_line(entry)))
    return found


#: Where SQLite takes a WAL database's write lock: byte 120 of the ``-shm`` file (the first of
#: its lock bytes); a rollback-journal database's locks are at 0x40000000 of the file itself.
WAL_WRITE_LOCK_BYTE = 120
PENDING_BYTE = 0x40000000


def write_lock_holders(path: Path) -> list[tuple[int, str]]:
    """Other processes holding this database's write lock, as the kernel lists them
    (``/proc/locks``), with their command lines: whom a waiting writer waits for. Linux only;
    elsewhere, or when nothing can be read, empty. Never opens the database or its sidecars
    (closing a descriptor would drop this process's own locks on them)."""
    targets: dict[tuple[int, int, int], tuple[int, int]] = {}
    for name, low in ((f"{path}-shm", WAL_WRITE_LOCK_BYTE), (str(path), PENDING_BYTE)):
        try:
            info = os.stat(name)
        except OSError:
            continue
        key = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
        high = low if low == WAL_WRITE_LOCK_BYTE else PENDING_BYTE + 511
        targets[key] = (low, high)
    try:
        table = Path("/proc/locks").read_text(encoding="ascii", errors="replace")
    except OSError:
        return []
    me = os.getpid()
    holders: dict[int, str] = {}
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 8 or fields[1] != "POSIX" or fields[3] != "WRITE":
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            start = int(fields[6])
            end = -1 if fields[7] == "EOF" else int(fields[7])
        except ValueError:
            continue
        span = targets.get(key)
        if span is None or pid == me or pid in holders:
            continue
        if start <= span[1] and (end == -1 or end >= span[0]):
            holders[pid] = _command_line(Path("/proc") / str(pid))
    return sorted(holders.items())


def _command_line(entry: Path) -> str:
    try:
        raw = (entry / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\x00", b" ").decode("utf-8", "replace").strip() or "?"


#: What a path can be besides a regular file or a symbolic link, in words.
_SPECIAL_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def special_kind(path: Path) -> str | None:
    """What ``path`` is, in words, when it exists as something other than a regular file or
    a symbolic link (a device such as ``/dev/null``, a FIFO, a folder, a socket); else None.

    An output written beside its name and renamed into place must never be renamed over such
    a thing: as root, ``export -o /dev/null`` replaced the machine's ``/dev/null`` with a
    regular file, and every program that wrote to it after failed. Only ``lstat``."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None  # nothing there (or nothing to look at): creating it says what is wrong
    return kind_of(mode)


def kind_of(mode: int) -> str | None:
    """:func:`special_kind` of a ``stat`` result's ``st_mode``."""
    return next((kind for test, kind in _SPECIAL_KINDS if test(mode)), None)


def refuse_aliases(path: Path, given: Path | None = None) -> None:
    """Refuse a database file that has another name (a hard link): SQLite keeps the WAL and
    its index beside the name a process opened (``NAME-wal``), so two processes writing
    through two names keep two WALs and corrupt the file. A symlink is no alias (SQLite opens
    the file it points to, and its WAL beside it), nor is a folder reached by a bind mount.

    The other name is looked for in the file's folder and in the folder of ``given`` (the
    path as the caller gave it), at most :data:`MAX_ALIAS_SCAN` entries each. The package's
    own temporary names (a new database linked into place a moment before its temporary
    name is removed) do not count. Only ``stat``: no descriptor on the file.
    """
    try:
        st = os.stat(path)
    except OSError:
        return  # no file yet (or none to look at): opening reports what is wrong
    if st.st_nlink <= 1 or not stat.S_ISREG(st.st_mode):
        return
    folders = [path.parent]
    if given is not None and given.parent.resolve() != path.parent.resolve():
        folders.append(given.parent)
    others = [other for folder in folders for other in _same_file(folder, path, st)]
    # The package's own temporary names, and the writer queue's lock file: a link planted
    # there is refused as a lock file and never opened as a database (see writequeue).
    temporary = re.compile(
        _partial_names(path.name, LINKED_KINDS)
        + rf"|\.{re.escape(path.name)}\.partial-[0-9a-f]{{12}}"
        + rf"|{re.escape(path.name)}-writer\.lock"
    )
    if (
        others
        and len(others) == st.st_nlink - 1
        and all(temporary.fullmatch(o.name) for o in others)
    ):
        return
    named = [str(other) for other in others if not temporary.fullmatch(other.name)]
    also = (
        f"also named {', '.join(named)}"
        if named
        else f"its other name is not in {' or '.join(str(f) for f in folders)}"
    )
    raise DatabaseAliasError(
        f"{path} has {st.st_nlink} names (hard links), {also}: SQLite keeps a WAL beside each "
        "name, so writers through two names corrupt the database; keep one name (remove the "
        "other links; copy with 'hermes-store backup' instead)"
    )


def _same_file(folder: Path, path: Path, st: os.stat_result) -> list[Path]:
    """Other entries of ``folder`` that are the file ``st`` describes (bounded scan)."""
    found: list[Path] = []
    try:
        with os.scandir(folder) as entries:
            for seen, entry in enumerate(entries):
                if seen >= MAX_ALIAS_SCAN:
                    break
                if entry.inode() != st.st_ino:
                    continue
                try:
                    other = entry.stat(follow_symlinks=False)
                    itself = Path(entry.path).resolve() == path.resolve()
                except OSError:  # removed meanwhile
                    continue
                if other.st_dev == st.st_dev and stat.S_ISREG(other.st_mode) and not itself:
                    found.append(Path(entry.path))
    except OSError as error:  # a folder we may not list: the name stays unknown
        log.debug("cannot look for other names of %s in %s: %s", path, folder, error)
    return found
