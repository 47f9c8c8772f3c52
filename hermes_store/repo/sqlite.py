"""SQLite's writes: the hot ones as statements compiled once per process, run on the unit's own
DB-API connection (``uow.run(..., driver_only=True)``; the hottest, ``uow.run_on_driver(...)``,
are handed the DB-API connection itself: the unit is begun and committed on the driver too,
and joins the file's group commit), so a write pays for its SQL, not for SQLAlchemy's
per-execution work. The statements are the Core ones of
:mod:`hermes_store.repo.statements`, compiled for SQLite: one source of truth."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import Insert

from hermes_store.engine import fastpath
from hermes_store.repo.statements import (
    BUMP_COUNTERS,
    COUNTERS,
    INT64_MAX,
    INT64_MIN,
    KEY_LOOKUP,
    TITLE_INDEX,
    TOKEN_TEXTS,
    Statements,
    WriteKey,
    bump_params,
    counter_overflow,
    known_message,
    known_tokens,
    missing_session,
    token_statement,
)
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.tables import write_keys_table as K
from hermes_store.uow.unit import UnitOfWork


def _compiled(
    statement: sa.ClauseElement, column_keys: list[str] | None = None
) -> tuple[str, tuple[str, ...]]:
    """SQL text and positional parameter names of a statement, compiled for SQLite."""
    compiled = statement.compile(dialect=sqlite.dialect(), column_keys=column_keys)
    assert isinstance(compiled, SQLCompiler)
    return compiled.string, tuple(compiled.positiontup or ())


@functools.cache
def driver_sql(name: str) -> tuple[str, tuple[str, ...]]:
    """SQL text and positional parameter names of a hot statement (``bump``, ``insert``,
    ``session_exists``, ``key_lookup``, ``key_insert``), compiled for SQLite once per
    process."""
    statements: dict[str, tuple[sa.ClauseElement, list[str] | None]] = {
        "bump": (BUMP_COUNTERS, None),
        "insert": (M.insert(), list(INSERT_COLUMNS)),
        "session_exists": (sa.select(S.c.id).where(S.c.id == sa.bindparam("sid")), None),
        "key_lookup": (KEY_LOOKUP, None),
        "key_insert": (K.insert(), [c.name for c in K.columns]),
    }
    statement, column_keys = statements[name]
    return _compiled(statement, column_keys)


#: The columns of a message row, in the order of the compiled INSERT's parameters.
INSERT_COLUMNS = tuple(c.name for c in M.columns if c.name != "id")


#: The flat values of a token update, in this order: what :class:`_TokenPlan` picks from.
_TOKEN_SLOTS = (
    "p_sid",
    *(f"p_{name}" for name in COUNTERS),
    "p_est",
    "p_act",
    *(f"p_{name}" for name in TOKEN_TEXTS),
    *(f"p_bound_{name}" for name in COUNTERS),
)


class _TokenPlan:
    """One shape of the token update (absolute, or the signs of the increments), compiled for
    SQLite once: its SQL and a picker of its positional values from the flat values."""

    __slots__ = ("guarded", "pick", "sql")

    def __init__(self, statement: sa.ClauseElement, guarded: bool) -> None:
        self.sql, names = _compiled(statement)
        self.pick = operator.itemgetter(*(_TOKEN_SLOTS.index(name) for name in names))
        self.guarded = guarded


_token_plans: dict[tuple[tuple[int, ...] | None, bool], _TokenPlan] = {}
#: The costs and texts of a call that gives only tokens (the usual one).
_UNPRICED = (None,) * (2 + len(TOKEN_TEXTS))


def _token_plan(signs: tuple[int, ...] | None, priced: bool = True) -> _TokenPlan:
    """The plan of an absolute update (``None``) or of an incremental one with these signs (at
    most 3**5 shapes; each compiled at its first use), with its costs and texts bound, or NULL
    in the SQL when the call gives none (``priced``: see
    :func:`~hermes_store.repo.statements.token_statement`)."""
    plan = _token_plans.get((signs, priced))
    if plan is None:
        if signs is None:
            plan = _TokenPlan(token_statement(True, (), priced), guarded=False)
        else:
            plan = _TokenPlan(token_statement(False, signs, priced), guarded=any(signs))
        _token_plans[signs, priced] = plan
    return plan


def _increment(
    session_id: str,
    counts: tuple[int, ...],
    costs: tuple[float | None, float | None],
    texts: tuple[str | None, ...],
) -> tuple[_TokenPlan, tuple[Any, ...]]:
    """The plan of an incremental token update and its positional values: the signs and
    64-bit bounds of :func:`~hermes_store.repo.statements.token_guards`, worked out without a
    loop or a call (every agent turn makes this call). A bound is computed for every counter
    and picked only for the nonzero ones."""
    a, b, c, d, e = counts
    signs = ((a > 0) - (a < 0), (b > 0) - (b < 0), (c > 0) - (c < 0), (d > 0) - (d < 0),
             (e > 0) - (e < 0))  # fmt: skip
    priced = (*costs, *texts) != _UNPRICED
    plan = _token_plans.get((signs, priced)) or _token_plan(signs, priced)
    values = plan.pick(
        (
            session_id, a, b, c, d, e, *costs, *texts,
            INT64_MAX - a if a >= 0 else INT64_MIN - a,
            INT64_MAX - b if b >= 0 else INT64_MIN - b,
            INT64_MAX - c if c >= 0 else INT64_MIN - c,
            INT64_MAX - d if d >= 0 else INT64_MIN - d,
            INT64_MAX - e if e >= 0 else INT64_MIN - e,
        )
    )  # fmt: skip
    return plan, values


@functools.cache
def _picker(name: str) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """Parameters by name (a dict) as the positional values of :func:`driver_sql`'s statement
    ``name``, picked in one C call."""
    keys = driver_sql(name)[1]
    if len(keys) == 1:
        key = keys[0]
        return lambda params: (params[key],)
    return operator.itemgetter(*keys)


@functools.cache
def _bump_plan() -> tuple[str, Callable[[tuple[str, int, int]], tuple[Any, ...]]]:
    """The counter bump's SQL and a picker of its positional values from ``(session id,
    messages, tool calls)``: no dict per call."""
    sql, names = driver_sql("bump")
    slots = ("sid", "messages", "tool_calls")
    return sql, operator.itemgetter(*(slots.index(name) for name in names))


#: The columns every message fills (``content`` may be None); the others are empty in the
#: usual append (a turn's text: no tool call, no reasoning, no token count).
_ALWAYS_FILLED = ("session_id", "role", "content", "timestamp")
_OFTEN_EMPTY = tuple(name for name in INSERT_COLUMNS if name not in _ALWAYS_FILLED)


class _InsertPlan:
    """The message INSERT compiled for SQLite twice: every column bound, and the usual
    append's, with NULL in the SQL for the columns it leaves empty. sqlite3 binds a None
    through its adapter protocol (a failed ``__conform__`` look-up, ~3k instructions each):
    eight of them were a tenth of a lone append's CPU."""

    __slots__ = ("empty", "pick", "pick_often_empty", "pick_plain", "plain_sql", "sql")

    def __init__(self) -> None:
        self.sql, self.pick = driver_sql("insert")[0], _picker("insert")
        plain = M.insert().values({name: sa.null() for name in _OFTEN_EMPTY})
        self.plain_sql, names = _compiled(plain, list(_ALWAYS_FILLED))
        self.pick_plain = operator.itemgetter(*names)
        self.pick_often_empty = operator.itemgetter(*_OFTEN_EMPTY)
        self.empty = (None,) * len(_OFTEN_EMPTY)

    def bound(self, values: Mapping[str, Any]) -> tuple[str, tuple[Any, ...]]:
        """The INSERT of a message's columns (``values``) and its positional values."""
        if self.pick_often_empty(values) == self.empty:
            return self.plain_sql, self.pick_plain(values)
        return self.sql, self.pick(values)


@functools.cache
def _insert_plan() -> _InsertPlan:
    """The message INSERT's plan, compiled once per process."""
    return _InsertPlan()


def _bound(name: str, params: Mapping[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """A hot statement's SQL and its values in positional order."""
    return driver_sql(name)[0], _picker(name)(params)


def _bump(conn: Connection, session_id: str, bump: tuple[str, tuple[Any, ...]]) -> None:
    """Count messages and tool calls on the session (``bump``: :func:`_bound`'s); a missing
    session raises."""
    if fastpath.driver_execute(conn, *bump).rowcount != 1:
        raise missing_session(session_id)


def _refuse_overflow(driver: Any, session_id: str) -> None:
    """A guarded token update changed no row: an unknown session is a no-op, an existing one
    was held back by a counter's 64-bit bound (refused, the transaction rolls back)."""
    if driver.execute(driver_sql("session_exists")[0], (session_id,)).fetchone() is not None:
        raise counter_overflow()


#: SQLite's extended result code for a UNIQUE constraint (a trigger's RAISE has another).
SQLITE_CONSTRAINT_UNIQUE = 2067


class SqliteStatements(Statements):
    holds_nul = True
    insert_session: ClassVar[Insert] = sqlite.insert(S).on_conflict_do_nothing(
        index_elements=["id"]
    )

    @staticmethod
    def title_taken(error: sa.exc.DBAPIError) -> bool:
        orig = error.orig
        if getattr(orig, "sqlite_errorcode", None) != SQLITE_CONSTRAINT_UNIQUE:
            return False
        # SQLite names a unique index on columns by its columns, one on expressions by name.
        return str(orig).endswith(("sessions.title", f"index '{TITLE_INDEX}'"))

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
        if absolute:
            plan = _token_plan(None, (*costs, *texts) != _UNPRICED)
            values = plan.pick((session_id, *counts, *costs, *texts, *(None,) * len(counts)))
        else:
            plan, values = _increment(session_id, counts, costs, texts)
        sql, guarded = plan.sql, plan.guarded
        if key is None or absolute:

            def unit(driver: Any) -> None:
                try:
                    if driver.execute(sql, values).rowcount == 0 and guarded:
                        # No row changed: an unknown session (a no-op), or a bound held it back.
                        _refuse_overflow(driver, session_id)
                except uow.dbapi_error as error:
                    raise uow.driver_error(sql, error) from error

            uow.run_on_driver(unit)
            return
        lookup_sql, lookup = _bound("key_lookup", {"key": key.key})
        record_sql, record = _bound("key_insert", key.row(None))

        def keyed(conn: Connection) -> None:
            # One write unit: no other writer runs between the look-up and the insert.
            driver = conn.connection.driver_connection
            running = lookup_sql
            try:
                known = driver.execute(lookup_sql, lookup).fetchone()  # type: ignore[union-attr]
                if known is not None:  # landed already, or the key names another write
                    known_tokens(key, known[0], known[1])
                    return
                running = sql
                if driver.execute(sql, values).rowcount == 0:  # type: ignore[union-attr]
                    if guarded:
                        _refuse_overflow(driver, session_id)
                    return  # an unknown session: nothing added, no key recorded
                running = record_sql
                driver.execute(record_sql, record)  # type: ignore[union-attr]
            except fastpath.driver_errors(conn) as error:
                raise fastpath.driver_error(conn, running, error) from error

        uow.run(keyed, driver_only=True)

    def append_message(
        self,
        uow: UnitOfWork,
        values: dict[str, Any],
        tool_calls: int,
        key: WriteKey | None = None,
    ) -> int:
        session_id = values["session_id"]
        bump_sql, pick_bump = _bump_plan()
        bump = pick_bump((session_id, 1, tool_calls))
        insert_sql, row = _insert_plan().bound(values)
        if key is None:

            def unit(driver: Any) -> int:
                # Given the driver connection and no cursor object of our own: the two
                # statements are the whole unit, and what a lone write pays beyond the SQL is
                # what matters.
                sql = bump_sql
                try:
                    if driver.execute(sql, bump).rowcount != 1:
                        raise missing_session(session_id)
                    sql = insert_sql
                    message_id: int = driver.execute(sql, row).lastrowid
                    return message_id
                except uow.dbapi_error as error:
                    raise uow.driver_error(sql, error) from error

            return uow.run_on_driver(unit)
        lookup = _bound("key_lookup", {"key": key.key})
        record_sql, record_keys = driver_sql("key_insert")

        def keyed(conn: Connection) -> int:
            # One write unit: no other writer runs between the look-up and the insert.
            known = fastpath.driver_execute(conn, *lookup).fetchone()
            if known is not None:
                return known_message(key, known[0], known[1])
            _bump(conn, session_id, (bump_sql, bump))
            message_id = int(fastpath.driver_execute(conn, insert_sql, row).lastrowid)
            record = key.row(message_id)
            fastpath.driver_execute(conn, record_sql, tuple(record[k] for k in record_keys))
            return message_id

        return uow.run(keyed, driver_only=True)

    def append_messages(
        self, uow: UnitOfWork, session_id: str, rows: list[dict[str, Any]], tool_calls: int
    ) -> list[int]:
        sql = driver_sql("insert")[0]
        insert_rows = list(map(_picker("insert"), rows))
        bump = _bound("bump", bump_params(session_id, len(rows), tool_calls))

        def unit(conn: Connection) -> list[int]:
            _bump(conn, session_id, bump)
            cursor = fastpath.driver_execute(conn, sql, insert_rows, many=True)
            last = int(cursor.execute("SELECT last_insert_rowid()").fetchone()[0])
            # One transaction holding the write lock: AUTOINCREMENT ids are consecutive.
            return list(range(last - len(insert_rows) + 1, last + 1))

        return uow.run(unit, driver_only=True)
