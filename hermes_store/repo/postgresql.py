"""PostgreSQL's writes: outside a ``transaction()`` block each is ONE statement on the
autocommit pool (no BEGIN, no COMMIT: one round trip), and the hot ones (``append_message``,
``update_token_counts``) carry a group spec, so while another write of this process is in
flight they share its next transaction (:mod:`hermes_store.uow.pggroup`). Inside a block they
are the generic units of :class:`~hermes_store.repo.statements.Statements`."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.sql import Select
from sqlalchemy.sql.dml import Insert

from hermes_store.errors import HermesStoreError, TitleInUseError, WriteRefusedError
from hermes_store.repo import listing, pgstream
from hermes_store.repo.statements import (
    CREATE_COLUMNS,
    TITLE_INDEX,
    Statements,
    WriteKey,
    known_message,
    known_tokens,
    missing_parent,
    missing_session,
    title_holder,
    token_params,
    token_statement,
)
from hermes_store.rows import ExportRecord
from hermes_store.tables import Counter, Real
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.tables import write_keys_table as K
from hermes_store.uow import pggroup
from hermes_store.uow.unit import UnitOfWork

FOREIGN_KEY_VIOLATION = "23503"
UNIQUE_VIOLATION = "23505"
#: A keyed append whose key another call recorded concurrently is run again this often: each
#: rerun sees the key the winner committed, so one is enough unless keys are being deleted.
KEY_RACE_ATTEMPTS = 5


def sqlstate(error: sa.exc.DBAPIError) -> str | None:
    return getattr(error.orig, "sqlstate", None)


def key_taken(error: sa.exc.DBAPIError) -> bool:
    """Whether a unique violation was the write keys' (a concurrent same-key write), not
    another table's unique index."""
    diag = getattr(error.orig, "diag", None)
    return diag is not None and diag.table_name == K.name


def refused(error: WriteRefusedError) -> sa.exc.DBAPIError:
    """The driver error a refused write (a constraint's, or a trigger's) was named from: the
    writes that meet the store's own constraints tell them apart by it."""
    cause = error.__cause__
    if not isinstance(cause, sa.exc.DBAPIError):
        raise error
    return cause


@functools.cache
def append_statement() -> Select[Any]:
    """``append_message`` as one statement: insert the message, bump the session's counters.
    The INSERT is what the query reads, so it runs first; the UPDATE (a side CTE) runs last,
    so the session row is locked for the shortest time, and the lock ends with the statement's
    own commit. A missing session fails the foreign key."""
    columns = {c.name: sa.bindparam(c.name, type_=c.type) for c in M.columns if c.name != "id"}
    inserted = M.insert().values(columns).returning(M.c.id).cte("inserted")
    bumped = (
        update(S)
        .where(S.c.id == sa.bindparam("session_id"))
        .values(
            message_count=S.c.message_count + sa.bindparam("bump_messages", type_=Counter),
            tool_call_count=S.c.tool_call_count + sa.bindparam("bump_tool_calls", type_=Counter),
        )
        .cte("bumped")
    )
    return select(inserted.c.id).add_cte(bumped)


@functools.cache
def keyed_append_statement() -> sa.CompoundSelect[Any]:
    """``append_message`` with an idempotency key as one statement: the message is inserted
    only when the key is not recorded yet, the key is recorded with its id and the session's
    counters are bumped; the rows read are the new message's or, for a key already recorded,
    the recorded one (id, session). All of it sees one snapshot: a concurrent same-key append
    that commits first makes this statement's key insert fail its primary key, which rolls the
    whole statement back (the caller runs it again and finds the key)."""
    key = sa.bindparam("write_key", type_=sa.Text)
    names = [c.name for c in M.columns if c.name != "id"]
    # Cast: a bare parameter in a SELECT list has no type of its own (NULL would be text).
    row = select(*(sa.cast(sa.bindparam(n, type_=M.c[n].type), M.c[n].type) for n in names))
    unknown_key = ~sa.exists().where(K.c.key == key)
    inserted = (
        M.insert().from_select(names, row.where(unknown_key)).returning(M.c.id).cte("inserted")
    )
    record = select(
        key,
        sa.cast(sa.bindparam("session_id", type_=sa.Text), sa.Text),
        inserted.c.id,
        sa.cast(sa.bindparam("key_created_at", type_=Real), Real),
    )
    claimed = (
        K.insert()
        .from_select(["key", "session_id", "message_id", "created_at"], record)
        .cte("claimed")
    )
    bumped = (
        update(S)
        .where(S.c.id == sa.bindparam("session_id"), sa.exists(select(inserted.c.id)))
        .values(
            message_count=S.c.message_count + sa.bindparam("bump_messages", type_=Counter),
            tool_call_count=S.c.tool_call_count + sa.bindparam("bump_tool_calls", type_=Counter),
        )
        .cte("bumped")
    )
    fresh = select(
        inserted.c.id.label("message_id"),
        sa.cast(sa.bindparam("session_id", type_=sa.Text), sa.Text).label("session_id"),
    )
    known = select(K.c.message_id, K.c.session_id).where(K.c.key == key)
    return sa.union_all(fresh, known).add_cte(claimed).add_cte(bumped)


def keyed_message(cursor: Any) -> tuple[int | None, str] | None:
    """The (message id, session id) row :func:`keyed_append_statement` returns, if any."""
    found = cursor.fetchone()
    return (found[0], found[1]) if found is not None else None


@functools.cache
def keyed_tokens_statement() -> Select[Any]:
    """An incrementing ``update_token_counts`` with an idempotency key as one statement: the
    key is recorded (when the session exists) unless it already is, and the counters move only
    when it was recorded now. A concurrent same-key call waits on the key's unique index
    entry, then finds it taken and adds nothing: once, whatever the interleaving.

    Its one row says what happened, so a taken key is told apart from a re-send in the same
    round trip: ``claimed`` (recorded now), the recorded key's ``session_id`` and
    ``message_id`` as the statement's snapshot holds them (NULL: not there), and whether the
    session exists. A key taken by a transaction that committed after the snapshot is in
    neither: :func:`keyed_tokens_outcome` says to run it again."""
    key = sa.bindparam("write_key", type_=sa.Text)
    session_found = sa.exists().where(S.c.id == sa.bindparam("p_sid"))
    record = select(
        key,
        sa.cast(sa.bindparam("p_sid", type_=sa.Text), sa.Text),
        sa.null(),
        sa.cast(sa.bindparam("key_created_at", type_=Real), Real),
    ).where(session_found)
    claimed = (
        postgresql.insert(K)
        .from_select(["key", "session_id", "message_id", "created_at"], record)
        .on_conflict_do_nothing(index_elements=["key"])
        .returning(K.c.key)
        .cte("claimed")
    )
    added = token_statement(False).where(sa.exists(select(claimed.c.key))).cte("added")
    # One row whatever the key table holds: the key's row joined to a single row.
    one = select(sa.literal_column("1").label("one")).subquery("one")
    recorded = K.alias("recorded")
    return (
        select(
            sa.exists(select(claimed.c.key)).label("claimed"),
            recorded.c.session_id,
            recorded.c.message_id,
            session_found.label("session_found"),
        )
        .select_from(one.outerjoin(recorded, recorded.c.key == key))
        .add_cte(claimed)
        .add_cte(added)
    )


#: What :func:`keyed_tokens_statement`'s row reads as: (claimed, the recorded key's session id
#: and message id, whether the session exists).
KeyedTokens = tuple[bool, str | None, int | None, bool]


def keyed_tokens_row(cursor: Any) -> KeyedTokens:
    """The row of :func:`keyed_tokens_statement`, read from a cursor (the driver's, when
    grouped) or a result."""
    row = cursor.fetchone()
    return (bool(row[0]), row[1], row[2], bool(row[3]))


def keyed_tokens_outcome(key: WriteKey, found: KeyedTokens) -> bool:
    """Whether a keyed increment is settled (False: run it again). Recorded now, or for
    this session's token update (a re-send), or an unknown session: done. Recorded for
    another write: refused (:func:`known_tokens`). Not recorded though the session exists:
    a concurrent call committed the key after this statement's snapshot; a rerun sees it."""
    claimed, session_id, message_id, session_found = found
    if claimed:
        return True
    if session_id is not None:
        known_tokens(key, session_id, message_id)
        return True
    return not session_found


def message_id(cursor: Any) -> int:
    """The id :func:`append_statement` returns, read from the driver's cursor (a grouped
    append)."""
    return int(pggroup.scalar(cursor))


@functools.cache
def create_child_statement() -> Select[Any]:
    """``create_session`` with a parent as one statement: insert when the parent exists (an
    existing id is left as it is); the row says whether the parent was found."""
    names = [c.name for c in S.columns if c.name in CREATE_COLUMNS]

    def parent() -> sa.Exists:
        return sa.exists().where(S.c.id == sa.bindparam("parent_session_id"))

    row = select(*(sa.bindparam(name, type_=S.c[name].type) for name in names)).where(parent())
    inserted = (
        postgresql.insert(S)
        .from_select(names, row)
        .on_conflict_do_nothing(index_elements=["id"])
        .cte("inserted")
    )
    return select(parent().label("found")).add_cte(inserted)


class PostgresqlStatements(Statements):
    holds_nul = False
    keys_race = True
    insert_session: ClassVar[Insert] = postgresql.insert(S).on_conflict_do_nothing(
        index_elements=["id"]
    )

    def __init__(self, dialect: Dialect) -> None:
        self.streams_export = pgstream.supported(dialect)

    @staticmethod
    def title_taken(error: sa.exc.DBAPIError) -> bool:
        # The server names the constraint a unique violation met.
        diag = getattr(error.orig, "diag", None)
        return (
            sqlstate(error) == UNIQUE_VIOLATION
            and diag is not None
            and diag.constraint_name == TITLE_INDEX
        )

    def create_session(self, uow: UnitOfWork, values: dict[str, Any]) -> None:
        parent = values["parent_session_id"]
        if uow.current() is not None:
            super().create_session(uow, values)
            return
        if parent is None:
            self.ensure_session(uow, values)
            return
        try:
            found = uow.run_statement(
                lambda conn: conn.execute(create_child_statement(), values).scalar(),
                idempotent=True,
            )
        except WriteRefusedError as error:  # the parent was deleted meanwhile
            if sqlstate(refused(error)) != FOREIGN_KEY_VIOLATION:
                raise
            found = False
        if not found:
            raise missing_parent(parent)

    def set_title(self, uow: UnitOfWork, session_id: str, title: str | None) -> bool:
        if uow.current() is not None:
            return super().set_title(uow, session_id, title)
        # One UPDATE: the unique index refuses a title held elsewhere (then, and only then,
        # a second statement names the holder).
        statement = update(S).where(S.c.id == session_id).values(title=title)
        try:
            changed = uow.run_statement(
                lambda conn: conn.execute(statement).rowcount, idempotent=True
            )
        except WriteRefusedError as error:
            if not self.title_taken(refused(error)):  # another constraint, or a trigger
                raise
            holder = uow.read_scalar(title_holder(session_id, title))
            held = f" by session {holder}" if holder is not None else ""
            raise TitleInUseError(f"Title '{title}' is already in use{held}") from error
        return bool(changed)

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
        if project_compression_tips and not include_children:  # the chains in one statement
            return listing.projected_page(
                conn, source=source, exclude_sources=exclude_sources, limit=limit, offset=offset
            )
        return super().list_sessions_rich(
            conn,
            source=source,
            exclude_sources=exclude_sources,
            limit=limit,
            offset=offset,
            include_children=include_children,
            project_compression_tips=project_compression_tips,
        )

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
        # One UPDATE; adding twice is not setting twice: only absolute is retried, and an
        # increment with a key (which lands once per key). No guards: BIGINT addition refuses
        # an overflow by itself (bigint out of range).
        params = token_params(session_id, counts, texts, *costs)
        if key is not None and not absolute:
            self._increment_once(uow, session_id, params, key)
            return
        statement = token_statement(absolute)
        uow.run_statement(
            lambda conn: int(conn.execute(statement, params).rowcount),
            idempotent=absolute,
            grouped=pggroup.Grouped(statement, params, session_id, pggroup.rowcount),
        )

    def _increment_once(
        self, uow: UnitOfWork, session_id: str, params: dict[str, Any], key: WriteKey
    ) -> None:
        """A keyed increment: one statement (:func:`keyed_tokens_statement`), idempotent, so a
        lost connection is retried; a key recorded for another write raises. Run again only
        when a concurrent call recorded the key after its snapshot (it waited for that call)."""
        params.update(write_key=key.key, key_created_at=key.created_at)
        statement = keyed_tokens_statement()

        def run(conn: Connection) -> KeyedTokens:
            return keyed_tokens_row(conn.execute(statement, params))

        for _ in range(KEY_RACE_ATTEMPTS):
            found = uow.run_statement(
                run,
                idempotent=True,
                grouped=pggroup.Grouped(statement, params, session_id, keyed_tokens_row),
            )
            if keyed_tokens_outcome(key, found):
                return
        raise HermesStoreError(  # only while the key is deleted again and again
            f"idempotency_key {key.key!r}: no outcome after {KEY_RACE_ATTEMPTS} attempts"
        )

    def append_message(
        self,
        uow: UnitOfWork,
        values: dict[str, Any],
        tool_calls: int,
        key: WriteKey | None = None,
    ) -> int:
        if uow.current() is not None:
            return super().append_message(uow, values, tool_calls, key)
        if key is not None:
            return self._append_once(uow, values, tool_calls, key)
        session_id = values["session_id"]
        params = {**values, "bump_messages": 1, "bump_tool_calls": tool_calls}
        statement = append_statement()
        try:
            return uow.run_statement(
                lambda conn: int(conn.execute(statement, params).scalar_one()),
                idempotent=False,
                grouped=pggroup.Grouped(statement, params, session_id, message_id),
            )
        except WriteRefusedError as error:
            if sqlstate(refused(error)) != FOREIGN_KEY_VIOLATION:
                raise
            raise missing_session(session_id) from error

    def _append_once(
        self, uow: UnitOfWork, values: dict[str, Any], tool_calls: int, key: WriteKey
    ) -> int:
        """A keyed append: one statement (:func:`keyed_append_statement`), idempotent, so a
        lost connection is retried and a re-sent call returns the recorded id."""
        session_id = values["session_id"]
        params = {
            **values,
            "bump_messages": 1,
            "bump_tool_calls": tool_calls,
            "write_key": key.key,
            "key_created_at": key.created_at,
        }
        statement = keyed_append_statement()

        def run(conn: Connection) -> tuple[int | None, str] | None:
            found = conn.execute(statement, params).first()
            return (found[0], found[1]) if found is not None else None

        for _ in range(KEY_RACE_ATTEMPTS):
            try:
                found = uow.run_statement(
                    run,
                    idempotent=True,
                    grouped=pggroup.Grouped(statement, params, session_id, keyed_message),
                )
            except WriteRefusedError as error:
                state = sqlstate(refused(error))
                if state == FOREIGN_KEY_VIOLATION:
                    raise missing_session(session_id) from error
                if state != UNIQUE_VIOLATION or not key_taken(refused(error)):
                    raise
                continue  # a concurrent same-key append committed first: look again
            if found is not None:
                return known_message(key, found[1], found[0])
        raise HermesStoreError(  # only while the key's session is deleted again and again
            f"idempotency_key {key.key!r}: no outcome after {KEY_RACE_ATTEMPTS} attempts"
        )

    def iter_export(
        self, uow: UnitOfWork, source: str | None, page_size: int
    ) -> Iterator[ExportRecord]:
        if self.streams_export and uow.current() is None:
            return pgstream.iter_export(uow.engine, source)  # one snapshot, server-side cursors
        return super().iter_export(uow, source, page_size)
