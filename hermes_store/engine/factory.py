"""The one engine factory: where a target (path, URL or Engine) becomes a configured Engine.

SQLite gets the hooks that make several processes safe on one file: SQLAlchemy owns the
transaction (the driver's implicit BEGIN is switched off) and the ``begin`` hook picks
``BEGIN IMMEDIATE`` for write units and a deferred ``BEGIN`` for read units, per transaction,
from the ``hermes_write`` execution option that the Unit of Work sets.
No engine is made at import time.
"""

from __future__ import annotations

import logging
import os
import re
import select
import sqlite3
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, urlencode, urlsplit, urlunsplit

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy import util as sa_util
from sqlalchemy.engine import URL, Connection, Engine, ExceptionContext, make_url
from sqlalchemy.pool import ConnectionPoolEntry, SingletonThreadPool

from hermes_store.echo import echoed
from hermes_store.engine import files
from hermes_store.engine import placement as placement_mod
from hermes_store.engine.placement import Placement
from hermes_store.errors import (
    EngineSettingsError,
    InvalidInputError,
    ReadOnlyDatabaseError,
    UnsupportedEngineError,
)

log = logging.getLogger(__name__)

#: Execution option read by the ``begin`` hook: True takes the write lock up front.
WRITE_OPTION = "hermes_write"
#: Execution option read by the ``begin`` hook: a busy timeout (ms) for this BEGIN only.
BUSY_OPTION = "hermes_busy_ms"
#: Short for writers: past it, the Unit of Work's jittered retry takes over.
WRITER_BUSY_TIMEOUT_S = 1.0
#: Longer for readers: a deferred BEGIN only waits when a checkpoint or recovery runs.
READER_BUSY_TIMEOUT_S = 5.0
#: Pool-record key holding ``(writer_ms, reader_ms)``, for code that begins on a raw connection.
BUSY_TIMEOUTS_KEY = "hermes_busy_timeouts"
#: Pool-record key holding the :class:`SqliteSettings` a connection was set up with.
SETTINGS_KEY = "hermes_settings"
#: ``PRAGMA synchronous`` modes offered: FULL (the default) and NORMAL (an explicit opt-in).
SYNCHRONOUS_MODES = frozenset({"full", "normal"})

#: After a burst, a checkpointed WAL is cut back to this size (the next writer truncates it).
DEFAULT_JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024
#: Environment variable overriding :data:`DEFAULT_JOURNAL_SIZE_LIMIT` (bytes; -1: no limit).
JOURNAL_SIZE_LIMIT_ENV = "HERMES_STORE_JOURNAL_SIZE_LIMIT"

#: A pooled PostgreSQL connection idle longer than this is pinged before it is handed out;
#: younger ones only get the cheap checks (state, socket), which cost no round trip.
IDLE_PING_AFTER_S = 30.0
#: Seconds a connection attempt may take per host, unless the URL says (``connect_timeout``).
CONNECT_TIMEOUT_S = 10
#: TCP settings of every PostgreSQL connection the store opens, unless the URL or the
#: connect arguments say: a host that vanishes without a word (powered off, cut off by the
#: network: no RST) would otherwise leave an idle pooled connection looking alive and a call
#: waiting on it for the kernel's retransmission limit (about 15 minutes). Keepalive probes
#: after 10 s idle, every 5 s, 3 unanswered: such a connection fails within about 25 s; sent
#: data unacknowledged for 20 s (``tcp_user_timeout``, ms) fails it too, then the call's
#: patience waits for a server that answers. A server that is only slow still acknowledges
#: both. libpq ignores them on Unix-domain sockets.
TCP_KEEPALIVE_DEFAULTS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 20_000,
}
#: psycopg's default: a statement is prepared server-side from its 5th execution on.
PSYCOPG_PREPARE_THRESHOLD = 5
#: The startup option asking the server for a plan per execution (see ``psycopg_options``).
CUSTOM_PLANS_OPTION = "-c plan_cache_mode=force_custom_plan"
#: The client encoding of every store connection, whatever the database, the role or
#: ``PGCLIENTENCODING`` say: in SJIS, BIG5, GBK, ... a ``¥`` or a backslash does not survive
#: the trip, and only UTF-8 carries every string as given.
CLIENT_ENCODING = "UTF8"
#: The autocommit pool of one-statement calls: small and without overflow. Small: each call
#: holds a connection for one round trip, the server runs a few statements per core at once,
#: and on a machine it shares every extra busy backend preempts the caller (an asyncio loop
#: lagged 7-9 ms at p99 with 5 connections, 14-20 ms with 10). No overflow: an overflow
#: connection is closed when it comes back to a full pool, and a burst (200 asyncio tasks,
#: whose waiters wake only when the loop gets to them) returned connections faster than
#: waiters took them: 135 new server connections per 2,000 appends, halving throughput.
AUTOCOMMIT_POOL_SIZE = 5
AUTOCOMMIT_MAX_OVERFLOW = 0
#: Pool-record key: when the connection was last given back (``time.monotonic()``).
IDLE_SINCE_KEY = "hermes_idle_since"

#: SQLite's Unix VFS handles names of up to 512 bytes, its sidecars' suffixes included.
MAX_PATH_BYTES = 512 - len("-journal")

Target = str | os.PathLike[str] | URL | Engine


def default_db_path() -> Path:
    """``$HERMES_HOME/state.db``, else ``~/.hermes/state.db`` (resolved now, not at import)."""
    home = os.environ.get("HERMES_HOME")
    if home:
        base = expand_home(home, "the HERMES_HOME folder")
    else:
        base = expand_home("~/.hermes", "the default folder (set HERMES_HOME instead)")
    return base / "state.db"


def expand_home(given: str | os.PathLike[str], what: str) -> Path:
    """``given`` with a leading ``~`` or ``~user`` expanded. Python raises a bare
    ``RuntimeError`` when it cannot tell that home folder (no such user, no ``$HOME``): a path
    given wrongly, so it is refused as one."""
    path = Path(os.fspath(given))
    try:
        return path.expanduser()
    except RuntimeError:
        first = path.parts[0] if path.parts else str(path)
        raise InvalidInputError(
            f"{what} {echoed(str(path))} starts with {echoed(first)}, whose home folder "
            "cannot be found (no such user, or no $HOME): give the folder itself"
        ) from None


def url_from_environment() -> URL:
    """``HERMES_STORE_URL`` when set, else the default SQLite file (for tools, not SessionDB)."""
    env = os.environ.get("HERMES_STORE_URL")
    if env and not env.strip():  # a file named by blanks is a mistake, not a choice
        raise InvalidInputError(
            "HERMES_STORE_URL holds only blanks: give a SQLite path or a database URL (unset "
            "it for the default database)"
        )
    return to_url(env) if env else to_url(default_db_path())


#: The query arguments SQLAlchemy's sqlite3 dialect takes from a URL that is not a SQLite URI
#: (``uri=true``); it ignores any other with a warning.
_SQLITE_DIALECT_ARGUMENTS = frozenset(
    {"timeout", "isolation_level", "detect_types", "check_same_thread", "cached_statements", "uri"}
)


#: SQLite URI parameters that SQLite checks as it opens the file, with the values it takes: a
#: value it does not take would fail only at the first connection (a store's first write).
_SQLITE_URI_VALUES = {"mode": ("ro", "rw", "rwc", "memory"), "cache": ("shared", "private")}
#: The VFS that locks nothing: the store's safety across processes rests on SQLite's locks.
_LOCKLESS_VFS = "unix-none"
#: The VFSes a URI may name: the default one, whose POSIX locks every other process (the
#: original store included) takes too, and the in-memory one, which has no file to share.
_SHARED_LOCK_VFS = frozenset({"unix", "memdb"})


def is_sqlite_uri(url: URL) -> bool:
    """True when SQLAlchemy hands a SQLite URL's name to SQLite as a URI (its ``uri`` argument
    read as SQLAlchemy reads it); otherwise even a ``file:`` name is a plain file's."""
    given = url.query.get("uri")
    if given is None:
        return False
    try:
        return bool(sa_util.asbool(given if isinstance(given, str) else given[-1]))
    except ValueError:
        raise InvalidInputError(
            f"the SQLite URL's uri={echoed(given)} is not a boolean (uri=true)"
        ) from None


def sqlite_uri_parameters(url: URL) -> list[tuple[str, str]]:
    """The SQLite URI parameters of a SQLite URL: those in its query (not the driver's, which
    SQLAlchemy keeps) and those written into the ``file:`` name itself (``%3F``)."""
    found = files.uri_parameters(url.database or "")
    for key, values in url.query.items():
        if key not in _SQLITE_DIALECT_ARGUMENTS:
            found.extend(
                (key, value) for value in ((values,) if isinstance(values, str) else values)
            )
    return found


def _sqlite_true(value: str) -> bool:
    """A URI boolean as SQLite reads it (``sqlite3_uri_boolean``)."""
    text = value.strip().lower()
    if text.lstrip("-").isdigit():
        return int(text) != 0
    return text in ("yes", "true", "on")


def sqlite_opens_read_only(url: URL) -> bool:
    """True for a SQLite URI that SQLite opens read-only: ``mode=ro``, or ``immutable`` true as
    SQLite reads a URI boolean (its first value: ``1``, ``yes``, ``on``...)."""
    if not is_sqlite_uri(url):
        return False
    given = sqlite_uri_parameters(url)
    immutable = next((value for key, value in given if key == "immutable"), "0")
    return ("mode", "ro") in given or _sqlite_true(immutable)


def _check_vfs(name: str) -> None:
    """SQLite looks a URI's VFS up only as it opens the file (a store's first write, once the
    store had opened): looked up here on an in-memory database, which opens no file."""
    try:
        sqlite3.connect(f"file:vfs-probe?mode=memory&vfs={quote(name, safe='')}", uri=True).close()
    except sqlite3.Error as error:
        raise InvalidInputError(f"the SQLite URI's vfs={echoed(name)}: {error}") from None


def _check_sqlite_database(url: URL) -> None:
    """Refuse, before anything is opened, a SQLite URL whose file the store would not find as
    SQLite opens it (a decoded NUL, see :func:`files.uri_file_name`), whose URI parameters
    SQLite would refuse only when it connects, or that switches SQLite's locking off or to
    another kind of lock (the store's safety across processes rests on it)."""
    if "\x00" in (url.database or ""):  # make_url decodes %00
        raise InvalidInputError(
            "the database path holds a NUL character (%00): no file has such a name"
        )
    if not is_sqlite_uri(url):  # not a SQLite URI: see _refuse_ignored_sqlite_arguments
        if (url.database or "").startswith("file:"):
            raise InvalidInputError(
                f"the SQLite URL names {echoed(url.database)}, which SQLite reads as a URI only "
                "with uri=true (sqlite:///file:/path/to/state.db?uri=true); without it, it is "
                "a file of that name: give a plain path for one"
            )
        return
    sqlite_file(url)  # decodes a file: URI's name, refusing what would name another file
    given = sqlite_uri_parameters(url)
    for key, value in given:
        if (key == "nolock" and _sqlite_true(value)) or (key == "vfs" and value == _LOCKLESS_VFS):
            raise InvalidInputError(
                f"the SQLite URI's {key}={value} is refused: it switches SQLite's locks off, "
                "and processes share a store's file safely only through them"
            )
        if key == "vfs":
            _check_vfs(value)
            if value not in _SHARED_LOCK_VFS:
                raise InvalidInputError(
                    f"the SQLite URI's vfs={value} is refused: it locks the file otherwise than "
                    "the default VFS (unix), whose locks the other processes writing the file "
                    "(the original store among them) take, so neither would see the other's "
                    "writes in progress; leave vfs out"
                )
        choices = _SQLITE_URI_VALUES.get(key)
        if choices is not None and value not in choices:
            raise InvalidInputError(
                f"the SQLite URI's {key}={echoed(value)} is not one SQLite takes "
                f"({', '.join(choices)})"
            )
    for key in ("vfs", *_SQLITE_URI_VALUES):
        if sum(name == key for name, _ in given) > 1:
            raise InvalidInputError(f"the SQLite URI gives {key}= more than once")


def _refuse_ignored_sqlite_arguments(url: URL) -> None:
    """A SQLite URL's argument that would be ignored is refused: ``sqlite:////x.db?mode=ro``
    opened the file for writing (SQLAlchemy drops ``mode`` unless the URL is a SQLite URI),
    and wrote into a file its caller asked to read only."""
    if is_sqlite_uri(url):
        return
    ignored = sorted(set(url.query) - _SQLITE_DIALECT_ARGUMENTS)
    if ignored:
        raise InvalidInputError(
            f"the SQLite URL's {', '.join(ignored)} would be ignored: SQLite URI arguments "
            "need the URI form, sqlite:///file:/path/to/state.db?mode=ro&uri=true"
        )


def to_url(target: str | os.PathLike[str] | URL) -> URL:
    """A SQLAlchemy URL from a URL, a URL string or a file path (made absolute)."""
    if isinstance(target, URL):
        url = target
    elif isinstance(target, str) and "://" in target:
        files.refuse_undecodable(target, "the database URL", show=False)  # it may hold a password
        try:
            url = make_url(_hosts_in_query(target))
        except ValueError as error:  # int() of a non-numeric port
            raise InvalidInputError(
                "malformed database URL: its port must be a number"
                if "int()" in str(error)
                else f"malformed database URL: {error}"
            ) from None
        except sa_exc.ArgumentError as error:
            raise InvalidInputError(f"malformed database URL: {error}") from None
    else:
        if isinstance(target, str) and _LIBPQ_KEYWORDS.search(target):
            raise InvalidInputError(
                "this looks like a libpq keyword string (host=... dbname=...), not a file path: "
                "give a URL instead, postgresql://USER@HOST:PORT/DBNAME (several hosts: "
                "postgresql://USER@/DBNAME?host=a:5432&host=b:5432&target_session_attrs=read-write)"
            )
        if "\x00" in os.fspath(target):
            raise InvalidInputError("the database path holds a NUL character")
        path = expand_home(target, "the database path").resolve()
        files.refuse_undecodable(str(path), "the database path")  # a symlink may lead there too
        if len(os.fsencode(path)) > MAX_PATH_BYTES:
            raise InvalidInputError(
                f"{path} is {len(os.fsencode(path))} bytes long; SQLite opens database paths "
                f"of at most {MAX_PATH_BYTES} bytes (it adds '-journal' within 512): "
                "choose a shorter path or a symlink to the folder"
            )
        return URL.create("sqlite", database=str(path))
    if url.get_backend_name() == "sqlite" and url.database:
        files.refuse_undecodable(url.database, "the database path")
        _refuse_ignored_sqlite_arguments(url)
        _check_sqlite_database(url)
    if url.get_backend_name() != "sqlite":
        _check_ports(url)
        _check_server_target(url)
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    given = url.query.get("password")
    if url.password is None and isinstance(given, str) and url.get_backend_name() != "sqlite":
        # The driver gets it either way; in its place every rendering of the URL masks it.
        url = url.set(password=given).difference_update_query(["password"])
    return url


#: The TCP ports a server can listen on.
PORT_RANGE = range(1, 65536)


def _check_ports(url: URL) -> None:
    """Refuse a port no server can listen on (SQLAlchemy keeps any integer): a settings
    mistake, which would otherwise be retried as an unreachable server until the open's
    patience ran out. The URL's port, ``?port=`` and the ports of ``?host=HOST:PORT``."""
    given: list[str] = [] if url.port is None else [str(url.port)]
    for key in ("port", "host"):
        values = url.query.get(key, ())
        for value in (values,) if isinstance(values, str) else values:
            for item in value.split(","):
                # A host's port follows its last colon (a bare IPv6 address has only hex there).
                given.append(item if key == "port" else item.rpartition(":")[2])
    for port in given:
        if port.strip().isdigit() and int(port) not in PORT_RANGE:
            raise InvalidInputError(
                f"malformed database URL: port {int(port)} is out of range "
                f"({PORT_RANGE.start}-{PORT_RANGE.stop - 1})"
            )


def _check_server_target(url: URL) -> None:
    """Refuse a server URL that would reach another database than its writer meant: one
    naming no database (libpq then picks the one named after the role, or ``postgres``, the
    server's maintenance database, where ``db upgrade`` would create the store's tables), and
    one whose host holds an ``@`` (a password's unencoded ``@``: the rest of the password
    would be taken for the host, and shown in every error naming it)."""
    if url.host is not None and "@" in url.host:
        raise InvalidInputError(
            "malformed database URL: an '@' in the password must be written %40 "
            "(postgresql://USER:PASS%40WORD@HOST/DBNAME)"
        )
    named = url.database or {"dbname", "service"} & set(url.query)
    if not named and not (os.environ.get("PGDATABASE") or os.environ.get("PGSERVICE")):
        raise InvalidInputError(
            f"the database URL {display_url(url)} names no database: add it after the host "
            "(postgresql://USER@HOST/DBNAME), or the server would pick one for the role"
        )


def is_secret_parameter(key: str) -> bool:
    """True for a URL query parameter that carries a credential: ``password``,
    ``sslpassword``, any name with "pass", "secret" or "token" in it (``passfile``, a path,
    is shown)."""
    name = key.lower()
    return name != "passfile" and any(part in name for part in ("pass", "secret", "token"))


def display_url(url: URL | str) -> str:
    """``url`` as shown to people (messages, logs, the CLI): its password and every
    credential in its query string masked as ``***``, the rest as given."""
    if isinstance(url, str):
        try:
            url = make_url(url)
        except (ValueError, sa_exc.ArgumentError):
            return "<an unparseable URL>"
    shown = url.set(query={}).render_as_string(hide_password=True)
    parts = [
        f"{quote_plus(key)}={'***' if is_secret_parameter(key) else quote_plus(value)}"
        for key, values in url.query.items()
        for value in ((values,) if isinstance(values, str) else values)
    ]
    return f"{shown}?{'&'.join(parts)}" if parts else shown


#: A libpq keyword/value connection string ("host=a port=5432 dbname=x"): never a file name.
_LIBPQ_KEYWORDS = re.compile(
    r"(?:^|\s)(?:host|hostaddr|port|dbname|user|password|sslmode|target_session_attrs)\s*="
)


def _hosts_in_query(text: str) -> str:
    """libpq's multi-host forms in SQLAlchemy's: ``postgresql://u@h1:5432,h2:5433/db`` and
    ``?host=h1,h2&port=5432,5433`` become ``?host=h1:5432&host=h2:5433`` (psycopg is given
    every host; ``target_session_attrs`` then picks the primary)."""
    parts = urlsplit(text)
    if not parts.scheme.startswith(("postgresql", "postgres")):
        return text
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    query = parse_qsl(parts.query, keep_blank_values=True)
    hosts = [h for h in hostlist.split(",") if h] if "," in hostlist else []
    given = [v for k, v in query if k == "host"]
    ports = [v for k, v in query if k == "port"]
    if not hosts and not any("," in v for v in given + ports):
        return text
    if not hosts:
        names = [h for value in given for h in value.split(",") if h]
        numbers = [p for value in ports for p in value.split(",") if p]
        if len(numbers) not in (0, 1, len(names)):
            raise InvalidInputError(f"{len(names)} hosts but {len(numbers)} ports")
        if not numbers:
            hosts = names
        else:
            numbers = numbers * len(names) if len(numbers) == 1 else numbers
            hosts = [f"{name}:{port}" for name, port in zip(names, numbers, strict=True)]
    rest = [(k, v) for k, v in query if k not in ("host", "port")]
    netloc = f"{userinfo}{at}" if at else ""
    query_text = urlencode([("host", h) for h in hosts] + rest, safe=":/")
    return urlunsplit((parts.scheme, netloc, parts.path, query_text, parts.fragment))


def sqlite_file(url: URL) -> Path | None:
    """The file behind a SQLite URL, or None for other backends and in-memory databases (as
    ``:memory:``, a URI's ``mode=memory`` or ``vfs=memdb`` and its empty name, SQLite's private
    temporary database: each connection gets a database of its own, so none holds a store)."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:"):
        return None
    if database.startswith("file:") and is_sqlite_uri(url):
        if database.startswith("file::memory:"):
            return None
        name = files.uri_file_name(database)
        given = sqlite_uri_parameters(url)
        if name in ("", ":memory:") or ("mode", "memory") in given or ("vfs", "memdb") in given:
            return None
        return Path(name)
    return Path(database)


def make_private_dirs(folder: Path) -> None:
    """Create ``folder`` and any missing parents owner-only (0700) whatever the umask: they
    will hold conversations. Folders that already exist (or that another process creates
    meanwhile) are left exactly as they are."""
    missing: list[Path] = []
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    for candidate in reversed(missing):
        try:
            os.mkdir(candidate, 0o700)
        except FileExistsError:
            if not candidate.is_dir():
                raise
            continue
        os.chmod(candidate, 0o700)  # mkdir's mode is cut by the umask


def create_private_file(path: Path) -> bool:
    """Create ``path`` owner-only (0600) unless it exists; SQLite gives -wal/-shm the same mode."""
    make_private_dirs(path.parent)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def unreadable_in_wal(path: Path) -> bool:
    """True for a database in a folder this process cannot write and with no ``-wal`` file:
    SQLite cannot create the ``-shm`` that a WAL read needs, so not even a read would work.
    Nothing committed lives outside the main file then, so it can be opened ``immutable``
    (read-only: reads work, writes fail as read-only). A privileged writer that later writes
    into that folder is not seen by such a reader until it reopens.

    Raises :class:`ReadOnlyDatabaseError` for a file in such a folder with a hot rollback
    journal beside it (see :func:`files.hot_journal`): the file then holds part of a
    transaction that never committed, which only rolling the journal back (a write) undoes;
    ``immutable`` would read it as if committed, torn pages included."""
    if not path.exists() or os.access(path.parent, os.W_OK):
        return False
    refuse_hot_journal(path)
    return not Path(f"{os.path.realpath(path)}-wal").exists()


def refuse_hot_journal(path: Path) -> None:
    """Refuse a database in a read-only folder whose hot journal cannot be rolled back there:
    every read of it would see a transaction that never committed."""
    journal = files.hot_journal(path)
    if journal is not None:
        raise ReadOnlyDatabaseError(
            f"{path}: a writer stopped mid-transaction and left a hot rollback journal "
            f"({journal.name}) that SQLite must roll back before the file can be read "
            "consistently, but its folder is read-only; open the database once where its "
            "folder can be written (opening rolls the journal back), then try again"
        )


def journal_size_limit() -> int:
    """The WAL size limit in bytes: ``$HERMES_STORE_JOURNAL_SIZE_LIMIT``, else 64 MiB."""
    raw = os.environ.get(JOURNAL_SIZE_LIMIT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_JOURNAL_SIZE_LIMIT
    try:
        value = int(raw)
    except ValueError:
        raise InvalidInputError(
            f"{JOURNAL_SIZE_LIMIT_ENV}={raw!r} is not a whole number of bytes"
        ) from None
    if value < -1:
        raise InvalidInputError(f"{JOURNAL_SIZE_LIMIT_ENV} must be -1 (no limit) or >= 0")
    return value


def create_engine(
    target: Target,
    *,
    writer_busy_timeout: float = WRITER_BUSY_TIMEOUT_S,
    reader_busy_timeout: float = READER_BUSY_TIMEOUT_S,
    foreign_keys: bool = True,
    synchronous: str = "full",
    wal_size_limit: int | None = None,
    placement: Placement | None = None,
    private_build: bool = False,
    **engine_kwargs: Any,
) -> Engine:
    """An Engine for ``target`` with this package's hooks (an Engine given is hooked in place:
    see :func:`install_sqlite_hooks`). ``placement`` (default: the current one, see
    :mod:`hermes_store.engine.placement`) puts the tables in a schema and names the version table.
    ``private_build``: see :func:`install_sqlite_hooks`.

    Connecting does not create a missing file owner-only: open databases through
    :class:`~hermes_store.SessionDB` or :mod:`hermes_store.schema.migrate`, which do.
    """
    where = placement_mod.current() if placement is None else placement
    if isinstance(target, Engine):
        where.check_dialect(target.dialect.name)
        if target.dialect.name == "sqlite":
            refuse_sqlite_aliases(target.url, None)
            install_sqlite_hooks(
                target,
                writer_busy_timeout=writer_busy_timeout,
                reader_busy_timeout=reader_busy_timeout,
                foreign_keys=foreign_keys,
                synchronous=synchronous,
                wal_size_limit=wal_size_limit,
                private_build=private_build,
            )
        elif _is_psycopg(target):
            install_utf8(target)
            install_pooler_guard(target)
        return placement_mod.placed(target, where)
    url = to_url(target)
    where.check_dialect(url.get_backend_name())
    if not where.is_default:
        engine_kwargs["execution_options"] = {
            **engine_kwargs.get("execution_options", {}),
            **where.execution_options(),
        }
    if url.get_backend_name() == "sqlite":
        path = sqlite_file(url)
        refuse_sqlite_aliases(url, target)
        if path is not None and unreadable_in_wal(path):
            log.warning("%s: its folder is read-only; opening it read-only (immutable)", path)
            url = files.sqlite_uri(path, mode="ro", immutable="1")
        if path is not None and "poolclass" not in engine_kwargs:
            # One connection per busy thread; SQLite connections are cheap to keep.
            engine_kwargs.setdefault("pool_size", 8)
            engine_kwargs.setdefault("max_overflow", 32)
        elif path is None and "creator" not in engine_kwargs:
            # No file (:memory:, mode=memory, an empty name): one connection per thread, as
            # SQLAlchemy picks for :memory: (for mode=memory it warns that it will not).
            engine_kwargs.setdefault("poolclass", SingletonThreadPool)
        engine = sa.create_engine(url, **engine_kwargs)
        install_sqlite_hooks(
            engine,
            writer_busy_timeout=writer_busy_timeout,
            reader_busy_timeout=reader_busy_timeout,
            foreign_keys=foreign_keys,
            synchronous=synchronous,
            wal_size_limit=wal_size_limit,
            private_build=private_build,
        )
        return engine
    url, engine_kwargs = psycopg_options(url, engine_kwargs)
    # A fleet of gateways shares the server: keep a modest pool. No ping before every use
    # (a round trip per call): the liveness check pings only connections idle for a while.
    if "poolclass" not in engine_kwargs:
        engine_kwargs.setdefault("pool_size", 5)
        engine_kwargs.setdefault("max_overflow", 10)
    engine = sa.create_engine(url, **engine_kwargs)
    if _is_psycopg(engine):
        install_safe_ping(engine)
        install_liveness_check(engine)
        install_pooler_guard(engine)
        install_read_only_names(engine)
        if "creator" not in engine_kwargs:
            register_origin(engine, url, engine_kwargs.get("connect_args", {}))
    placement_mod.install(engine, where)
    return engine


def refuse_sqlite_aliases(url: URL, given: Target | None) -> None:
    """A SQLite file with a second name (a hard link) is refused: see ``files.refuse_aliases``."""
    path = sqlite_file(url)
    if path is None:
        return
    plain = None
    if isinstance(given, str | os.PathLike) and "://" not in str(given):
        plain = expand_home(given, "the database path")
    files.refuse_aliases(path, plain)


def _is_psycopg(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"


#: Where the engines this module made connect: their URL and connect arguments.
_ORIGINS: weakref.WeakKeyDictionary[Engine, tuple[URL, dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)
#: Each PostgreSQL engine's autocommit twin (see :func:`autocommit_engine`).
_TWINS: weakref.WeakKeyDictionary[Engine, Engine] = weakref.WeakKeyDictionary()
_TWIN_LOCK = threading.Lock()


#: The module-level hooks each engine listens with (see :func:`listen_once`).
_LISTENING: weakref.WeakKeyDictionary[Engine, set[tuple[str, Callable[..., Any]]]] = (
    weakref.WeakKeyDictionary()
)
_LISTEN_LOCK = threading.Lock()


def listen_once(engine: Engine, identifier: str, hook: Callable[..., Any]) -> None:
    """``event.listen(engine, identifier, hook)`` unless ``engine`` already listens with it.

    Not ``event.contains``: SQLAlchemy's registry is keyed by the engine's ``id()``, and it
    can keep an emptied entry after the engine is collected, which then answers True for a
    new engine at the same address. A caller's engine went unhooked that way
    (its writes in the client encoding its environment named). Tracked here by the engine
    itself, weakly."""
    with _LISTEN_LOCK:
        hooks = _LISTENING.setdefault(engine, set())
        if (identifier, hook) not in hooks:
            event.listen(engine, identifier, hook)
            hooks.add((identifier, hook))


def register_origin(engine: Engine, url: URL, connect_args: dict[str, Any]) -> None:
    """Record what ``engine`` was made from (see :func:`connection_key`)."""
    _ORIGINS[engine] = (url, dict(connect_args))


def connection_key(engine: Engine) -> str | None:
    """Where ``engine`` connects, as a key: two engines with equal keys reach one database.
    The URL alone is not enough (connect_args may name another host or database). None for
    an engine this module did not make from a URL: its connect function is opaque, so it
    shares its key with no other engine (key it by the engine itself, weakly: an ``id()``
    outlives the engine and names the next one made at its address)."""
    origin = _ORIGINS.get(engine)
    if origin is None:
        return None
    url, connect_args = origin
    return f"{url.render_as_string(hide_password=False)}#{sorted(connect_args.items())!r}"


def same_connection(target: Target) -> dict[str, Any]:
    """``create_engine`` arguments that make a new engine connect exactly where ``target``
    does when it is a server Engine: its own connect function (its connect_args, its creator
    and its dialect's do_connect hooks are in there; its URL alone may name another server)."""
    if isinstance(target, Engine) and target.dialect.name != "sqlite":
        return {"creator": target.pool._creator}
    return {}


def autocommit_engine(engine: Engine) -> Engine:
    """The autocommit twin of a PostgreSQL ``engine``: its own small pool whose connections are
    opened in autocommit (never toggled: psycopg refuses that on a connection not idle), with
    the same liveness check and execution options, connecting exactly where ``engine`` does.
    One statement on it is one round trip: no BEGIN, no COMMIT. Made once per engine;
    disposed with it."""
    with _TWIN_LOCK:
        twin = _TWINS.get(engine)
        if twin is None:
            twin = _TWINS[engine] = _make_twin(engine)
    return twin


def _make_twin(engine: Engine) -> Engine:
    base = sa.create_engine(
        engine.url,
        # An asyncio engine's twin is one too: its statements then run in the caller's greenlet.
        _is_async=engine.dialect.is_async,
        isolation_level="AUTOCOMMIT",
        pool_size=AUTOCOMMIT_POOL_SIZE,
        max_overflow=AUTOCOMMIT_MAX_OVERFLOW,
        # The given engine's own connect function: its connect_args (UTF-8 among them) and
        # do_connect hooks come along.
        **same_connection(engine),
    )
    if _is_psycopg(base):
        install_safe_ping(base)
        install_liveness_check(base)
        install_pooler_guard(base)
        install_read_only_names(base)
    options = {
        key: value
        for key, value in engine.get_execution_options().items()
        if key not in ("isolation_level", WRITE_OPTION, "postgresql_readonly")
    }
    twin = base.execution_options(**options) if options else base
    pid = os.getpid()

    def dispose_twin(_engine: Engine) -> None:
        # A forked child must not close its parent's connections (the server would drop them).
        base.dispose(close=os.getpid() == pid)

    event.listen(engine, "engine_disposed", dispose_twin)
    return twin


def install_liveness_check(engine: Engine, *, idle_ping_after: float = IDLE_PING_AFTER_S) -> None:
    """Check each PostgreSQL connection as the pool hands it out, instead of a ping per use.

    Free checks every time: the driver's own state (closed, broken, not idle) and the socket
    (a server that terminated the backend or shut down has already written its goodbye and
    closed it, so an idle connection's socket is readable). A ping (one round trip) only for
    a connection idle longer than ``idle_ping_after`` seconds, where a silent network drop may
    hide. A failed check discards the connection and the pool opens another: a restarted
    server costs the caller no error.
    """
    pq = engine.dialect.loaded_dbapi.pq
    idle = pq.TransactionStatus.IDLE
    ok = pq.ConnStatus.OK
    empty_query = pq.ExecStatus.EMPTY_QUERY
    dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error

    def stale(adapted: Any, record: ConnectionPoolEntry) -> str | None:
        # The psycopg connection itself (an asyncio engine's pool hands out an adapter).
        dbapi_connection = getattr(adapted, "driver_connection", adapted)
        if dbapi_connection.closed or dbapi_connection.pgconn.status != ok:
            return "closed"
        status = dbapi_connection.info.transaction_status
        if status != idle:
            return f"not idle ({status.name})"
        try:
            if _socket_readable(dbapi_connection.pgconn.socket):
                return "closed by the server"
            since = record.info.get(IDLE_SINCE_KEY)
            if since is not None and time.monotonic() - since > idle_ping_after:
                # An empty query: one round trip, no transaction, no state changed.
                result = dbapi_connection.pgconn.exec_(b"")
                if result.status != empty_query or dbapi_connection.pgconn.status != ok:
                    return "failed its ping"
        except dbapi_error as error:
            return f"failed its check ({error})"
        return None

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: ConnectionPoolEntry, _proxy: Any) -> None:
        reason = stale(dbapi_connection, record)
        if reason is not None:
            log.info("pooled connection %s; replacing it", reason)
            # This connection only: the pool invalidates it and hands out a fresh one.
            raise sa_exc.DisconnectionError(f"pooled connection {reason}")

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info[IDLE_SINCE_KEY] = time.monotonic()


def _socket_readable(fd: int) -> bool:
    """True when an idle connection's socket has something to read (the server's goodbye or
    end of stream): checked without waiting."""
    if fd < 0:
        return True
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


def install_safe_ping(engine: Engine) -> None:
    """Make the pool's liveness check treat a connection in any unknown state as dead.

    SQLAlchemy's psycopg ping switches ``autocommit`` on and back off around ``SELECT 1``;
    on a connection not idle (a request still in flight after a send failed halfway, as
    terminated backends leave them) psycopg refuses the switch with a ``ProgrammingError``
    that the pool does not count as a disconnect, so it reached the caller raw. Here any such
    state closes the connection and the pool replaces it; a driver error of the ping itself
    closes it and reports it dead, so the pool renews every connection as after a restart.
    """
    dialect = engine.dialect
    original = dialect.do_ping
    dbapi_error: type[Exception] = dialect.loaded_dbapi.Error
    idle = dialect.loaded_dbapi.pq.TransactionStatus.IDLE

    def do_ping(dbapi_connection: Any) -> bool:
        status = dbapi_connection.info.transaction_status
        if status != idle:
            dbapi_connection.close()
            # This connection only: the pool replaces it (the server itself may be fine).
            raise sa_exc.DisconnectionError(f"pooled connection not idle ({status.name})")
        try:
            return bool(original(dbapi_connection))
        except dbapi_error as error:
            log.info("pooled connection failed its ping (%s); replacing it", error)
            dbapi_connection.close()
            return False

    dialect.do_ping = do_ping  # type: ignore[method-assign]


def psycopg_options(url: URL, engine_kwargs: dict[str, Any]) -> tuple[URL, dict[str, Any]]:
    """Connect arguments for psycopg from the URL.

    ``?prepare_threshold=none`` turns off psycopg's automatic server-side prepared statements,
    which PgBouncer in transaction pooling mode (1.18, Debian 12) cannot carry from one
    transaction to the next server connection; a number sets the threshold.

    While statements are prepared (the default: from a statement's 5th execution on), the
    server is asked for custom plans (``plan_cache_mode=force_custom_plan``, a startup option:
    no round trip). Why: after five executions of a prepared statement PostgreSQL may switch to
    a generic plan that cannot see the parameters, and for a full-text search that plan walks
    the whole table for a rare word (3 ms became 10-16 ms at 10k messages). Planning a simple
    write again costs microseconds; unprepared statements (PgBouncer) always get custom plans.

    The client encoding is UTF-8 (:data:`CLIENT_ENCODING`, a startup parameter: no round trip).
    ``connect_timeout`` and the TCP keepalives (:data:`TCP_KEEPALIVE_DEFAULTS`) are set unless
    the URL or ``connect_args`` set them.
    """
    connect_args = dict(engine_kwargs.get("connect_args", {}))
    # Credentials (?sslpassword=...) go to the driver as they would from the URL, but leave
    # the engine's URL, which repr(engine) and SQLAlchemy's own messages show.
    secrets = [key for key in url.query if is_secret_parameter(key)]
    for key in secrets:
        value = url.query[key]
        connect_args.setdefault(key, value if isinstance(value, str) else value[-1])
    url = url.difference_update_query(secrets)
    connect_args["client_encoding"] = CLIENT_ENCODING
    # connect_timeout: a host that accepts and never answers (a dead standby behind a load
    # balancer) would block opening for good; per host, so a multi-host URL moves on to the
    # next. The keepalives notice a host that vanished silently. What the URL or connect_args
    # give wins.
    tcp_defaults = {"connect_timeout": CONNECT_TIMEOUT_S, **TCP_KEEPALIVE_DEFAULTS}
    for setting, default in tcp_defaults.items():
        if setting not in url.query:
            connect_args.setdefault(setting, default)
    raw = url.query.get("prepare_threshold")
    if raw is not None:
        value = raw if isinstance(raw, str) else raw[-1]
        try:
            connect_args["prepare_threshold"] = (
                None if value.lower() in ("none", "off", "") else int(value)
            )
        except ValueError:
            raise InvalidInputError(
                f"prepare_threshold={value!r} in the URL: use a number or 'none'"
            ) from None
        url = url.difference_update_query(["prepare_threshold"])
    if connect_args.get("prepare_threshold", PSYCOPG_PREPARE_THRESHOLD) is not None:
        given = connect_args.get("options", url.query.get("options", ""))
        given = given if isinstance(given, str) else given[-1]
        if "plan_cache_mode" not in given:
            connect_args["options"] = f"{given} {CUSTOM_PLANS_OPTION}".strip()
    return url, {**engine_kwargs, "connect_args": connect_args}


def install_pooler_guard(engine: Engine) -> None:
    """Never prepare statements through a connection pooler. PgBouncer in transaction mode
    hands one server connection to many clients in turn, and psycopg names its prepared
    statements ``_pg3_0``, ``_pg3_1``... on every connection: behind it they collide
    ("prepared statement does not exist", "already exists", or worse, another client's
    statement of the same shape run with these values). Each new connection compares the
    server process it talks to (``pg_backend_pid()``) with the one its startup named; a
    pooler answers the startup itself, so they differ, and the connection prepares nothing
    (as ``prepare_threshold=none`` in the URL, which also skips this check). One round trip
    per new connection; idempotent."""
    listen_once(engine, "connect", _guard_pooler)


#: Pooler fronts already reported (one warning per server address, not per connection).
_POOLERS_SEEN: set[tuple[str, int]] = set()


def _guard_pooler(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    if driver.prepare_threshold is None:
        return
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SELECT pg_backend_pid()")
        server_pid = cursor.fetchone()[0]
    finally:
        cursor.close()
    if not driver.autocommit:
        dbapi_connection.rollback()
    if server_pid == driver.info.backend_pid:
        return
    driver.prepare_threshold = None
    front = (str(driver.info.host), int(driver.info.port))
    if front not in _POOLERS_SEEN:
        _POOLERS_SEEN.add(front)
        log.info(
            "%s:%s is a connection pooler (PgBouncer?): statements are not prepared on its "
            "connections (add prepare_threshold=none to the URL to skip this check)",
            *front,
        )


#: SQLSTATE of a write refused because the transaction is read-only.
READ_ONLY_SQLSTATE = "25006"


def read_only_reason(*, standby: bool, read_only_default: bool) -> str | None:
    """Why a server refuses every write: it is a hot standby, or ``default_transaction_read_only``
    is on for the database, the role or the server. None when it takes writes (a transaction
    may still be read-only by choice: a read unit)."""
    if standby:
        return (
            "the server is a read-only standby (it replays its primary's changes and refuses "
            "writes): write through the primary; a URL that lists every host with "
            "target_session_attrs=read-write finds it, before and after a failover"
        )
    if read_only_default:
        return (
            "the server refuses writes: default_transaction_read_only is on for this database, "
            "role or server"
        )
    return None


def reported_read_only_reason(driver: Any) -> str | None:
    """:func:`read_only_reason` from what the server behind a psycopg connection reported at
    startup and since (``in_hot_standby``, ``default_transaction_read_only``: PostgreSQL 14
    and later report both), without a round trip."""
    status = driver.info.parameter_status
    return read_only_reason(
        standby=status("in_hot_standby") == "on",
        read_only_default=status("default_transaction_read_only") == "on",
    )


def install_read_only_names(engine: Engine) -> None:
    """A write that a read-only server refuses raises :class:`ReadOnlyDatabaseError` saying
    why (a standby, ``default_transaction_read_only``) instead of the server's "cannot execute
    SELECT in a read-only transaction", which names neither the cause nor the cure (on
    PostgreSQL 14 and later, which report both). A read unit's own READ ONLY transaction is
    left to the usual mapping. Idempotent."""
    listen_once(engine, "handle_error", _name_read_only_refusal)


def _name_read_only_refusal(context: ExceptionContext) -> None:
    if getattr(context.original_exception, "sqlstate", None) != READ_ONLY_SQLSTATE:
        return
    conn = context.connection
    if conn is None or conn.closed or conn.invalidated:
        return
    reason = reported_read_only_reason(conn.connection.driver_connection)
    if reason is not None:
        raise ReadOnlyDatabaseError(reason)


def install_utf8(engine: Engine) -> None:
    """Make a PostgreSQL engine handed to the store talk UTF-8 (see :data:`CLIENT_ENCODING`):
    its new connections ask for it at startup, and a connection it pooled before in another
    encoding is replaced when the pool hands it out. Idempotent."""
    listen_once(engine, "do_connect", _utf8_startup)
    listen_once(engine, "checkout", _utf8_checkout)


def _utf8_startup(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
    cparams["client_encoding"] = CLIENT_ENCODING


def _utf8_checkout(dbapi_connection: Any, _record: ConnectionPoolEntry, _proxy: Any) -> None:
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    if driver.info.encoding != "utf-8":
        log.info("pooled connection in client encoding %s; replacing it", driver.info.encoding)
        raise sa_exc.DisconnectionError("pooled connection not in UTF-8")


@dataclass(frozen=True)
class SqliteSettings:
    """Per-connection state every pooled SQLite connection of a hooked engine carries."""

    writer_ms: int
    reader_ms: int
    foreign_keys: bool
    synchronous: str
    read_only: bool
    wal_limit: int = DEFAULT_JOURNAL_SIZE_LIMIT
    #: A file one process builds before anyone can open it (see ``private_build``).
    private_build: bool = False


_PRAGMA_FOREIGN_KEYS = {True: "PRAGMA foreign_keys=ON", False: "PRAGMA foreign_keys=OFF"}
_PRAGMA_QUERY_ONLY = {True: "PRAGMA query_only=ON", False: "PRAGMA query_only=OFF"}
_PRAGMA_SYNCHRONOUS = {"FULL": "PRAGMA synchronous=FULL", "NORMAL": "PRAGMA synchronous=NORMAL"}
#: By ``private_build``: WAL for every file others may open, the journal in memory for one
#: this process builds alone.
_PRAGMA_JOURNAL = {False: "PRAGMA journal_mode=WAL", True: "PRAGMA journal_mode=MEMORY"}

#: Engines carrying this package's hooks, with the settings they were hooked with.
_HOOKED: weakref.WeakKeyDictionary[Engine, SqliteSettings] = weakref.WeakKeyDictionary()
_HOOK_LOCK = threading.Lock()


def sqlite_settings(engine: Engine) -> SqliteSettings | None:
    """The settings ``engine`` was hooked with, or None when it carries no hooks."""
    return _HOOKED.get(engine)


def check_synchronous(synchronous: str) -> str:
    """``"full"`` (durable through power loss) or ``"normal"`` (app-crash safe), upper-cased."""
    if not isinstance(synchronous, str) or synchronous.lower() not in SYNCHRONOUS_MODES:
        raise InvalidInputError(
            f"synchronous must be one of {sorted(SYNCHRONOUS_MODES)}, not {synchronous!r}"
        )
    return synchronous.upper()


def install_sqlite_hooks(
    engine: Engine,
    *,
    writer_busy_timeout: float = WRITER_BUSY_TIMEOUT_S,
    reader_busy_timeout: float = READER_BUSY_TIMEOUT_S,
    foreign_keys: bool = True,
    synchronous: str = "full",
    wal_size_limit: int | None = None,
    private_build: bool = False,
) -> SqliteSettings:
    """Attach the connect and begin hooks that the store's concurrency model relies on.

    ``private_build``: the file is one this process builds under a name nobody else opens,
    and makes durable and puts in WAL mode before it links it under its real name (an import
    into a new file): its journal is kept in memory (a failed unit still rolls back) and
    nothing is fsynced, so neither a WAL nor a commit's fsync costs anything while it fills.
    A crash leaves only that private file, which the next build removes.

    Idempotent: an engine already hooked with the same settings is left as it is, one hooked
    with other settings is refused (two sets of hooks would fight over every connection).
    Engines the hooks cannot make safe are refused with :class:`UnsupportedEngineError`.
    """
    if engine.dialect.driver != "pysqlite":
        raise UnsupportedEngineError(
            f"SQLite engines must use the standard sqlite3 driver (pysqlite), not "
            f"{engine.dialect.driver!r}: the store begins its write units on that driver"
        )
    if getattr(engine.dialect, "_on_connect_isolation_level", None) == "AUTOCOMMIT" or (
        engine.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    ):
        raise UnsupportedEngineError(
            "this SQLite engine runs in AUTOCOMMIT: SQLAlchemy would never COMMIT the store's "
            "BEGIN IMMEDIATE; pass an engine without isolation_level='AUTOCOMMIT'"
        )
    read_only = sqlite_opens_read_only(engine.url)
    settings = SqliteSettings(
        writer_ms=int(writer_busy_timeout * 1000),
        reader_ms=int(reader_busy_timeout * 1000),
        foreign_keys=foreign_keys,
        synchronous=check_synchronous(synchronous),
        read_only=read_only,
        wal_limit=int(journal_size_limit() if wal_size_limit is None else wal_size_limit),
        private_build=private_build,
    )
    with _HOOK_LOCK:
        existing = _HOOKED.get(engine)
        if existing is not None:
            if existing != settings:
                raise EngineSettingsError(
                    f"this engine already carries hermes_store hooks with other settings "
                    f"({existing}); open every store on it with the same options"
                )
            return existing
        _HOOKED[engine] = settings

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, record: ConnectionPoolEntry) -> None:
        try:
            setup_connection(dbapi_connection, record.info, settings, str(engine.url.database))
        except sqlite3.Error as error:
            # As in the begin hook: raised inside an event, a driver error would escape
            # SQLAlchemy's wrapping (and the package's error mapping) on raw_connection().
            raise sa_exc.DBAPIError.instance(
                "PRAGMA", None, error, sqlite3.Error, dialect=engine.dialect
            ) from error

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # True: a write unit; False: a store's read unit (refuses writes); absent: a plain
        # connection of the engine (deferred, writable, as SQLite's own BEGIN).
        options = conn.get_execution_options()
        option = options.get(WRITE_OPTION)
        pooled = conn.connection
        try:
            begin_on_driver(
                pooled.driver_connection,  # type: ignore[arg-type]
                pooled.info,
                settings,
                write=bool(option),
                query_only=option is False,
                busy_ms=options.get(BUSY_OPTION),
            )
        except sqlite3.Error as error:
            # Raised inside an event, a driver error would escape SQLAlchemy's wrapping.
            raise sa_exc.DBAPIError.instance(
                "BEGIN", None, error, sqlite3.Error, dialect=engine.dialect
            ) from error

    return settings


def setup_connection(
    dbapi_connection: sqlite3.Connection,
    info: dict[Any, Any],
    settings: SqliteSettings,
    where: str = "",
) -> None:
    """The connect hook's body; also run lazily by :func:`prepare_driver` for connections that
    were already in an engine's pool when the hooks were attached."""
    # SQLAlchemy, not the driver, decides when a transaction starts (see the begin hook).
    dbapi_connection.isolation_level = None
    if sys.version_info >= (3, 12):  # stay in legacy mode: autocommit=False would BEGIN itself
        dbapi_connection.autocommit = sqlite3.LEGACY_TRANSACTION_CONTROL  # type: ignore[attr-defined]
    cursor = dbapi_connection.cursor()
    try:
        # WAL: readers never block the writer and the writer never blocks readers (a private
        # build has no other reader: its journal stays in memory).
        mode = (
            "wal"
            if settings.read_only
            else cursor.execute(_PRAGMA_JOURNAL[settings.private_build]).fetchone()[0]
        )
        if mode not in ("wal", "memory"):
            log.warning(
                "%s refuses WAL (journal_mode=%s, e.g. a network file system); "
                "falling back to DELETE: readers will wait for writers",
                where,
                mode,
            )
            cursor.execute("PRAGMA journal_mode=DELETE")
        # A burst grows the WAL; once checkpointed, the next commit cuts it back to this.
        cursor.execute(f"PRAGMA journal_size_limit={int(settings.wal_limit)}")
        # The original store relies on parent_session_id and session_id references being
        # enforced.
        cursor.execute(_PRAGMA_FOREIGN_KEYS[settings.foreign_keys])
        # FULL: a commit survives power loss (WAL's durable mode); NORMAL is the opt-in.
        cursor.execute(
            "PRAGMA synchronous=OFF"
            if settings.private_build
            else _PRAGMA_SYNCHRONOUS[settings.synchronous]
        )
        # Start as a reader; the begin hook switches when a writer takes this connection.
        reader_ms = int(settings.reader_ms)
        cursor.execute(f"PRAGMA busy_timeout={reader_ms}")
    finally:
        cursor.close()
    info["busy_ms"] = settings.reader_ms
    info[BUSY_TIMEOUTS_KEY] = (settings.writer_ms, settings.reader_ms)
    info[SETTINGS_KEY] = settings


def prepare_driver(
    dbapi_connection: sqlite3.Connection,
    info: dict[Any, Any],
    settings: SqliteSettings,
    *,
    write: bool,
    query_only: bool = False,
    busy_ms: int | None = None,
) -> None:
    """Make a pooled connection ready for a unit of the given kind (no BEGIN): the per-connection
    state (set lazily when the connection predates the hooks), the unit's busy timeout
    (``busy_ms`` overrides it: the writer queue's head waits briefly), and ``query_only`` for
    read units (SQLite itself then refuses their writes)."""
    if info.get(SETTINGS_KEY) is not settings:
        setup_connection(dbapi_connection, info, settings)
    wanted = busy_ms if busy_ms is not None else settings.writer_ms if write else settings.reader_ms
    if info["busy_ms"] != wanted:
        dbapi_connection.execute(f"PRAGMA busy_timeout={int(wanted)}")
        info["busy_ms"] = wanted
    if info.get("query_only", False) != query_only:
        dbapi_connection.execute(_PRAGMA_QUERY_ONLY[query_only])
        info["query_only"] = query_only


def begin_on_driver(
    dbapi_connection: sqlite3.Connection,
    info: dict[Any, Any],
    settings: SqliteSettings,
    *,
    write: bool,
    query_only: bool = False,
    busy_ms: int | None = None,
) -> None:
    """Begin a unit on a pooled SQLite connection: the one begin of the package (the engine's
    begin hook calls it for every unit, the hot path included).

    An interrupt (Ctrl-C) raised as the BEGIN returns rolls it back here: CPython raises a
    signal's exception as a C call returns, so the caller's ``try`` would never see that
    transaction, and it would keep the file's write lock from every other process. One still
    open at a begin was left by a unit interrupted in another such gap; its writes were never
    acknowledged, so it is rolled back before this unit begins (it would otherwise fail with
    "cannot start a transaction within a transaction")."""
    if dbapi_connection.in_transaction:
        log.warning("a unit interrupted after its BEGIN left a transaction open: rolled back")
        dbapi_connection.rollback()
    wanted = busy_ms if busy_ms is not None else settings.writer_ms if write else settings.reader_ms
    if (
        info.get(SETTINGS_KEY) is not settings
        or info["busy_ms"] != wanted
        or info.get("query_only", False) != query_only
    ):  # the connection is not ready for this unit yet (a back-to-back writer's always is)
        prepare_driver(
            dbapi_connection, info, settings, write=write, query_only=query_only, busy_ms=busy_ms
        )
    # IMMEDIATE takes the write lock now, so contention shows here and not mid-unit;
    # readers take a deferred BEGIN and never queue behind a writer.
    try:
        dbapi_connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
    except BaseException:
        if dbapi_connection.in_transaction:  # an interrupt as the BEGIN returned
            dbapi_connection.rollback()
        raise
