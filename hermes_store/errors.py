"""One error root for the package, and the one place where driver errors are mapped onto it.

Callers catch :class:`HermesStoreError`; where the original store promised ``ValueError``
the subclass is also a ``ValueError`` so existing ``except ValueError`` code keeps working.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

from sqlalchemy import exc as sa_exc

from hermes_store.echo import one_line

# SQLite primary result codes (extended codes carry them in their low byte).
SQLITE_BUSY = 5
SQLITE_LOCKED = 6
SQLITE_READONLY = 8
SQLITE_IOERR = 10
SQLITE_CORRUPT = 11
SQLITE_FULL = 13
SQLITE_CANTOPEN = 14
SQLITE_NOTADB = 26
#: A statement stopped by its progress handler (Ctrl-C, a deadline).
SQLITE_INTERRUPT = 9
#: SQLITE_IOERR_SHMSIZE: the shared-memory (-shm) file could not be grown, which on a local
#: file system means no space left (a fresh process opening a WAL database on a full disk).
SQLITE_IOERR_SHMSIZE = SQLITE_IOERR | (19 << 8)
SQLITE_CONSTRAINT = 19
# PostgreSQL SQLSTATEs that mean "run the transaction again".
PG_RETRYABLE = frozenset({"40001", "40P01"})
#: PostgreSQL's raise_exception: what PL/pgSQL's ``RAISE EXCEPTION`` (a trigger's) says.
PG_RAISE = "P0001"
#: How Python's sqlite3 refuses a TEXT value that is not valid UTF-8 (no SQLite error code).
UNDECODABLE = "Could not decode to UTF-8"


class HermesStoreError(Exception):
    """Root of every error this package raises on purpose."""

    #: The message in the command line's words, where the message advises Python arguments
    #: (``overwrite=True``) that have a command-line option instead.
    cli_message: str | None = None

    def with_cli_message(self, text: str) -> Self:
        """This error, telling a command-line user ``text`` instead of the message."""
        self.cli_message = text
        return self


class UnknownSessionError(HermesStoreError, ValueError):
    """The session id names no session (nothing was written)."""


class TitleInUseError(HermesStoreError, ValueError):
    """Another session already holds this title (nothing was written)."""


class TitleTooLongError(HermesStoreError, ValueError):
    """A title is longer than ``MAX_TITLE_LENGTH`` after sanitising."""


class InvalidInputError(HermesStoreError, ValueError):
    """An argument cannot be stored as given (checked before anything is written)."""


class WriteRefusedError(HermesStoreError):
    """The database refused a write by a rule of its own that the store cannot name: a
    constraint or a trigger another tool added (SQLite's ``RAISE(ABORT, ...)``, PostgreSQL's
    ``RAISE EXCEPTION``), or a constraint the stored rows already break. The message carries
    the database's own words; the refused statement wrote nothing."""


class UndecodableTextError(HermesStoreError):
    """A text stored in a SQLite file is not valid UTF-8 (another program wrote these bytes as
    TEXT), so it cannot be read as a string: the message names the column and says how to find
    and repair the row. Nothing was changed."""


class DatabaseLockedError(HermesStoreError):
    """The database stayed locked (or busy) through every retry."""


class ReadOnlyDatabaseError(HermesStoreError):
    """The database, its folder or its server refuses writes."""


class ReadOnlyUnitError(ReadOnlyDatabaseError):
    """A write was attempted inside a read-only unit (``uow.connect(write=False)``)."""


class StoreConfigError(HermesStoreError):
    """The store cannot be opened as configured (nothing was written)."""


class UnsupportedEngineError(StoreConfigError):
    """An Engine given to the store cannot carry its SQLite hooks (driver or isolation level)."""


class EngineSettingsError(StoreConfigError):
    """An Engine already carries the store's hooks with different settings."""


class SharedStoreMismatchError(StoreConfigError):
    """This file is already open in this process with other options; the two would share
    one writer, so they must agree (synchronous, busy timeouts, retry policy, ...)."""


class StorageFullError(HermesStoreError):
    """The disk or the database's page limit is full; the transaction was rolled back."""


class StorageIOError(HermesStoreError):
    """The operating system failed a read or write of the database's files (SQLite's
    ``disk I/O error`` family, other than lack of space)."""


class AccessDeniedError(ReadOnlyDatabaseError):
    """The process may not open the database file or its folder (another owner, a mode), or
    the server refuses the role a privilege it needs (a role granted SELECT only, writing)."""


class DatabaseUnavailableError(HermesStoreError):
    """The database server cannot be reached (or went away mid-transaction). A write's error
    says which of its two outcomes it had: :class:`WriteNotLandedError` or
    :class:`WriteOutcomeUnknownError`."""


class WriteNotLandedError(DatabaseUnavailableError):
    """The write did not land, and the store knows it: the connection failed before the
    statement was sent, the server refused it, or its transaction ended without a COMMIT ever
    being sent. Running the call again cannot apply it twice."""


class WriteOutcomeUnknownError(DatabaseUnavailableError):
    """The write may have landed: the connection broke after the statement (or the COMMIT)
    was sent and before the server's answer arrived. Not retried by the store, so it is never
    applied twice; a call given an ``idempotency_key`` can be sent again safely (it lands
    once and returns what the first one returned)."""


class SchemaError(HermesStoreError):
    """The database's schema cannot be used or adopted as it is."""


class SchemaTooNewError(SchemaError):
    """The database was written by a newer store than this package knows."""


class NotADatabaseError(SchemaError):
    """The file is empty, not SQLite at all, or corrupt; it was left untouched."""


class SchemaBehindError(SchemaError):
    """The database is behind this package's schema and the store was opened with
    ``migrate="check"``: nothing was changed; run ``hermes-store db upgrade``."""


class UnrecognizedSchemaError(SchemaError):
    """The database holds tables whose shape matches no known schema version."""


class MissingExtraError(StoreConfigError, ImportError):
    """A feature's optional dependencies are not installed; the message names the extra to
    install. Also an ``ImportError``, which is what callers caught before."""


#: Modules of the optional extras, and the extra that installs each.
_EXTRAS = {
    "psycopg": ("postgresql", "PostgreSQL needs its driver (psycopg 3)"),
    "psycopg_binary": ("postgresql", "PostgreSQL needs its driver (psycopg 3)"),
    "greenlet": ("async", "AsyncSessionDB on PostgreSQL needs greenlet"),
    "pandas": ("analytics", "to_dataframe() needs pandas"),
    "matplotlib": ("analytics", "the charts need matplotlib"),
}


def missing_extra(error: ImportError) -> MissingExtraError | None:
    """The package error naming the extra to install for a failed import of an optional
    dependency (None for any other import error)."""
    name = (error.name or "").split(".")[0]
    if not name and "greenlet" in str(error):  # SQLAlchemy's asyncio says it in words
        name = "greenlet"
    found = _EXTRAS.get(name)
    if found is None:
        return None
    extra, what = found
    return MissingExtraError(f"{what}: pip install 'hermes-store[{extra}]'")


@contextmanager
def extras_named() -> Iterator[None]:
    """Around code that imports an optional dependency: a missing one names its extra."""
    try:
        yield
    except MissingExtraError:
        raise
    except ImportError as error:
        mapped = missing_extra(error)
        if mapped is None:
            raise
        raise mapped from error


def _sqlite_code(orig: BaseException | None) -> int | None:
    code = getattr(orig, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def is_retryable(error: BaseException) -> bool:
    """True for lock/busy errors that re-running the unit of work can cure."""
    orig = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    code = _sqlite_code(orig)
    if code is not None:
        return code in (SQLITE_BUSY, SQLITE_LOCKED)
    if getattr(orig, "sqlstate", None) in PG_RETRYABLE:
        return True
    # sqlite3 errors raised without an error code (older Pythons) only carry the message.
    message = str(orig).lower()
    return type(orig).__name__ == "OperationalError" and (
        "database is locked" in message or "database table is locked" in message
    )


def translate(error: sa_exc.DBAPIError) -> HermesStoreError | None:
    """The package error for a driver error, or None when it has no better name."""
    orig = error.orig
    code = _sqlite_code(orig)
    text = str(orig)
    if code in (SQLITE_NOTADB, SQLITE_CORRUPT):
        return NotADatabaseError(f"not a usable SQLite database: {text}")
    if code == SQLITE_READONLY or getattr(orig, "sqlstate", None) == "25006":
        return ReadOnlyDatabaseError(f"the database refuses writes: {text}")
    # 42501 insufficient_privilege: the role lacks a grant (SELECT only, then a write).
    if getattr(orig, "sqlstate", None) == "42501":
        return AccessDeniedError(_privilege_refused(text))
    if code == SQLITE_FULL or getattr(orig, "sqlstate", None) in ("53100", "53200"):
        return StorageFullError(f"the database is full: {text}")
    if code == SQLITE_IOERR:
        return _sqlite_io_error(orig, text)
    if code == SQLITE_CANTOPEN:
        return ReadOnlyDatabaseError(f"cannot open the database file: {text}")
    sqlstate = getattr(orig, "sqlstate", None)
    if error.connection_invalidated or (sqlstate or "").startswith(("08", "57P")):
        return DatabaseUnavailableError(f"lost the database connection: {text}")
    # 55P03: a lock waited for past the role's lock_timeout (a stalled peer holding a row).
    if sqlstate == "55P03":
        return DatabaseLockedError(
            f"a row or table stayed locked past the server's lock_timeout ({one_line(text)}); "
            "the statement was rolled back"
        )
    # 57014: statement_timeout, or an administrator's pg_cancel_backend.
    if sqlstate == "57014":
        return DatabaseUnavailableError(
            f"the server canceled the statement ({one_line(text)}: its statement_timeout, or "
            "pg_cancel_backend); it was rolled back"
        )
    if sqlstate in ("42P01", "42703") or (code is not None and _SCHEMA_GONE.search(text)):
        return UnrecognizedSchemaError(
            f"the database lacks a table or column the store needs ({one_line(text)}): its "
            "schema changed after the store opened it (a downgrade, the database dropped and "
            "created again, a table dropped); nothing was written. `hermes-store doctor` "
            "says what is missing"
        )
    # 54000: e.g. a message whose words make a tsvector over PostgreSQL's 1 MB limit.
    if sqlstate == "54000":
        return InvalidInputError(f"a value is too large for the database to store: {text}")
    # Class 22 (data exception): a value out of a column's range (22003), a NaN where an
    # integer goes, a negative LIMIT... the argument was wrong, nothing was written.
    if (sqlstate or "").startswith("22"):
        return InvalidInputError(f"the database refused a value: {text}")
    # SQLite's abs() of the smallest integer: how the counter updates refuse an overflow.
    if code is not None and text == "integer overflow":
        return InvalidInputError("a counter would overflow a 64-bit integer; nothing was written")
    # Class 23 (integrity constraint violation) and a trigger's RAISE: the store's own
    # constraints are named where they are met (a title in use, an unknown session).
    if code == SQLITE_CONSTRAINT or (sqlstate or "").startswith("23") or sqlstate == PG_RAISE:
        return WriteRefusedError(
            f"the database refused the write ({text.strip()}): a constraint or trigger of the "
            "database (another tool's, or one the stored rows break) rejected it; nothing was "
            "written"
        )
    if code is None and text.startswith(UNDECODABLE) and type(orig).__module__ == "sqlite3":
        return _undecodable(text)
    # psycopg refuses NUL in text before sending anything: the input is wrong, not the server.
    if isinstance(error, sa_exc.DataError) and sqlstate is None and "NUL" in text:
        return InvalidInputError(f"a text argument contains a NUL character: {text}")
    if sqlstate is None and _TOO_MANY_PARAMETERS in text:
        return InvalidInputError(
            "the call gives more values than one statement can carry (PostgreSQL takes at "
            "most 65535 parameters): pass fewer (filter values, ids ...); nothing was sent"
        )
    if sqlstate is None and _SETTING_REFUSED.search(text) is not None:
        return StoreConfigError(
            f"the database URL has a setting the driver refuses: {text.strip()} (check the "
            "URL's options: sslmode, target_session_attrs, service ...)"
        )
    # psycopg raises OperationalError without a SQLSTATE when it cannot connect at all.
    if (
        isinstance(error, sa_exc.OperationalError)
        and sqlstate is None
        and type(orig).__module__.startswith("psycopg")
    ):
        return DatabaseUnavailableError(_connect_failure(text))
    return None


def _undecodable(text: str) -> UndecodableTextError:
    """sqlite3's refusal of a TEXT value that is not UTF-8 (``Could not decode to UTF-8 column
    'content' with text '...'``), naming the column (the query's label) and its text as far
    as it could be read, with the way to find and repair the row."""
    detail = text[len(UNDECODABLE) :].strip()
    if len(detail) > 200:
        detail = f"{detail[:200]}..."
    return UndecodableTextError(
        f"a text stored in the database is not valid UTF-8 ({detail}): another program wrote "
        "these bytes as TEXT. " + _UNDECODABLE_REPAIR
    )


#: How to find and repair a text that is not UTF-8 (a message's, a title...).
_UNDECODABLE_REPAIR = (
    "Find the row by reading the column as bytes (Python's sqlite3 with "
    "text_factory=bytes, or SELECT rowid, hex(column) FROM its table), then rewrite the value "
    "as valid UTF-8 text (UPDATE messages SET content = ? WHERE id = ?, or "
    "UPDATE sessions SET title = ? WHERE id = ?); nothing was changed"
)


def sqlite_interrupted(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is SQLite's ``SQLITE_INTERRUPT``: a
    statement stopped by its progress handler. A signal's exception (Ctrl-C) raised inside the
    handler is swallowed by the driver, which only tells SQLite to stop: the interrupt comes
    back as this error, and is raised again as what it was, ``KeyboardInterrupt``."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for candidate in (current, getattr(current, "orig", None)):
            code = getattr(candidate, "sqlite_errorcode", None)
            if code == SQLITE_INTERRUPT:
                return True
        current = current.__cause__ or current.__context__
    return False


#: A server's (or libpq's, or PgBouncer's) refusal of a login that no wait cures: the
#: database or role is missing, the credentials or pg_hba.conf refuse it. A server starting
#: up, shutting down or in recovery also answers with FATAL, and that one passes.
_LOGIN_REFUSED = (
    "does not exist",
    "no such database",
    "no such user",
    "authentication failed",
    "no pg_hba.conf entry",
    "no password supplied",
    "is not permitted to log in",
    "permission denied",
)


#: psycopg's refusal to send a statement with more parameters than the protocol carries
#: (65535): an OperationalError with no SQLSTATE, as a lost connection's, though the call is
#: what is wrong.
_TOO_MANY_PARAMETERS = "number of parameters must be between"
#: SQLite's words for a table or column of the store's that is gone (a downgrade while the
#: store was open); FTS5's "no such column: x" for a query's column filter has no table.
_SCHEMA_GONE = re.compile(
    r"^no such table: |has no column named |^no such column: (sessions|messages|write_keys)\."
)
#: libpq's refusal, before it connects, of a URL setting it cannot take (``sslmode=bogus``,
#: ``target_session_attrs=xyz``, ``service=`` naming no service): a psycopg error with no
#: SQLSTATE, as an unreachable server's is, though no wait cures it.
_SETTING_REFUSED = re.compile(r'invalid \w+ value: "|definition of service ".*" not found')


def login_refused(error: sa_exc.DBAPIError) -> bool:
    """True when the server was reached and refused this login for good (see
    :data:`_LOGIN_REFUSED`), or the driver refused the URL's settings before connecting:
    waiting would only delay the same answer."""
    text = str(error.orig)
    return any(part in text for part in _LOGIN_REFUSED) or bool(_SETTING_REFUSED.search(text))


def _privilege_refused(text: str) -> str:
    """The message for a statement the server refused for want of a privilege: which one
    (the server's first line names the object), and what cures it."""
    first = text.strip().splitlines()[0] if text.strip() else "permission denied"
    return (
        f"the database role lacks a privilege this needs ({first}): GRANT it to the role "
        "(writes need INSERT, UPDATE and DELETE on the store's tables and USAGE on their "
        "sequences), or connect as a role that has it"
    )


def _connect_failure(text: str) -> str:
    """Says whether the server was reached: a refused login or a missing database is not an
    unreachable server. A missing role or database gets the command that creates it."""
    _, fatal, detail = text.partition("FATAL:")
    if not fatal:
        return f"cannot reach the database: {text}"
    detail = " ".join(detail.split())
    hint = ""
    if "does not exist" in detail:
        if detail.startswith("role "):
            hint = " (create it first, e.g. `createuser NAME`)"
        elif detail.startswith("database "):
            hint = " (create it first, e.g. `createdb NAME`)"
    return f"the database server refused the connection: {detail}{hint}"


def _sqlite_io_error(orig: BaseException | None, text: str) -> HermesStoreError:
    extended = getattr(orig, "sqlite_errorcode", None)
    name = getattr(orig, "sqlite_errorname", None) or "SQLITE_IOERR"
    if extended == SQLITE_IOERR_SHMSIZE:
        return StorageFullError(
            "the disk is full: SQLite could not size the database's shared-memory (-shm) "
            f"file ({name}: {text}); free some space and try again"
        )
    return StorageIOError(f"the operating system failed an I/O on the database ({name}: {text})")


def translate_os_error(error: OSError, where: str) -> HermesStoreError:
    """The package error for an OS error met while opening or creating the database."""
    code = error.errno
    detail = f"{where}: {error.strerror or error}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"no space left for the database: {detail}")
    if code in (errno.EACCES, errno.EPERM):
        return AccessDeniedError(f"permission denied opening the database: {detail}")
    if code == errno.EROFS:
        return ReadOnlyDatabaseError(f"the database's file system is read-only: {detail}")
    if code == errno.EISDIR:
        return NotADatabaseError(f"{where} is a directory, not a SQLite database file")
    if code == errno.ENOTDIR:
        return NotADatabaseError(f"a part of the database path is not a folder: {detail}")
    return StorageIOError(f"cannot open the database: {detail}")


@contextmanager
def open_errors(where: object) -> Iterator[None]:
    """Around opening a database: OS errors become package errors, and a file refused as
    unreadable because of an I/O failure (a full disk) says what really happened."""
    try:
        yield
    except OSError as error:
        raise translate_os_error(error, str(where)) from error
    except NotADatabaseError as error:
        cause = error.__cause__
        if isinstance(cause, sa_exc.DBAPIError) and _sqlite_code(cause.orig) == SQLITE_IOERR:
            raise _sqlite_io_error(cause.orig, str(cause.orig)) from cause
        raise


def wrap_driver_error(
    orig: BaseException, dialect: Any, sql: str | None = None
) -> sa_exc.DBAPIError:
    """A driver error (raised while running ``sql``, when known) wrapped as SQLAlchemy wraps
    it (so retries and mapping see it), for statements run on the DB-API connection itself."""
    wrapped = sa_exc.DBAPIError.instance(
        sql, None, orig, dialect.loaded_dbapi.Error, dialect=dialect
    )
    assert isinstance(wrapped, sa_exc.DBAPIError)
    return wrapped


def map_driver_error(
    sql: str | None,
    values: Any,
    orig: Exception,
    dialect: Any,
    dbapi_error: type[Exception] | None = None,
) -> Exception:
    """A driver error wrapped as SQLAlchemy wraps it, then named as the package names it (the
    wrapped error as its cause); the wrapped error itself when it has no better name.
    ``dbapi_error``: the driver's base error, for a connection with no dialect (``None``)."""
    wrapped = sa_exc.DBAPIError.instance(
        sql, values, orig, dbapi_error or dialect.loaded_dbapi.Error, dialect=dialect
    )
    assert isinstance(wrapped, sa_exc.DBAPIError)
    mapped = translate(wrapped)
    if mapped is not None:
        mapped.__cause__ = wrapped
        return mapped
    return wrapped


#: psycopg's messages for a request that failed before it was sent whole; the transaction
#: ends at the final Sync message, so an unsent (or partly sent) request committed nothing.
_NOT_SENT_PREFIXES = (
    "the connection is closed",
    "the connection is lost",
    "sending query",
    "sending prepared query",
    "preparing query failed",
    "flushing failed",
)
#: PgBouncer's refusals of a client whose query it never passed to a server: at login while
#: its server logins fail (``server_login_retry``), when no server connection came within
#: ``query_wait_timeout``, or when it cannot connect at all.
_POOLER_NOT_SENT = (
    "server login has been failing",
    "query_wait_timeout",
    "pgbouncer cannot connect to server",
    "no more connections allowed",
)


def server_connection_lost(error: BaseException) -> bool:
    """A PostgreSQL connection broke (:func:`connection_lost`, on psycopg's errors only: a
    SQLite error without a SQLSTATE is a lock or a file error, never a lost server)."""
    if not isinstance(error, sa_exc.DBAPIError):
        return False
    return type(error.orig).__module__.startswith("psycopg") and connection_lost(error)


def connection_lost(error: sa_exc.DBAPIError) -> bool:
    """The connection broke (server gone, backend terminated, network down)."""
    sqlstate = getattr(error.orig, "sqlstate", None) or ""
    return (
        error.connection_invalidated
        or sqlstate.startswith(("08", "57P"))
        or (
            isinstance(error, sa_exc.OperationalError)
            and not sqlstate
            and _TOO_MANY_PARAMETERS not in str(error.orig)
        )
    )


def never_sent(error: sa_exc.DBAPIError) -> bool:
    """True when the statement never (wholly) left this process, or when PgBouncer says it
    never passed it on to a server: retrying it cannot apply it twice."""
    text = str(error.orig)
    return text.startswith(_NOT_SENT_PREFIXES) or any(part in text for part in _POOLER_NOT_SENT)


@contextmanager
def mapped_errors(*, write: bool = False) -> Iterator[None]:
    """Re-raise driver errors that have a package name as that package error (``write``: a
    pool that had no connection to give says the write did not land)."""
    try:
        yield
    except sa_exc.DBAPIError as error:
        mapped = translate(error)
        if mapped is None:
            raise
        raise mapped from error
    except UnicodeEncodeError as error:  # a lone surrogate reached the driver's encoder
        raise InvalidInputError(f"a text argument is not valid Unicode: {error.reason}") from None
    except sa_exc.TimeoutError as error:  # the pool: every connection busy for pool_timeout
        unsent = WriteNotLandedError if write else DatabaseUnavailableError
        raise unsent(
            "no database connection came free in time (every one of the pool's connections "
            f"stayed busy); nothing was sent, so nothing was written: {error}"
        ) from error


@contextmanager
def mapped_driver_errors(
    dialect: Any = None, *, dbapi_error: type[Exception] | None = None
) -> Iterator[None]:
    """:func:`mapped_errors` around a DB-API connection used directly (a raw psycopg cursor
    of ``dialect``'s driver, or a plain ``sqlite3`` connection with no dialect:
    ``dbapi_error=sqlite3.Error``): what it raises is wrapped as SQLAlchemy would wrap it,
    then named as the package names it (a full disk :class:`StorageFullError`, a damaged
    file :class:`NotADatabaseError`), not left a bare driver error."""
    base: type[Exception] = dbapi_error or dialect.loaded_dbapi.Error
    try:
        with mapped_errors():
            yield
    except base as error:
        raise map_driver_error(None, None, error, dialect, base) from error


class UnsafePathError(HermesStoreError):
    """A file this package creates anew (a backup's or a new database's temporary file) was
    already there, planted or left: nothing is written through it."""


class ForkedProcessError(HermesStoreError):
    """A forked process cannot use a database its parent had in use at the fork: it inherited
    SQLite's lock bookkeeping without the locks themselves, so its writes could be lost or
    corrupt the file. Nothing was written."""


class WalDeletedError(StorageIOError):
    """The database's WAL was deleted while this process was writing into it (it had lost its
    locks): the write was not saved, and this process refuses further writes to the file."""


class StoreMisuseError(HermesStoreError):
    """The store was called where the call cannot work (the message says what does); the
    refused call wrote nothing."""


class TransactionMisuseError(StoreMisuseError):
    """A transaction was used where it cannot work: from a thread or context other than the
    one that opened it (a generator resumed elsewhere), through a call that would wait for the
    writer its own thread holds, after its event loop was closed, or ended while a nested
    ``transaction()`` block opened inside it was still open (blocks ended out of order). A
    block ended this way is rolled back."""


class DatabaseAliasError(StoreConfigError):
    """The database file has another name (a hard link) through which another process could
    write it with a WAL of its own; refused before anything is opened or written."""
