"""Moving sessions in and out of a database: JSON Lines export and import.

``export`` streams one session (its row and its messages) per line; ``import`` restores such a
file with ids, timestamps, counters and costs exactly as exported. The export file is written
owner-only through an unpredictable temp file created exclusively (``mkstemp``) and renamed into
place; neither an export target nor an import source may be the database or its sidecars, since
even opening them with a plain handle would drop this process's SQLite locks (see files.py).

A file the original store wrote may hold any value in any column (SQLite's dynamic typing):
text in a counter, a blob in ``content``, an infinite cost. JSON has no form for some of them
and the import's checks refuse the others, so the export writes each value that is not of its
column's type, or that is a number outside what the store takes (an infinite or NaN cost, a
timestamp in milliseconds), as a marked object, and the import stores the value it stands for:

* ``{"$sqlite": "blob", "base64": "AP8Q"}``: a blob, its bytes in base64;
* ``{"$sqlite": "real", "value": "Infinity"}`` (``"-Infinity"``, ``"NaN"``, or a number): a
  float;
* ``{"$sqlite": "text", "value": "abc"}``: text where a number belongs;
* ``{"$sqlite": "integer", "value": 7}``: an integer where text or a float belongs.

A SQLite database takes them all back as they were; PostgreSQL only the numbers its column
types hold (a float in a ``double precision`` column), the rest are refused by name and line.
What no import can restore is left out and counted (:class:`ExportReport`), never silently:
messages whose session no longer exists (a message belongs to a session), and sessions stored
with no id (SQLite lets a ``TEXT PRIMARY KEY`` be NULL).
"""

from __future__ import annotations

import base64
import binascii
import gc
import io
import json
import logging
import math
import os
import queue
import sqlite3
import stat
import sys
import tempfile
import threading
import traceback
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from operator import itemgetter
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy import bindparam, func, select, update
from sqlalchemy.engine import URL, Connection

from hermes_store import jsontext, redact, timestamps, titles, validate
from hermes_store.echo import echoed, one_line
from hermes_store.engine import fastpath, files
from hermes_store.engine.factory import create_engine, sqlite_file, to_url
from hermes_store.errors import (
    HermesStoreError,
    InvalidInputError,
    StoreConfigError,
    TitleTooLongError,
    mapped_driver_errors,
)
from hermes_store.ops import maintenance
from hermes_store.repo import pgstream
from hermes_store.rows import ExportRecord
from hermes_store.schema import fulltext, migrate
from hermes_store.store import SessionDB
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.uow import UnitOfWork

RowDict = dict[str, Any]

log = logging.getLogger(__name__)


class ImportCheckError(HermesStoreError):
    """A batch did not land as prepared (rolled back): the database disagrees with the file."""


class DatabaseTargetError(InvalidInputError):
    """An export target or import source is the database itself or one of its sidecars, or
    the path of a database to build whole is taken."""


class OutputFileError(InvalidInputError):
    """The export file cannot be created (no such folder, no permission)."""


class ParentCycleError(InvalidInputError):
    """An imported session's parent links would lead back to it (A's parent B, B's parent A):
    the batch that would close the cycle was rolled back, the batches before it stay."""


def is_database_file(path: str | os.PathLike[str], database: URL) -> bool:
    """True when ``path`` names the SQLite database of ``database`` or its -wal/-shm/-journal."""
    db_file = sqlite_file(database)
    if db_file is None:
        return False
    resolved = Path(path).resolve()
    return resolved in {
        Path(f"{db_file.resolve()}{suffix}") for suffix in ("", *files.SIDECAR_SUFFIXES)
    }


#: What an export streams into instead of replacing (:func:`export_writer`).
_STREAMS = frozenset({"a character device", "a FIFO (named pipe)"})


def _stream_to(target: Path) -> int:
    """A descriptor writing into the device or FIFO at ``target``: never through a symbolic
    link swapped in since it was looked at, never created or truncated, and checked on the
    descriptor to be what was looked at."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        raise OutputFileError(f"Could not open {str(target)!r}: {error.strerror}") from error
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        os.close(fd)
        raise OutputFileError(f"refusing to write {str(target)!r}: it changed as it was opened")
    return fd


@contextmanager
def export_writer(path: str, database: URL, *, stream: bool = True) -> Iterator[IO[str]]:
    """``-`` is stdout (UTF-8 whatever the locale says); a file is written owner-only (0600)
    into an unpredictable temp file created exclusively beside its final name, and renamed into
    place when complete (a crash leaves the old file, never half a new one).

    A character device or a FIFO (``/dev/null``, a pipe from the shell's ``>(...)``) is
    written to as it is, never replaced; with ``stream`` off (files the export names itself)
    it is refused, as a folder or a socket always is. The database and its ``-wal``/``-shm``
    are never a target: replacing them would destroy the store, and even opening them would
    drop this process's SQLite locks.
    """
    if path == "-":
        stdout = sys.stdout
        buffer = getattr(stdout, "buffer", None)
        if buffer is None:  # a text-only stream (tests): it takes str as is
            yield stdout
            return
        stdout.flush()
        handle = io.TextIOWrapper(buffer, encoding="utf-8", newline="\n", write_through=True)
        try:
            yield handle
        finally:
            handle.flush()
            handle.detach()  # stdout stays open for whoever prints next
        return
    final = Path(path)
    if is_database_file(final, database):
        raise DatabaseTargetError(f"refusing to export onto the database itself ({final})")
    kind = files.special_kind(final)
    if kind is not None:
        if not stream or kind not in _STREAMS:
            raise OutputFileError(f"refusing to write {path!r}: it is {kind}, not a file")
        with open(_stream_to(final), "w", encoding="utf-8", newline="\n") as device:
            yield device
        return
    if final.is_symlink():
        # Replacing it would swap the link for a file and leave its target as it was, while
        # the export said it wrote there: name the file itself.
        raise OutputFileError(
            f"refusing to write {path!r}: it is a symbolic link (to {os.readlink(final)!r}); "
            "name the file it points to"
        )
    try:
        fd, partial_name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
    except OSError as error:
        raise OutputFileError(f"Could not open file {path!r}: {error.strerror or error}") from error
    partial = Path(partial_name)
    try:
        with open(fd, "w", encoding="utf-8", newline="\n") as handle:
            yield handle
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)


def write_export(handle: IO[str], records: Iterable[RowDict]) -> Iterator[RowDict]:
    """Write each record as one JSON line, yielding it once written (for progress and counts)."""
    for record in records:
        handle.write(jsontext.dumps(record, ensure_ascii=False) + "\n")
        yield record


#: Messages whose session is not in the table (a file the original store wrote, with its
#: foreign keys off, may hold them).
_ORPHAN_MESSAGES = (
    select(func.count()).select_from(M).where(~sa.exists().where(S.c.id == M.c.session_id))
)


def export_records(
    db: SessionDB,
    *,
    session_id: str | None = None,
    sources: Iterable[str] = (),
    report: ExportReport | None = None,
) -> tuple[Iterator[ExportRecord], int]:
    """The records to export and how many: one session, the given sources', or all.

    What no import could restore is left out and counted in ``report`` (and logged), never
    dropped silently: sessions stored with no id (as they are met) and, exporting all,
    messages whose session no longer exists (counted before the first record)."""
    left_out = ExportReport() if report is None else report
    if session_id is not None:
        record = db.export_session(session_id)
        return iter([record] if record else []), 1
    wanted = list(dict.fromkeys(sources))
    if not wanted:
        left_out.orphan_messages = int(db.uow.read_scalar(_ORPHAN_MESSAGES) or 0)
        if left_out.orphan_messages and report is None:  # nobody reads the count: say it
            log.warning(
                "export: %d message(s) whose session no longer exists left out",
                left_out.orphan_messages,
            )
        return _with_ids(db.iter_export(), left_out, report is None), db.session_count()

    def chained() -> Iterator[ExportRecord]:
        for source in wanted:
            yield from db.iter_export(source)

    return _with_ids(chained(), left_out, report is None), sum(
        db.session_count(source) for source in wanted
    )


def _with_ids(
    records: Iterator[ExportRecord], report: ExportReport, warn: bool
) -> Iterator[ExportRecord]:
    """``records`` but those of a session stored with no id, counted in ``report`` (and
    logged when ``warn``: nobody reads the count): no import can restore one (nothing names
    it), and the store's API cannot reach it."""
    for record in records:
        if record["id"] is None:
            report.sessions_without_id += 1
            if warn:
                log.warning("export: a session stored with no id left out")
            continue
        yield record


@contextmanager
def import_reader(path: str, database: URL) -> Iterator[tuple[IO[bytes], int | None]]:
    """The import file as bytes and its size (``-``: stdin, size unknown)."""
    if path == "-":
        yield sys.stdin.buffer, None
        return
    if is_database_file(path, database):
        raise DatabaseTargetError(f"refusing to import from the database itself ({path})")
    with open(path, "rb") as handle:
        yield handle, os.fstat(handle.fileno()).st_size


@dataclass
class ImportReport:
    """What ``import`` did; every session or message of the file lands in exactly one bucket."""

    sessions: int = 0
    sessions_skipped: int = 0  # the id already exists in the target (or earlier in the file)
    messages: int = 0
    messages_skipped: int = 0  # they belong to a skipped session
    messages_renumbered: int = 0  # the message id was taken: stored under a new id
    titles_cleared: int = 0  # a session of the target, or one earlier in the file, holds it
    #: not a title the store keeps (over 100 characters, or holding what sanitising removes
    #: or collapses, as a redacted export's marker can make one): left empty
    titles_refused: int = 0
    parents_missing: int = 0  # the parent session is in neither the file nor the target
    #: sessions already in the target stored with no parent, linked to the file's one (an
    #: import run again after one that stopped before their parents were in)
    parents_restored: int = 0
    #: sessions already in the target whose stored parent is not the file's: kept as stored
    parents_differing: int = 0


@dataclass
class _Prepared:
    session: RowDict
    messages: list[RowDict]
    line: int
    title_refused: bool = False  # the record's title was not one the store keeps: left empty


@dataclass
class _BatchOutcome:
    report: ImportReport
    linked: set[str]
    new_links: dict[str, str]
    #: children of ``new_links`` that were already in the target (links being restored)
    restoring: frozenset[str] = frozenset()


_REQUIRED_SESSION = ("id", "source", "started_at")
_REQUIRED_MESSAGE = ("role", "timestamp")
_CHUNK = 500


def _python_types(column: sa.Column[Any]) -> tuple[type, ...]:
    if isinstance(column.type, sa.Integer):
        return (int,)
    if isinstance(column.type, sa.Float | sa.REAL | sa.Numeric):
        return (int, float)
    return (str,)


#: Numbers are held to the API's rules (``validate``): the store's timestamps, its costs,
#: its other real numbers, and its integers.
_MOMENTS = frozenset({"started_at", "ended_at", "timestamp"})
_COSTS = frozenset({"estimated_cost_usd", "actual_cost_usd"})
_Check = Callable[[str, object], object]  # raises on a bad value; what it returns is unused


def _number_rule(column: sa.Column[Any]) -> tuple[_Check, float, float] | None:
    """How a column's numbers are checked: the API's check, and the range inside which a
    number passes it without the call (an import checks a million of them)."""
    if column.name in _MOMENTS:
        return validate.moment, timestamps.EARLIEST, timestamps.LATEST
    if column.name in _COSTS:
        return validate.cost, -validate.MAX_COST_USD, validate.MAX_COST_USD
    kinds = _python_types(column)
    if kinds == (int,):
        return validate.integer, validate.INT64_MIN, validate.INT64_MAX
    return (validate.real, math.inf, -math.inf) if float in kinds else None  # always asked


@dataclass(frozen=True)
class _Shape:
    """A table's columns as an import checks a record: (name, accepted types, value when the
    record leaves it out, the rule of its numbers) in table order, and every name."""

    columns: tuple[
        tuple[str, tuple[type, ...], int | None, tuple[_Check, float, float] | None], ...
    ]
    names: frozenset[str]

    @classmethod
    def of(cls, table: sa.Table) -> _Shape:
        return cls(
            columns=tuple(
                # the counters (server default 0) are 0 when left out
                (
                    c.name,
                    _python_types(c),
                    0 if c.server_default is not None else None,
                    _number_rule(c),
                )
                for c in table.c
            ),
            names=frozenset(table.c.keys()),
        )


_SESSION_SHAPE = _Shape.of(S)
_MESSAGE_SHAPE = _Shape.of(M)
_SESSION_EXTRA = frozenset({"messages"})


#: The SQLite storage class of each Python type a stored value comes back as.
_STORAGE: dict[type, str] = {str: "text", int: "integer", float: "real"}
#: Columns whose value the export writes as read: ``tool_calls`` is decoded JSON (its own
#: values are not the column's), the import encodes it again.
_AS_DECODED = frozenset({"tool_calls"})


def _export_shape(table: sa.Table) -> tuple[tuple[str, tuple[type, ...], float, float], ...]:
    """Each column's name, the types the import takes for it, and the range inside which a
    number passes the import's checks (``-inf .. inf`` for text: never compared)."""
    shape = []
    for column in table.c:
        if column.name in _AS_DECODED:
            continue
        rule = _number_rule(column)
        low, high = (-math.inf, math.inf) if rule is None else rule[1:]
        if rule is not None and rule[0] is validate.real:  # any finite number passes
            low, high = -sys.float_info.max, sys.float_info.max
        shape.append((column.name, _python_types(column), low, high))
    return tuple(shape)


_SESSION_EXPORT = _export_shape(S)
_MESSAGE_EXPORT = _export_shape(M)


def _marked_row(
    row: RowDict, shape: tuple[tuple[str, tuple[type, ...], float, float], ...]
) -> tuple[RowDict, int]:
    """``row`` with each value the import would not take as it is (a blob, text where a
    number belongs, a non-finite or out-of-range number) written as a marked object
    (:func:`jsontext.stored`), and how many were; ``row`` itself when none is."""
    marked: RowDict | None = None
    count = 0
    for name, kinds, low, high in shape:
        value = row.get(name)
        if value is None:
            continue
        kind = type(value)
        if kind in kinds and (kind is str or low <= value <= high):  # NaN fails the range
            continue
        if marked is None:
            marked = dict(row)
        marked[name] = jsontext.stored(_STORAGE.get(kind, "blob"), value)
        count += 1
    return (row, 0) if marked is None else (marked, count)


def mark_stored_values(record: RowDict) -> tuple[RowDict, int]:
    """An exported session with every value the import would not take as it is written as a
    marked object (see the module's docstring), and how many values were."""
    session, count = _marked_row(record, _SESSION_EXPORT)
    messages = []
    for message in record.get("messages") or []:
        marked, more = _marked_row(message, _MESSAGE_EXPORT)
        messages.append(marked)
        count += more
    if count:
        session = {**session, "messages": messages}
    return session, count


def _unmarked(value: dict[Any, Any], kinds: tuple[type, ...], where: str, sqlite: bool) -> Any:
    """The value a marked object of the export stands for (see the module's docstring). A
    database other than SQLite takes only one its column's type holds: the rest are refused
    (``where`` names the field)."""
    kind = value.get(jsontext.MARKER)
    try:
        if kind == "blob" and value.keys() == {jsontext.MARKER, "base64"}:
            raw: Any = base64.b64decode(value["base64"], validate=True)
        elif kind in _STORED_KINDS and value.keys() == {jsontext.MARKER, "value"}:
            raw = value["value"]
            if kind == "real" and raw in _NON_FINITE:
                raw = float(raw)
            if type(raw) not in _STORED_KINDS[kind]:
                raise ValueError(kind)
        else:
            raise ValueError(kind)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidInputError(
            f"{where} is not a stored value the export writes: {echoed(value)}"
        ) from None
    if sqlite and isinstance(raw, float) and math.isnan(raw):
        # SQLite stores a bound NaN as NULL: the value would be lost without a word.
        raise InvalidInputError(
            f"{where} holds NaN, which a SQLite database cannot store (it would become "
            "NULL): import the file into a PostgreSQL database"
        )
    if not sqlite and type(raw) not in kinds:
        raise InvalidInputError(
            f"{where} holds {_described(raw)}, which only a SQLite database stores in that "
            "column (a file the original store wrote held it): import the file into a SQLite "
            "database"
        )
    return raw


_STORED_KINDS: dict[Any, tuple[type, ...]] = {
    "real": (float, int),
    "integer": (int,),
    "text": (str,),
}
_NON_FINITE = frozenset({"Infinity", "-Infinity", "NaN"})


def _described(value: Any) -> str:
    if isinstance(value, bytes):
        return f"a blob of {len(value):,} byte(s)"
    return f"{_STORAGE.get(type(value), 'a value')} {echoed(value)}"


def _checked(
    record: Any,
    shape: _Shape,
    where: str,
    required: tuple[str, ...],
    *,
    extra: frozenset[str] = frozenset(),
    nul_ok: bool,
) -> RowDict:
    """The record as a full column dict, every value type-checked before anything is written;
    a marked object (a value of another type a file the original store wrote held) is the
    value it stands for, as it was (:func:`_unmarked`)."""
    if not isinstance(record, dict):
        raise InvalidInputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if not record.keys() <= shape.names:
        unknown = set(record) - shape.names - extra
        if unknown:
            raise InvalidInputError(f"{where}: unknown fields {sorted(unknown)}")
    row: RowDict = {}
    for name, kinds, default, rule in shape.columns:
        value = record.get(name, default)
        if type(value) is dict and jsontext.MARKER in value:
            value = _unmarked(value, kinds, f"{where}: {name}", sqlite=nul_ok)
        elif value is None:
            if name in required:
                raise InvalidInputError(f"{where}: {name} is required")
        elif type(value) not in kinds and (isinstance(value, bool) or not isinstance(value, kinds)):
            expected = " or ".join(k.__name__ for k in kinds)
            raise InvalidInputError(f"{where}: {name} must be {expected}")
        elif rule is not None:
            check, low, high = rule
            if not low <= value <= high:  # NaN too
                try:
                    check(name, value)
                except InvalidInputError as error:
                    raise InvalidInputError(f"{where}: {error}") from None
        elif isinstance(value, str):
            if not nul_ok and "\x00" in value:
                raise InvalidInputError(f"{where}: {name} holds a NUL character")
            if not value.isascii() and not _is_unicode(value):
                raise InvalidInputError(
                    f"{where}: {name} holds a lone surrogate (a \\ud800-\\udfff escape "
                    "with no pair): not valid Unicode text"
                )
        row[name] = value
    return row


def _is_unicode(text: str) -> bool:
    """Whether ``text`` is valid Unicode: JSON's ``\\ud800`` escape decodes to a lone
    surrogate, which no database stores as text (the driver refuses it as the batch is
    written, naming neither line nor field)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _keeps_title(title: str | None) -> bool:
    """Whether ``title`` is one the store keeps (``set_session_title``'s rule: at most
    ``MAX_TITLE_LENGTH`` characters, nothing sanitising would remove or collapse). One that is
    not is left empty and counted (``titles_refused``), never changed into another title: the
    rest of the session imports as it was exported."""
    if not isinstance(title, str):  # None, or a blob a file held: stored as exported
        return True
    try:
        return titles.sanitize_title(title) == title
    except TitleTooLongError:
        return False


def _prepare(record: Any, line: int, nul_ok: bool, allow_redacted: bool = False) -> _Prepared:
    """Validate one exported session (as :meth:`SessionDB.export_session` writes it)."""
    where = f"line {line}"
    if isinstance(record, dict) and redact.MARKER_KEY in record:
        if record[redact.MARKER_KEY] is not False and not allow_redacted:
            raise InvalidInputError(
                f"{where}: this is a redacted export (secrets were replaced by markers); "
                "importing it would store the markers as if they were the text: refused "
                "(--force imports it anyway)"
            )
        record = {k: v for k, v in record.items() if k != redact.MARKER_KEY}
    session = _checked(
        record, _SESSION_SHAPE, where, _REQUIRED_SESSION, extra=_SESSION_EXTRA, nul_ok=nul_ok
    )
    if session["parent_session_id"] == session["id"]:
        raise InvalidInputError(f"{where}: session {echoed(session['id'])} is its own parent")
    title_refused = not _keeps_title(session["title"])
    if title_refused:
        session["title"] = None
    raw_messages = record.get("messages") or []
    if not isinstance(raw_messages, list):
        raise InvalidInputError(f"{where}: messages must be a list")
    messages = []
    for index, raw in enumerate(raw_messages):
        if isinstance(raw, dict) and raw.get("tool_calls") is not None:
            # get_messages() decodes tool_calls; store them as JSON text again.
            raw = {**raw, "tool_calls": jsontext.dumps(raw["tool_calls"])}
        message = _checked(
            raw, _MESSAGE_SHAPE, f"{where}, message {index}", _REQUIRED_MESSAGE, nul_ok=nul_ok
        )
        if message["session_id"] not in (None, session["id"]):
            raise InvalidInputError(f"{where}, message {index}: belongs to another session")
        message["session_id"] = session["id"]
        messages.append(message)
    return _Prepared(session, messages, line, title_refused)


def _in(column: sa.Column[Any], *what: Any) -> sa.Select[Any]:
    """``what`` (default: the column) of the rows whose ``column`` is in the list ``:values``;
    built once, so the driver-level path (:mod:`hermes_store.engine.fastpath`) compiles it once."""
    return select(*(what or (column,))).where(column.in_(bindparam("values", expanding=True)))


_SESSION_IDS = _in(S.c.id)
_SESSION_PARENTS = _in(S.c.id, S.c.id, S.c.parent_session_id)
_TITLES = _in(S.c.title)
_MESSAGE_IDS = _in(M.c.id)
_SESSIONS_LANDED = _in(S.c.id, func.count())
_MESSAGES_LANDED = _in(M.c.session_id, func.count())


def _cycle_walk() -> sa.Select[Any]:
    """The sessions of the list ``:values`` whose parents lead back to them: each walks up
    its chain of parents (as stored, links of this batch included), one row per (child,
    ancestor) pair. ``UNION`` keeps a pair once, so a walk ends at a root, at a parent that
    is missing, back at its child, or once round a cycle it joined (an older one, not
    through the child): one row per ancestor, never more."""
    start = select(S.c.id.label("child"), S.c.parent_session_id.label("ancestor")).where(
        S.c.id.in_(bindparam("values", expanding=True)), S.c.parent_session_id.is_not(None)
    )
    walk = start.cte("parent_walk", recursive=True)
    step = S.alias("walk_step")
    walk = walk.union(
        select(walk.c.child, step.c.parent_session_id).where(
            step.c.id == walk.c.ancestor,
            walk.c.ancestor != walk.c.child,
            step.c.parent_session_id.is_not(None),
        )
    )
    return select(walk.c.child).where(walk.c.ancestor == walk.c.child)


_CYCLE_CHILDREN = _cycle_walk()
#: Taken by each import batch on PostgreSQL until it commits: two imports of the same file
#: would otherwise both find an id free and both insert it (READ COMMITTED).
_IMPORT_LOCK = sa.text("SELECT pg_advisory_xact_lock(7254312093460238617)")
#: The most sessions of a cycle an error names (a longer one ends with ``...``).
_CYCLE_SHOWN = 10


def _chunks(conn: Connection, statement: sa.Select[Any], values: Iterable[Any]) -> Iterator[Any]:
    """The first column of ``statement``'s rows for ``values``, queried in chunks."""
    unique = list(dict.fromkeys(v for v in values if v is not None))
    for start in range(0, len(unique), _CHUNK):
        params = {"values": unique[start : start + _CHUNK]}
        for row in fastpath.rows(conn, statement, params, expanding=("values",)):
            yield next(iter(row.values()))


def _existing(conn: Connection, statement: sa.Select[Any], values: Iterable[Any]) -> set[Any]:
    """Which of ``values`` the statement's column already holds."""
    return set(_chunks(conn, statement, values))


def _stored_parents(conn: Connection, ids: Iterable[str]) -> dict[str, str | None]:
    """The stored parent of each of the sessions ``ids`` (all in the table)."""
    unique = list(dict.fromkeys(ids))
    parents: dict[str, str | None] = {}
    for start in range(0, len(unique), _CHUNK):
        params = {"values": unique[start : start + _CHUNK]}
        for row in fastpath.rows(conn, _SESSION_PARENTS, params, expanding=("values",)):
            child, parent = row.values()
            parents[child] = parent
    return parents


#: One message of the ids from ``:low`` to ``:high``, if any (a probe of the primary key).
_MESSAGE_IN_SPAN = (
    select(M.c.id).where(M.c.id.between(bindparam("low"), bindparam("high"))).limit(1)
)


def _taken_message_ids(conn: Connection, messages: list[RowDict]) -> set[Any]:
    """Which of the messages' ids the table already holds. An export's batch holds a run of
    ids no other batch shares (a session's messages are numbered together): when not one
    row lies between its lowest and highest id, none is taken, found by one probe instead of
    a lookup per id (read in the batch's own write transaction, so no other writer can add
    one before it commits)."""
    ids = [m["id"] for m in messages]
    if ids and None not in ids:
        found = conn.execute(_MESSAGE_IN_SPAN, {"low": min(ids), "high": max(ids)}).first()
        if found is None:
            return set()
    return _existing(conn, _MESSAGE_IDS, ids)


def _write_batch(
    conn: Connection,
    batch: list[_Prepared],
    pending: dict[str, str],
    while_indexing: Callable[[], object] = lambda: None,
    restoring: frozenset[str] = frozenset(),
) -> _BatchOutcome:
    """One write unit: insert the new sessions and their messages, link parents, check counts.
    ``while_indexing`` is started once the rows are in, as SQLite indexes them (SQLite only).
    ``restoring``: the children of ``pending`` that were already in the target.

    Pure with respect to the caller's state (the Unit of Work may run it twice on a lock).
    """
    report = ImportReport()
    if conn.dialect.name == "postgresql":
        # Another import may be writing the same ids: its batch commits before this one
        # looks, so an id it took is skipped here like any known id.
        conn.execute(_IMPORT_LOCK)
    known = _existing(conn, _SESSION_IDS, (p.session["id"] for p in batch))
    taken = set(known)
    fresh: list[_Prepared] = []
    skipped: list[_Prepared] = []
    for prepared in batch:
        if prepared.session["id"] in taken:
            report.sessions_skipped += 1
            report.messages_skipped += len(prepared.messages)
            if prepared.session["id"] in known:
                skipped.append(prepared)
        else:
            taken.add(prepared.session["id"])
            fresh.append(prepared)
    restored = _links_to_restore(conn, skipped, pending, report)
    if not fresh and not restored:
        return _BatchOutcome(report, set(), {})

    # The unique index compares titles exactly (no collation, no normalising), as ``in`` does
    # here. A title kept by a session of this batch is held from then on: whatever the batch
    # size, the first session of the file keeps it and the later ones are cleared.
    held_titles = _existing(conn, _TITLES, (p.session["title"] for p in fresh))
    new_links: dict[str, str] = {}
    rows = []
    for prepared in fresh:
        row = dict(prepared.session)
        report.titles_refused += prepared.title_refused
        if row["title"] is not None:
            if row["title"] in held_titles:
                row["title"] = None
                report.titles_cleared += 1
            else:
                held_titles.add(row["title"])
        if row["parent_session_id"] is not None:
            # Parents follow their children in a newest-first file: link once both exist.
            new_links[row["id"]] = row.pop("parent_session_id")
        row["parent_session_id"] = None
        rows.append(row)
    _insert(conn, S, rows)
    report.sessions = len(rows)
    new_links.update(restored)

    messages = [m for p in fresh for m in p.messages]
    used_ids = _taken_message_ids(conn, messages)
    keep, renumber = [], []
    for message in messages:
        if message["id"] is None or message["id"] in used_ids:
            renumber.append({k: v for k, v in message.items() if k != "id"})
        else:
            used_ids.add(message["id"])
            keep.append(message)
    if conn.dialect.name == "sqlite":
        _sqlite_insert_messages(conn, keep, renumber, while_indexing)
    else:
        if keep:
            _insert(conn, M, keep)
            _advance_message_sequence(conn)
        if renumber:
            _insert(conn, M, renumber)
    report.messages = len(messages)
    report.messages_renumbered = len(renumber) - sum(m["id"] is None for m in messages)

    links = {**pending, **new_links}
    parents = _existing(conn, _SESSION_IDS, links.values())
    linked = {child for child, parent in links.items() if parent in parents}
    if linked:
        conn.execute(
            update(S)
            .where(S.c.id == bindparam("child"))
            .values(parent_session_id=bindparam("parent")),
            [{"child": child, "parent": links[child]} for child in linked],
        )
        _refuse_cycles(conn, linked, batch)
    report.parents_restored = len(linked & (restoring | restored.keys()))

    fresh_ids = [p.session["id"] for p in fresh]
    landed_sessions = sum(_chunks(conn, _SESSIONS_LANDED, fresh_ids))
    landed_messages = sum(_chunks(conn, _MESSAGES_LANDED, fresh_ids))
    if (landed_sessions, landed_messages) != (len(fresh), len(messages)):
        raise ImportCheckError(
            f"batch starting at line {batch[0].line}: expected {len(fresh)} sessions and "
            f"{len(messages)} messages, the database holds {landed_sessions} and "
            f"{landed_messages}; the batch was rolled back"
        )
    return _BatchOutcome(report, linked, new_links, frozenset(restored))


def _links_to_restore(
    conn: Connection, skipped: list[_Prepared], pending: dict[str, str], report: ImportReport
) -> dict[str, str]:
    """The parent links to restore on sessions of the batch already in the target (child ->
    the file's parent): those stored with no parent, where the file gives one (an import
    run again after one that stopped before their parents were in, whose links to come
    lived only in its memory). A stored parent other than the file's is never replaced: it
    is counted in ``report`` (``parents_differing``)."""
    wanted = {
        p.session["id"]: p.session["parent_session_id"]
        for p in skipped
        if p.session["parent_session_id"] is not None and p.session["id"] not in pending
    }
    if not wanted:
        return {}
    restored: dict[str, str] = {}
    for child, stored in _stored_parents(conn, wanted).items():
        if stored is None:
            restored[child] = wanted[child]
        elif stored != wanted[child]:
            report.parents_differing += 1
    return restored


def _refuse_cycles(conn: Connection, linked: Iterable[str], batch: list[_Prepared]) -> None:
    """Raise :class:`ParentCycleError` when the links just applied close a cycle of parents.

    A new cycle runs through a link of this batch, so walking up from each newly linked
    child finds it (:func:`_cycle_walk`, one statement per 500 children; the chains already
    in the database and the batches before count, as stored). Only the children linked now
    are walked: an import of sessions without parents asks nothing. The error names the
    cycle from the session of the batch that comes first."""
    looping = sorted(set(_chunks(conn, _CYCLE_CHILDREN, linked)))
    if not looping:
        return
    cycle = [looping[0]]
    parent_of = select(S.c.parent_session_id).where(S.c.id == bindparam("id"))
    while len(cycle) <= _CYCLE_SHOWN:
        parent = conn.scalar(parent_of, {"id": cycle[-1]})
        if parent is None or parent == cycle[0]:
            break
        cycle.append(parent)
    lines: dict[str, int] = {}
    for prepared in batch:
        lines.setdefault(prepared.session["id"], prepared.line)
    line, first = min(((lines[s], s) for s in cycle if s in lines), default=(batch[0].line, None))
    if len(cycle) > _CYCLE_SHOWN:
        shown = " -> ".join(repr(s) for s in cycle[:_CYCLE_SHOWN]) + " -> ..."
    else:
        turn = cycle.index(first) if first is not None else 0
        cycle = cycle[turn:] + cycle[:turn]
        shown = " -> ".join(repr(s) for s in [*cycle, cycle[0]])
    first_line, last_line = batch[0].line, batch[-1].line
    span = f"lines {first_line}-{last_line}" if last_line != first_line else f"line {first_line}"
    raise ParentCycleError(
        f"line {line}: the parent links {shown} form a cycle (each session would be its own "
        f"ancestor): refused; its batch ({span}) was rolled back"
    )


def _insert(conn: Connection, table: sa.Table, rows: list[RowDict]) -> None:
    """Bulk insert: ``COPY`` on PostgreSQL (several times faster than batched INSERTs), the
    driver's ``executemany`` of plain tuples on SQLite."""
    if not rows:
        return
    if pgstream.supported(conn):
        pgstream.copy_rows(conn, table, rows)
    elif conn.dialect.name == "sqlite":
        insert = table.insert().compile(dialect=conn.dialect, column_keys=list(rows[0]))
        names = insert.positiontup or []
        values = itemgetter(*names) if len(names) > 1 else lambda row: (row[names[0]],)
        conn.exec_driver_sql(str(insert), list(map(values, rows)))
    else:
        conn.execute(table.insert(), rows)


#: The highest message id SQLite's AUTOINCREMENT has given or seen (its next is one more).
_TOP_MESSAGE_ID = sa.text(
    "SELECT max(COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'messages'), 0), "
    "COALESCE((SELECT max(id) FROM messages), 0))"
)


def _sqlite_insert_messages(
    conn: Connection,
    keep: list[RowDict],
    renumber: list[RowDict],
    while_indexing: Callable[[], object],
) -> None:
    """Insert the messages with the full-text index's insert triggers suspended, then index
    them in bulk (see :meth:`SqliteFullText.bulk_load`) and check both indexes hold exactly
    them; all in the batch's transaction. A taken id gets the next free one, as SQLite's
    AUTOINCREMENT would after the kept ones, so every row's id is known without reading it
    back."""
    if not keep and not renumber:
        return
    if renumber:
        top = max([int(conn.scalar(_TOP_MESSAGE_ID) or 0), *(m["id"] for m in keep)])
        renumber = [{**m, "id": number} for number, m in enumerate(renumber, top + 1)]
    # In id order: an export is newest session first, and FTS5 writes out what it holds in
    # memory as a new segment whenever a rowid comes lower than the last one (a segment per
    # session, then merged over and over); in order, a batch makes a few large segments, and
    # the table's B-tree is appended to rather than split in the middle.
    rows = sorted(keep + renumber, key=_by_id)
    with fulltext.SQLITE.bulk_load(conn) as index:
        _insert(conn, M, rows)
        index.add((m["id"], m["content"]) for m in rows)
        while_indexing()  # the index statements run as the block ends
    problems = fulltext.SQLITE.unindexed(conn, index.rows)
    if problems:
        raise ImportCheckError(
            f"the full-text index disagrees with the batch: {'; '.join(problems)}"
        )


def _by_id(row: RowDict) -> int:
    return int(row["id"])


def _advance_message_sequence(conn: Connection) -> None:
    """Explicit ids bypass PostgreSQL's sequence: move it past them (never backwards)."""
    sequence = conn.scalar(sa.text("SELECT pg_get_serial_sequence('messages', 'id')"))
    if sequence is None:
        return
    last = conn.scalar(sa.text(f"SELECT last_value FROM {sequence}"))  # a quoted name from PG
    top = conn.scalar(select(func.max(M.c.id))) or 0
    conn.execute(
        sa.text("SELECT setval(CAST(:seq AS regclass), :value, true)"),
        {"seq": sequence, "value": max(int(top), int(last or 0))},
    )


#: The longest line an import reads (bytes, its newline left out). One line holds a whole
#: session with all its messages (the store caps a message, not how many a session has), so
#: the cap is far above any real export (a session of a thousand 1 MB tool outputs is 1 GB);
#: it is there so that a file with no newline at all (a disk image, ``/dev/zero``) is refused
#: once this much is read, not read whole into memory.
MAX_LINE_BYTES = 1 << 30
#: What one read of a line takes at most: a line longer than this is read in such pieces, each
#: checked as it comes (every line of a usual export fits in one).
_LINE_CHUNK = 1 << 20
#: A UTF-8 byte order mark, which ``json.loads`` skips (an export saved by a Windows editor).
_BOM = b"\xef\xbb\xbf"


class NotAnExportError(InvalidInputError):
    """The import's input is not a JSON Lines export at all (binary data, a line that is no
    JSON object, a line longer than :data:`MAX_LINE_BYTES`): refused as soon as it shows,
    before its batch is written."""


def read_records(handle: IO[bytes], advance: Callable[[int], None]) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) of each non-blank line; ``advance`` gets the size of each
    piece read (they sum to the bytes read).

    Each line is read in pieces of at most :data:`_LINE_CHUNK` bytes and checked as they come,
    so that misuse fails at once and memory stays bounded by :data:`MAX_LINE_BYTES`: a NUL
    byte (JSON text never holds one raw: binary data), a line that does not start with ``{``
    (every record is a JSON object) and a line over the cap raise :class:`NotAnExportError`.
    """
    number = 0
    while True:
        number += 1
        raw = _read_line(handle, number, advance)
        if raw is None:
            return
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InvalidInputError(f"line {number}: not valid JSON ({error})") from error
        except RecursionError:
            raise InvalidInputError(f"line {number}: JSON nested too deeply to read") from None


def _read_line(
    handle: IO[bytes], number: int, advance: Callable[[int], None]
) -> bytes | bytearray | None:
    """Line ``number`` (with its newline, if any) checked as :func:`read_records` says; None at
    the end of the input."""
    chunk = handle.readline(_LINE_CHUNK)
    if not chunk:
        return None
    advance(len(chunk))
    opened = _check_piece(chunk, number, opened=False)
    if chunk[-1:] == b"\n" or len(chunk) < _LINE_CHUNK:  # the usual line: read whole
        _check_length(len(chunk) - (chunk[-1:] == b"\n"), number)
        return chunk
    line = bytearray(chunk)
    while True:
        _check_length(len(line), number)
        chunk = handle.readline(_LINE_CHUNK)
        if not chunk:
            return line
        advance(len(chunk))
        opened = _check_piece(chunk, number, opened=opened)
        line += chunk
        if chunk[-1:] == b"\n":
            _check_length(len(line) - 1, number)
            return line


def _check_piece(piece: bytes, number: int, *, opened: bool) -> bool:
    """Refuse a NUL byte in this piece of line ``number``, or a line whose first byte that is
    not blank is not ``{``. Returns whether that first byte has been seen (``opened``: in an
    earlier piece of the line)."""
    if b"\0" in piece:
        raise NotAnExportError(
            f"line {number}: holds a NUL byte: not a JSON Lines export (binary data?)"
        )
    if opened or piece[:1] == b"{":
        return True
    start = piece.lstrip()
    if number == 1 and start.startswith(_BOM):
        start = start[len(_BOM) :].lstrip()
    if not start:
        return False  # blank so far
    if start[:1] != b"{":
        raise NotAnExportError(
            f"line {number}: not a JSON Lines export: every line is a JSON object "
            f"({{...}}), this one starts with {start[:1].decode('latin-1')!r}"
        )
    return True


def _check_length(length: int, number: int) -> None:
    if length > MAX_LINE_BYTES:
        raise NotAnExportError(
            f"line {number}: longer than {MAX_LINE_BYTES:,} bytes: not a JSON Lines export "
            "(no export line is this long; is it a file of another kind?)"
        )


def import_sessions(
    db: SessionDB,
    records: Iterable[tuple[int, Any]],
    *,
    batch_size: int = 100,
    max_batch_messages: int = 5000,
    allow_redacted: bool = False,
    report: ImportReport | None = None,
) -> ImportReport:
    """Restore exported sessions into ``db``: ids, timestamps and counters exactly as exported.

    A redacted export (secrets replaced by markers) is refused unless ``allow_redacted``.

    Each batch is validated first, then written as one unit of work and checked before it
    commits. Sessions whose id exists are skipped (with their messages); a message whose id
    is taken gets a new one. Returns the counts; ``report``, when given, is the one filled in
    as each batch commits (what landed when an import is interrupted). Into a SQLite file
    that does not exist yet, :func:`import_new_file` does the same faster.
    """
    total = ImportReport() if report is None else report
    _import(db.uow, records, batch_size, max_batch_messages, allow_redacted, total)
    return total


def import_new_file(
    path: str | os.PathLike[str],
    records: Iterable[tuple[int, Any]],
    *,
    batch_size: int = 100,
    max_batch_messages: int = 5000,
    allow_redacted: bool = False,
    report: ImportReport | None = None,
) -> ImportReport:
    """Restore exported sessions into a new SQLite file at ``path`` (a restore of a whole
    export), as :func:`import_sessions` would into an empty database, about a fifth faster.

    The file is built under a private name beside ``path`` (``.NAME.PID.HEX.import``) with
    its journal in memory and no fsync per batch: nobody else can open it, so neither a WAL
    nor a durable commit per batch buys anything. Once the batches are in (or one failed, or
    the import was interrupted: the batches before it are kept, as by :func:`import_sessions`),
    it is put in WAL mode, flushed to disk and linked under ``path``; ``report`` counts what
    landed there (nothing, when an interrupt came before the link). A crash before the link
    leaves no file at ``path``, only the private one, which the next such import removes.
    :class:`DatabaseTargetError` when ``path`` exists already, or was created while the file
    was built (then left as it was, the built file kept and named).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidInputError(f"path must be a file path, not {echoed(path)}")
    real = Path(path)
    if os.path.lexists(real):
        raise DatabaseTargetError(
            f"{real} exists already: import into it with import_sessions (known ids are skipped)"
        )
    total = ImportReport() if report is None else report
    files.remove_dead_partials(real, (_BUILD_KIND,))
    build = files.partial_path(real, _BUILD_KIND)
    try:
        migrate.ensure_head(to_url(build))  # created owner-only, at head, as any new file
        engine = create_engine(build, private_build=True)
        try:
            uow = UnitOfWork(engine, write_queue=False, group_commit=False)
            try:
                _import(uow, records, batch_size, max_batch_messages, allow_redacted, total)
            finally:
                uow.release()
        finally:
            engine.dispose()
    except BaseException as failure:
        # What committed is whole (a failed batch was rolled back in memory): it lands as an
        # import into an existing file would have left it.
        if not (total.sessions or total.messages):
            _remove_build(build)
            raise
        try:
            _publish(build, real, total)
        except Exception as error:  # the first failure stays the one raised
            log.error("the import's built file %s was not linked as %s: %s", build, real, error)
            failure.add_note(
                f"what committed before it is in {build}, which could not be linked as "
                f"{real}: {one_line(error)}"
            )
        raise
    _publish(build, real, total)
    return total


def _publish(build: Path, real: Path, total: ImportReport) -> None:
    """:func:`_publish_build`; ``total`` is emptied when it raises before the file took its
    name (an interrupt while it is flushed, say): nothing landed under it then."""
    try:
        _publish_build(build, real)
    except BaseException:
        if not _linked(build, real):
            for name in asdict(total):
                setattr(total, name, 0)
        raise


def _linked(build: Path, real: Path) -> bool:
    """Whether the built file took its name (it is gone from its private one once it has)."""
    try:
        return os.path.samefile(build, real) if os.path.lexists(build) else real.exists()
    except OSError:
        return False


#: The private file an import into a new file builds: ``.NAME.PID.HEX.import``.
_BUILD_KIND = "import"


def _publish_build(build: Path, real: Path) -> None:
    """Put the built file in WAL mode (as the store keeps every file), flush it to disk and
    link it under ``real``: whole or not at all. The link fails if ``real`` appeared meanwhile
    (another process created the database): then nothing is changed and the built file is
    kept, named in the error."""
    connection = files.connect_sqlite(build)
    try:
        with mapped_driver_errors(dbapi_error=sqlite3.Error):
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    finally:
        connection.close()  # the last connection: its WAL is checkpointed and removed
    if str(mode).lower() != "wal":
        raise StoreConfigError(f"{build} refused WAL mode (journal_mode={mode})")
    for sidecar in files.sidecars(build):
        sidecar.unlink()
    files.fsync_path(build)
    try:
        os.link(build, real)
    except FileExistsError:
        raise DatabaseTargetError(
            f"{real} was created by another process while the import built it: it was left "
            f"as it was; the imported sessions are in {build} (import the export into {real} "
            "again, known ids are skipped, then remove that file)"
        ) from None
    build.unlink()
    files.fsync_path(real.parent)


def _remove_build(build: Path) -> None:
    for leftover in (build, *files.sidecars(build)):
        leftover.unlink(missing_ok=True)


def _import(
    uow: UnitOfWork,
    records: Iterable[tuple[int, Any]],
    batch_size: int,
    max_batch_messages: int,
    allow_redacted: bool,
    total: ImportReport,
) -> None:
    """The batches validated and written into ``uow``'s database, ``total`` counting what
    committed."""
    batches = _batches(
        records,
        batch_size,
        max_batch_messages,
        nul_ok=uow.is_sqlite,
        allow_redacted=allow_redacted,
    )
    if not uow.is_sqlite:
        _write_batches(uow, batches, total)
        return
    # FTS5's automerge off while the batches go in, then one merge of what they added: every
    # 64 leaf pages written, automerge re-merges a few segments (the same text over and over,
    # a fifth of a large import's CPU time); the settings go back after, as after a paced job.
    merging = maintenance.paced_index_merging(uow)
    tables = merging.__enter__()
    try:
        _write_batches(uow, batches, total)
        if tables and total.messages:
            maintenance.merge_index(uow, full=False, step_seconds=_MERGE_STEP_SECONDS, pause=0)
    except BaseException as raised:
        failure = _settled_failure(raised)
        try:  # the settings go back; the first failure stays the one raised
            merging.__exit__(type(failure), failure, failure.__traceback__)
        except Exception as error:
            log.warning("the import could not put FTS5's merge settings back: %s", error)
        if failure is raised:
            raise
        raise failure from None
    merging.__exit__(None, None, None)


def _settled_failure(raised: BaseException) -> BaseException:
    """What an import that stopped raises: an interrupt (Ctrl-C) rather than what the unit's
    unwinding met after it (a connection it had cut, ``PendingRollbackError``), with the
    frames it ran through released, so that the statement it cut is finalized and its
    connection's lock let go before anything else writes (the settings put back, the built
    file switched to WAL). A cut connection closed while a statement of it lived on stayed
    open underneath, holding the database locked for as long as the traceback lived."""
    interrupts = [error for error in _chain(raised) if not isinstance(error, Exception)]
    if not interrupts:
        return raised
    for error in _chain(raised):
        traceback.clear_frames(error.__traceback__)
    gc.collect()
    return interrupts[-1]


def _chain(raised: BaseException) -> Iterator[BaseException]:
    """``raised`` and the exceptions it was raised while handling, once each."""
    seen: set[int] = set()
    error: BaseException | None = raised
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__context__


#: The longest write unit of the merge after an import: about what one of its batches holds
#: the lock for. In 100 ms steps the merge of 30,000 realistic messages took 78 commits (an
#: fsync each, and a checkpoint): 5 s on the clock for 1 s of CPU on a busy machine.
_MERGE_STEP_SECONDS = 1.0


def _write_batches(
    uow: UnitOfWork, batches: Iterator[list[_Prepared]], total: ImportReport
) -> None:
    """Write each batch as one unit; ``total`` counts what committed, batch by batch. On
    SQLite the next batch is read while this one is indexed (see :class:`_ReadAhead`)."""
    pending: dict[str, str] = {}
    restoring: set[str] = set()  # children of ``pending`` already in the target
    reader = _ReadAhead(batches) if uow.is_sqlite else None
    read_next = reader.read_next if reader is not None else lambda: None
    with closing(reader) if reader is not None else nullcontext():
        for batch in reader if reader is not None else batches:
            links = dict(pending)
            restored_before = frozenset(restoring)
            try:
                outcome = uow.run(
                    lambda conn: _write_batch(
                        conn,
                        batch,  # noqa: B023
                        links,  # noqa: B023
                        read_next,
                        restored_before,  # noqa: B023
                    )
                )
            except ParentCycleError as error:
                kept = (
                    f"the {total.sessions} session(s) of the batches before it stay imported"
                    if total.sessions
                    else "nothing was imported"
                )
                raise ParentCycleError(f"{error}; {kept}") from None
            restoring |= outcome.restoring
            for child in outcome.linked:
                pending.pop(child, None)
                restoring.discard(child)
            pending.update({c: p for c, p in outcome.new_links.items() if c not in outcome.linked})
            for name, value in asdict(outcome.report).items():
                setattr(total, name, getattr(total, name) + value)
    total.parents_missing = len(pending)


class _ReadAhead:
    """The batches, each read and validated in a thread of its own while SQLite indexes the
    one before it.

    The index is filled by one statement per batch (see ``SqliteFullText.bulk_load``), during
    which the driver releases the GIL: the reading (Python: JSON decoding and validation, a
    fifth of the import) runs on another core meanwhile. It runs only then, asked by
    :meth:`read_next`: beside the row inserts (one GIL hand-over per row) a thread of Python
    would make each row wait for the GIL (up to the 5 ms switch interval). One batch is read
    ahead at most; an invalid record is raised when its batch is taken, after the batches
    before it committed."""

    def __init__(self, batches: Iterator[list[_Prepared]]) -> None:
        self._batches = batches
        # A queue in C, not a Semaphore: a signal's exception (Ctrl-C, SIGTERM) raised in the
        # importing thread midway through a Semaphore's Python code could leave the reader
        # waiting for a go-ahead it never got.
        self._asked: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[tuple[list[_Prepared] | None, BaseException | None]] = (
            queue.SimpleQueue()
        )
        self._reading = False  # asked for the next batch and not taken yet
        self._closed = False
        self._thread = threading.Thread(
            target=self._read, name="hermes-store-import-reader", daemon=True
        )
        self._thread.start()

    def _read(self) -> None:
        while True:
            if not self._asked.get() or self._closed:
                return
            try:
                batch = next(self._batches)
            except StopIteration:
                self._ready.put((None, None))
                return
            except BaseException as error:  # handed to the importing thread
                self._ready.put((None, error))
                return
            self._ready.put((batch, None))

    def read_next(self) -> None:
        """Start reading the next batch (once: a unit run again after a lock does not ask
        for a second one)."""
        if not self._reading:
            self._reading = True
            self._asked.put(True)

    def __iter__(self) -> Iterator[list[_Prepared]]:
        while True:
            self.read_next()
            batch, error = self._ready.get()
            self._reading = False
            if error is not None:
                raise error
            if batch is None:
                return
            yield batch

    def close(self) -> None:
        """Stop the thread once it is done with the batch it reads (if any), waiting for it
        at most :data:`_READER_STOP_S`: an import stopped by a signal returns, and never waits
        for good on a reader its interrupt left stuck (a daemon, gone with the process)."""
        self._closed = True
        self._asked.put(False)
        self._thread.join(_READER_STOP_S)
        if self._thread.is_alive():
            log.info("the import's reader thread did not stop; leaving it (a daemon)")


#: How long an import that stopped waits for its reader thread to finish the batch it reads.
_READER_STOP_S = 10.0


def _batches(
    records: Iterable[tuple[int, Any]],
    batch_size: int,
    max_batch_messages: int,
    *,
    nul_ok: bool,
    allow_redacted: bool,
) -> Iterator[list[_Prepared]]:
    """The records validated, in batches of ``batch_size`` sessions or ``max_batch_messages``
    messages (whichever comes first); an invalid record raises once the batches before it
    have been taken."""
    batch: list[_Prepared] = []
    batch_messages = 0
    for line, record in records:
        prepared = _prepare(record, line, nul_ok=nul_ok, allow_redacted=allow_redacted)
        batch.append(prepared)
        batch_messages += len(prepared.messages)
        if len(batch) >= batch_size or batch_messages >= max_batch_messages:
            yield batch
            batch, batch_messages = [], 0
    if batch:
        yield batch


def _page_name(record: RowDict, written: set[str]) -> str:
    """The file name of ``record``'s page, never one a page of this export already took
    (``written``, their names as a case-insensitive, normalising file system sees them; the
    name is added). A file of the folder from an earlier export is replaced by the page of the
    same session, as the name says (see ``markdown.file_name``)."""
    from hermes_store import markdown

    name = markdown.file_name(record)
    if _name_key(name) in written:  # the short digests of two ids met: take the whole one
        name = markdown.file_name(record, digest=markdown.FULL_DIGEST)
        if _name_key(name) in written:
            raise InvalidInputError(
                f"session {echoed(record['id'])} would be written over another session's page "
                f"({name}): refused"
            )
    written.add(_name_key(name))
    return name


def _name_key(name: str) -> str:
    return unicodedata.normalize("NFC", name).casefold()


@dataclass
class ExportReport:
    """What :func:`write_records` wrote, and what :func:`export_records` left out."""

    sessions: int = 0
    messages: int = 0
    #: values not of their column's type (or numbers outside what the store takes) written
    #: as marked objects, which an import restores (JSON Lines only)
    values_marked: int = 0
    #: messages whose session no longer exists: left out, no import could restore them
    orphan_messages: int = 0
    #: sessions stored with no id: left out, no import could restore them
    sessions_without_id: int = 0


def write_records(
    records: Iterable[ExportRecord],
    output: str,
    database: URL,
    *,
    fmt: str = "jsonl",
    split: bool = False,
    redacted: bool = False,
    on_record: Callable[[], None] | None = None,
    report: ExportReport | None = None,
) -> ExportReport:
    """Write exported records (:func:`export_records`) to ``output``, as :func:`export_writer`
    writes a file (``-``: stdout).

    ``fmt`` is ``"jsonl"`` (one session per line, for import) or ``"md"`` (Markdown, for
    reading); ``split`` writes one Markdown file per session into the folder ``output`` (made
    owner-only: the file names carry titles). ``redacted`` masks API keys, tokens, passwords
    and private keys first. ``on_record()`` is called as each record is taken (progress).
    ``report``, when given, is the one filled in (the one :func:`export_records` took).
    """
    from hermes_store import markdown
    from hermes_store.engine.factory import make_private_dirs

    if fmt not in ("jsonl", "md"):
        raise InvalidInputError(f"fmt must be 'jsonl' or 'md', not {echoed(fmt)}")
    if split and (fmt != "md" or output == "-"):
        raise InvalidInputError("split writes Markdown files (fmt='md') into a folder")
    report = ExportReport() if report is None else report
    chosen: Iterator[RowDict] = (dict(record) for record in records)
    if redacted:
        chosen = map(redact.redact_record, chosen)

    def counted(items: Iterable[RowDict]) -> Iterator[RowDict]:
        for record in items:
            report.sessions += 1
            report.messages += len(record["messages"])
            if on_record is not None:
                on_record()
            yield record

    if split:
        folder = Path(output)
        make_private_dirs(folder)  # 0700 whatever the umask
        written: set[str] = set()
        for record in counted(chosen):
            page = str(folder / _page_name(record, written))
            with export_writer(page, database, stream=False) as handle:
                handle.write(markdown.render_session(record))
    elif fmt == "md":
        with export_writer(output, database) as handle:
            for chunk in markdown.render_document(counted(chosen), redacted=redacted):
                handle.write(chunk)
    else:

        def marked(items: Iterable[RowDict]) -> Iterator[RowDict]:
            for record in items:
                written, count = mark_stored_values(record)
                report.values_marked += count
                yield written

        with export_writer(output, database) as handle:
            for _ in write_export(handle, marked(counted(chosen))):
                pass
    return report
