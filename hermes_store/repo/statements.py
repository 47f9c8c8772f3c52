"""What a ``SessionDB`` runs for the writes that differ per backend, one object per backend.

``SessionDB`` looks its backend's object up once when it opens
(:func:`hermes_store.repo.dialects.for_dialect`) and hands every such write to it; no unit
asks for the dialect again. :class:`Statements` holds what every backend runs alike: each
write as one unit over SQLAlchemy Core on the unit's connection (PostgreSQL inside a
``transaction()`` block runs exactly these). :mod:`hermes_store.repo.sqlite` runs the hot
writes as statements compiled once, on the driver's cursor; :mod:`hermes_store.repo.postgresql`
sends each write outside a block as one statement (one round trip), grouped with the others in
flight. The statements themselves are built once (SQLAlchemy caches their compiled form; the
write lock is held while one compiles).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import sqlalchemy as sa
from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql.dml import Insert

from hermes_store.echo import echoed
from hermes_store.errors import InvalidInputError, TitleInUseError, UnknownSessionError
from hermes_store.repo import listing
from hermes_store.repo.messages import fetch_messages
from hermes_store.rows import ExportRecord
from hermes_store.tables import Counter
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.tables import write_keys_table as K
from hermes_store.uow.unit import UnitOfWork

#: The token counters of a session, in ``update_token_counts``' order.
COUNTERS = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
)
#: The 64-bit range of the counters (SQLite's INTEGER, PostgreSQL's BIGINT).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: The columns ``create_session`` writes.
CREATE_COLUMNS = frozenset(
    {
        "id",
        "source",
        "user_id",
        "model",
        "model_config",
        "system_prompt",
        "parent_session_id",
        "started_at",
    }
)

INSERT_MESSAGE = M.insert().returning(M.c.id)
#: Count the messages (``:messages``) and tool calls (``:tool_calls``) of session ``:sid``.
BUMP_COUNTERS = (
    update(S)
    .where(S.c.id == sa.bindparam("sid"))
    .values(
        message_count=S.c.message_count + sa.bindparam("messages", type_=Counter),
        tool_call_count=S.c.tool_call_count + sa.bindparam("tool_calls", type_=Counter),
    )
)


@functools.cache
def token_statement(absolute: bool, guards: tuple[int, ...] = (), priced: bool = True) -> sa.Update:
    """The one atomic UPDATE of ``update_token_counts`` for a mode, every value bound: None
    leaves ``actual_cost_usd`` and the overwrite-only fields as they are (``COALESCE``) and the
    fill-once fields keep their first value. Built once per shape: constructing it per call
    cost 25x the SQL, and the write lock is held while it compiles.

    ``priced=False`` (SQLite's usual call: tokens only): the costs and texts are all None, so
    the statement says NULL in their place instead of binding them; the same expressions, the
    same effect. sqlite3 binds a None through its adapter protocol (a failed ``__conform__``
    look-up, ~3k instructions each): ten of them were a quarter of a token update's CPU.

    ``guards`` (SQLite's additions; see :func:`token_guards`): per counter of :data:`COUNTERS`,
    1 when its increment is positive, -1 when negative, 0 when zero. A nonzero increment adds
    the condition that the sum stays within 64 bits, as a bound computed from the increment
    (``coalesce(counter, 0) + 0 <= :p_bound_counter``, or ``>=`` for a negative one; ``+ 0``
    compares the number SQLite's addition reads from the counter, a TEXT one too): SQLite would
    silently turn an overflowing integer sum into a REAL. A row the bounds exclude is left
    unchanged, and the caller tells an overflow from an unknown session
    (:func:`counter_overflow`). PostgreSQL passes no guards: its BIGINT addition fails with
    ``bigint out of range`` by itself."""
    zero: sa.ColumnElement[Any] = sa.literal_column("0")  # inline: binds only the call's values

    def price(name: str, type_: type[sa.types.TypeEngine[Any]]) -> sa.ColumnElement[Any]:
        return sa.bindparam(name, type_=type_) if priced else sa.null()

    est = sa.cast(price("p_est", sa.Float), sa.Float)
    act = sa.cast(price("p_act", sa.Float), sa.Float)
    values: dict[str, Any] = {}
    for name in COUNTERS:
        given = sa.bindparam(f"p_{name}", type_=Counter)
        current = func.coalesce(S.c[name], zero)
        values[name] = given if absolute else current + given
    if absolute:
        values["estimated_cost_usd"] = func.coalesce(est, zero)
        values["actual_cost_usd"] = func.coalesce(act, S.c.actual_cost_usd)
    else:
        values["estimated_cost_usd"] = func.coalesce(S.c.estimated_cost_usd, zero) + func.coalesce(
            est, zero
        )
        values["actual_cost_usd"] = sa.case(
            (act.is_(None), S.c.actual_cost_usd),
            else_=func.coalesce(S.c.actual_cost_usd, zero) + act,
        )
    for name in ("cost_status", "cost_source", "pricing_version"):  # overwritten by non-None
        values[name] = func.coalesce(price(f"p_{name}", sa.Text), S.c[name])
    for name in ("billing_provider", "billing_base_url", "billing_mode", "model"):  # first wins
        values[name] = func.coalesce(S.c[name], price(f"p_{name}", sa.Text))
    statement = update(S).where(S.c.id == sa.bindparam("p_sid")).values(values)
    for name, sign in zip(COUNTERS, guards or (0,) * len(COUNTERS), strict=True):
        if sign and not absolute:
            bound = sa.bindparam(f"p_bound_{name}", type_=Counter)
            # ``+ 0``: the number the sum adds to. coalesce() carries no affinity, so a counter
            # another program left as TEXT ('', 'abc') would compare above every integer.
            number = func.coalesce(S.c[name], zero) + zero
            statement = statement.where(number <= bound if sign > 0 else number >= bound)
    return statement


def token_guards(counts: Sequence[int]) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    """The guards of :func:`token_statement` for ``counts`` (by :data:`COUNTERS` order) and
    each counter's bound: the largest (smallest, for a negative increment) value the counter
    may hold for the sum to stay within 64 bits; None for an increment of zero (no guard:
    adding 0 never overflows, whatever the column holds)."""
    signs: list[int] = []
    bounds: list[int | None] = []
    for count in counts:
        if count > 0:
            signs.append(1)
            bounds.append(INT64_MAX - count)
        elif count < 0:
            signs.append(-1)
            bounds.append(INT64_MIN - count)
        else:
            signs.append(0)
            bounds.append(None)
    return tuple(signs), tuple(bounds)


def counter_overflow() -> InvalidInputError:
    """What a guarded token update that changed no row of an existing session raises: a
    counter would have left 64 bits (nothing was written). No row and no session: the session
    is unknown, a no-op as in the original store."""
    return InvalidInputError("a counter would overflow a 64-bit integer; nothing was written")


#: The overwrite-only and fill-once text fields of ``update_token_counts``, in its order of the
#: values the store hands over (``cost_status`` ... ``model``).
TOKEN_TEXTS = (
    "cost_status",
    "cost_source",
    "pricing_version",
    "billing_provider",
    "billing_base_url",
    "billing_mode",
    "model",
)


def token_params(
    session_id: str,
    counts: Sequence[int],
    texts: Sequence[str | None],
    estimated_cost_usd: float | None,
    actual_cost_usd: float | None,
) -> dict[str, Any]:
    """The values :func:`token_statement` (without guards) binds: ``counts`` in
    :data:`COUNTERS` order, ``texts`` in :data:`TOKEN_TEXTS` order."""
    params: dict[str, Any] = {}
    for name, value in zip(COUNTERS, counts, strict=True):
        params[f"p_{name}"] = value
    for name, text in zip(TOKEN_TEXTS, texts, strict=True):
        params[f"p_{name}"] = text
    params.update(p_sid=session_id, p_est=estimated_cost_usd, p_act=actual_cost_usd)
    return params


def bump_params(session_id: str, messages: int, tool_calls: int) -> dict[str, Any]:
    """The values :data:`BUMP_COUNTERS` binds."""
    return {"sid": session_id, "messages": messages, "tool_calls": tool_calls}


@dataclass(frozen=True)
class WriteKey:
    """A write's idempotency key as recorded beside it: the key, the session written and
    when (the store's clock; retention expires old keys)."""

    key: str
    session_id: str
    created_at: float

    def row(self, message_id: int | None) -> dict[str, Any]:
        """The ``write_keys`` row of this key for the write's ``message_id`` (None: tokens)."""
        return {
            "key": self.key,
            "session_id": self.session_id,
            "message_id": message_id,
            "created_at": self.created_at,
        }


#: The session and message of a recorded key.
KEY_LOOKUP = select(K.c.session_id, K.c.message_id).where(K.c.key == sa.bindparam("key"))


def recorded_write(session_id: str, message_id: int | None) -> str:
    """What a recorded key names, for an error: its kind and its session."""
    if message_id is None:
        return f"a token update of session {echoed(session_id)}"
    return f"an append to session {echoed(session_id)} (message {message_id})"


def reused_key(key: WriteKey, recorded: str, attempted: str) -> InvalidInputError:
    """The refusal of a key that names another write: both writes, kind and session."""
    return InvalidInputError(
        f"idempotency_key {echoed(key.key)} was already used for {recorded}, not for "
        f"{attempted}: a key names one write"
    )


def known_message(key: WriteKey, session_id: str, message_id: int | None) -> int:
    """The message id a re-sent append returns: the one its key recorded. The same write is
    the same key, session and kind; the message's content is not compared (a re-send repeats
    the call). A key recorded for another session's write, or for a token update, names
    another write: refused."""
    if session_id != key.session_id or message_id is None:
        attempted = f"an append to session {echoed(key.session_id)}"
        raise reused_key(key, recorded_write(session_id, message_id), attempted)
    return int(message_id)


def known_tokens(key: WriteKey, session_id: str, message_id: int | None) -> None:
    """A re-sent token increment (its key found recorded): adds nothing, it landed already.
    As for appends, the same write is the same key, session and kind; the counts are not
    compared. A key recorded for an append, or for another session's token update, names
    another write: refused, never a silent no-op."""
    if session_id != key.session_id or message_id is not None:
        attempted = f"a token update of session {echoed(key.session_id)}"
        raise reused_key(key, recorded_write(session_id, message_id), attempted)


def exists(conn: Connection, session_id: str) -> bool:
    return conn.execute(select(S.c.id).where(S.c.id == session_id)).first() is not None


#: The unique index of the titles (the original store's name, kept by every revision).
TITLE_INDEX = "idx_sessions_title_unique"


def title_holder(session_id: str, title: str | None) -> sa.Select[Any]:
    """The id of another session holding ``title``, if any."""
    return select(S.c.id).where(S.c.title == title, S.c.id != session_id).limit(1)


def missing_parent(parent_session_id: str) -> UnknownSessionError:
    return UnknownSessionError(f"parent session {echoed(parent_session_id)} does not exist")


def missing_session(session_id: str) -> UnknownSessionError:
    return UnknownSessionError(f"session {echoed(session_id)} does not exist")


class Statements(abc.ABC):
    """One backend's writes, and the reads whose path differs per backend. The base runs each
    write as one unit of Core statements on the unit's connection; subclasses say how their
    backend's hot writes reach the database."""

    #: Whether the backend's text columns may hold a NUL character (PostgreSQL's cannot).
    holds_nul: ClassVar[bool]
    #: Whether another transaction can record a key between this unit's look-up and its
    #: insert (PostgreSQL; SQLite's write lock excludes it): a keyed append inside a block
    #: then writes in a savepoint, and a key taken meanwhile answers with its message.
    keys_race: ClassVar[bool] = False
    #: ``INSERT`` of a session row that leaves an existing id as it is (first write wins),
    #: in the backend's own ``ON CONFLICT DO NOTHING``.
    insert_session: ClassVar[Insert]

    # -- sessions ---------------------------------------------------------------------------

    def create_session(self, uow: UnitOfWork, values: dict[str, Any]) -> None:
        """Insert the session unless its id exists; a parent must exist."""
        parent = values["parent_session_id"]
        insert = self.insert_session

        def unit(conn: Connection) -> None:
            if parent is not None and not exists(conn, parent):
                raise missing_parent(parent)
            conn.execute(insert, values)

        uow.run(unit)

    def ensure_session(self, uow: UnitOfWork, values: dict[str, Any]) -> None:
        insert = self.insert_session
        uow.run_statement(lambda conn: conn.execute(insert, values), idempotent=True)

    @staticmethod
    @abc.abstractmethod
    def title_taken(error: sa.exc.DBAPIError) -> bool:
        """Whether a refused title UPDATE met the unique title index (another session holds
        the title), not another constraint or a trigger: those are the database's own
        refusals."""

    def set_title(self, uow: UnitOfWork, session_id: str, title: str | None) -> bool:
        """Set (None: clear) the title; False when the session does not exist. A title held by
        another session raises :class:`TitleInUseError` naming it."""

        def unit(conn: Connection) -> bool:
            if not exists(conn, session_id):
                return False
            if title is not None:
                holder = conn.scalar(title_holder(session_id, title))
                if holder is not None:
                    raise TitleInUseError(f"Title '{title}' is already in use by session {holder}")
            try:
                with conn.begin_nested():
                    conn.execute(update(S).where(S.c.id == session_id).values(title=title))
            except sa.exc.IntegrityError as error:
                if not self.title_taken(error):  # another constraint or a trigger: mapped as such
                    raise
                # A concurrent writer took it (PostgreSQL).
                raise TitleInUseError(f"Title '{title}' is already in use") from error
            return True

        return uow.run(unit)

    # -- listing ----------------------------------------------------------------------------

    def list_sessions_rich(
        self,
        conn: Connection,
        *,
        source: str | None,
        exclude_sources: Sequence[str] | None,
        limit: int,
        offset: int,
        include_children: bool,
        project_compression_tips: bool,
    ) -> list[dict[str, Any]]:
        """Sessions with ``preview`` and ``last_active``, newest first (see
        :func:`hermes_store.repo.listing.list_sessions_rich`)."""
        return listing.list_sessions_rich(
            conn,
            source=source,
            exclude_sources=exclude_sources,
            limit=limit,
            offset=offset,
            include_children=include_children,
            project_compression_tips=project_compression_tips,
        )

    # -- tokens -----------------------------------------------------------------------------

    @abc.abstractmethod
    def update_token_counts(
        self,
        uow: UnitOfWork,
        session_id: str,
        counts: tuple[int, ...],
        texts: tuple[str | None, ...],
        costs: tuple[float | None, float | None],
        absolute: bool,
        key: WriteKey | None = None,
    ) -> None:
        """Run :func:`token_statement`: ``counts`` in :data:`COUNTERS` order, ``texts`` in
        :data:`TOKEN_TEXTS` order, ``costs`` (estimated, actual), all validated; an increment
        with ``key`` lands once per key: a key already recorded for a token update of this
        session adds nothing, one recorded for anything else raises (:func:`known_tokens`)."""

    # -- messages ---------------------------------------------------------------------------

    def append_message(
        self,
        uow: UnitOfWork,
        values: dict[str, Any],
        tool_calls: int,
        key: WriteKey | None = None,
    ) -> int:
        """Insert one message (``values``: its columns) and count it (and its ``tool_calls``)
        on its session, in one unit; the message's id. With ``key``: a key already recorded
        returns its message's id and writes nothing; else the key is recorded in the unit."""
        session_id = values["session_id"]
        bump = bump_params(session_id, 1, tool_calls)

        def write(conn: Connection) -> int:
            if conn.execute(BUMP_COUNTERS, bump).rowcount != 1:
                raise missing_session(session_id)
            message_id = int(conn.execute(INSERT_MESSAGE, values).scalar_one())
            if key is not None:
                conn.execute(K.insert(), key.row(message_id))
            return message_id

        def unit(conn: Connection) -> int:
            if key is None:
                return write(conn)
            known = conn.execute(KEY_LOOKUP, {"key": key.key}).first()
            if known is not None:
                return known_message(key, known.session_id, known.message_id)
            if not self.keys_race:
                return write(conn)
            try:  # another transaction may record the same key meanwhile
                with conn.begin_nested():
                    return write(conn)
            except sa.exc.IntegrityError:
                known = conn.execute(KEY_LOOKUP, {"key": key.key}).first()
                if known is None:
                    raise
                return known_message(key, known.session_id, known.message_id)

        return uow.run(unit)

    def append_messages(
        self,
        uow: UnitOfWork,
        session_id: str,
        rows: list[dict[str, Any]],
        tool_calls: int,
    ) -> list[int]:
        """Insert ``rows`` (each a message's columns) and count them on the session, all in one
        unit; their ids, in order."""
        bump = bump_params(session_id, len(rows), tool_calls)
        statement = M.insert().returning(M.c.id, sort_by_parameter_order=True)

        def unit(conn: Connection) -> list[int]:
            if conn.execute(BUMP_COUNTERS, bump).rowcount != 1:
                raise missing_session(session_id)
            return list(conn.scalars(statement, rows))

        return uow.run(unit)

    # -- export -----------------------------------------------------------------------------

    def iter_export(
        self, uow: UnitOfWork, source: str | None, page_size: int
    ) -> Iterator[ExportRecord]:
        """Every session (or ``source``'s), newest first, each with its messages: pages of
        ``page_size`` sessions, each page read in one read unit (a consistent snapshot of the
        page); closing the generator early releases it."""
        order = (S.c.started_at.desc(), S.c.id.desc())
        last: tuple[float, str] | None = None
        while True:
            statement = select(S).order_by(*order).limit(page_size)
            if source is not None:
                statement = statement.where(S.c.source == source)
            if last is not None:
                statement = statement.where(
                    or_(S.c.started_at < last[0], and_(S.c.started_at == last[0], S.c.id < last[1]))
                )
            # One read unit per page: a round trip per session, not a transaction per session.
            with uow.reading() as conn:
                page = [dict(row._mapping) for row in conn.execute(statement)]
                for session in page:
                    yield cast(
                        ExportRecord, {**session, "messages": fetch_messages(conn, session["id"])}
                    )
            if len(page) < page_size:
                return
            last = (page[-1]["started_at"], page[-1]["id"])
