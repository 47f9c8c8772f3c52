"""Ready-made analytics queries over the tables (notebooks, reports, ``hermes-store stats``).

Every function returns a SQLAlchemy ``Select`` (nothing runs until you execute it), so a
query can be refined further (``.where()``, ``.order_by()``, ``.limit()``) and runs
unchanged on SQLite and PostgreSQL. :func:`to_dataframe` executes one into a pandas
``DataFrame`` (``pip install 'hermes-store[analytics]'``).

Usage figures come from the per-session counters (``message_count``, the token columns and
the costs) that the store keeps up to date on every write, so they cost one pass over
``sessions``; days are UTC calendar days of ``started_at``, as ``'YYYY-MM-DD'`` text.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import sqlalchemy as sa
from sqlalchemy import Select, func, literal_column, select
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from hermes_store.echo import echoed
from hermes_store.errors import InvalidInputError, extras_named
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S

if TYPE_CHECKING:
    import pandas

    from hermes_store.store import SessionDB

Dimension = Literal["day", "model", "source"]
#: A ``select()`` with any columns.
Query: TypeAlias = Select[*tuple[Any, ...]]
#: One source (``"cli"``), several (``["cli", "telegram"]``) or None for all.
Sources: TypeAlias = str | Sequence[str] | None
#: A time bound: epoch seconds, a datetime (naive = UTC), a date or a pandas.Timestamp.
When: TypeAlias = float | datetime | date
#: What a query runs on: a store, an Engine or Connection, a URL, or a SQLite file path.
Target: TypeAlias = "SessionDB | Engine | Connection | URL | str | os.PathLike[str]"
TOKEN_COLUMNS = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
)
#: Recursion guard for lineage queries: a parent cycle (possible with foreign keys off)
#: stops here instead of looping forever.
MAX_LINEAGE_DEPTH = 1000


class utc_day(FunctionElement[str]):
    """``'YYYY-MM-DD'`` (UTC) of a float epoch-seconds column, compiled per dialect."""

    type = sa.String()
    name = "utc_day"
    inherit_cache = True


@compiles(utc_day, "sqlite")
def _utc_day_sqlite(element: utc_day, compiler: SQLCompiler, **kw: Any) -> str:
    return f"date({compiler.process(element.clauses, **kw)}, 'unixepoch')"


@compiles(utc_day, "postgresql")
def _utc_day_postgresql(element: utc_day, compiler: SQLCompiler, **kw: Any) -> str:
    epoch = compiler.process(element.clauses, **kw)
    return f"to_char(to_timestamp({epoch}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


def _dimension(name: Dimension) -> ColumnElement[Any]:
    if name == "day":
        return utc_day(S.c.started_at).label("day")
    if name in ("model", "source"):
        return S.c[name].label(name)
    raise ValueError(f"unknown dimension {echoed(name)}; use 'day', 'model' or 'source'")


def _source_filter(source: Sources) -> ColumnElement[bool] | None:
    if source is None:
        return None
    if isinstance(source, str):
        return S.c.source == source
    return S.c.source.in_(list(source))


def epoch_seconds(name: str, value: When | None) -> float | None:
    """A ``since``/``until`` bound as the float epoch seconds the columns hold.

    Accepts epoch seconds (int or float), a ``datetime`` (naive means UTC; an aware one is
    converted), a ``date`` (midnight UTC) and a ``pandas.Timestamp`` (a ``datetime``), so the
    same call filters the same rows on SQLite and PostgreSQL instead of comparing a float
    column with a timestamp (no rows on SQLite, a type error on PostgreSQL).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be a time, not a bool")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise InvalidInputError(f"{name} must be a finite number of epoch seconds")
        return float(value)
    if isinstance(value, datetime):
        if value != value:  # pandas.NaT
            raise InvalidInputError(f"{name} is not a time (NaT)")
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return aware.timestamp()
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC).timestamp()
    raise InvalidInputError(
        f"{name} must be epoch seconds, a datetime, a date or a pandas.Timestamp,"
        f" not {type(value).__name__}"
    )


def _session_filters(
    statement: Query, since: When | None, until: When | None, source: Sources
) -> Query:
    low = epoch_seconds("since", since)
    high = epoch_seconds("until", until)
    if low is not None:
        statement = statement.where(S.c.started_at >= low)
    if high is not None:
        statement = statement.where(S.c.started_at < high)
    by_source = _source_filter(source)
    if by_source is not None:
        statement = statement.where(by_source)
    return statement


def _usage_columns() -> list[ColumnElement[Any]]:
    def total(column: Any) -> ColumnElement[Any]:
        return func.coalesce(func.sum(column), 0)

    def count_total(column: Any) -> ColumnElement[Any]:
        # PostgreSQL sums BIGINT counters as NUMERIC (Decimal): keep them integers.
        return sa.cast(total(column), sa.BigInteger)

    columns: list[ColumnElement[Any]] = [
        func.count(S.c.id).label("sessions"),
        count_total(S.c.message_count).label("messages"),
        count_total(S.c.tool_call_count).label("tool_calls"),
    ]
    columns += [count_total(S.c[name]).label(name) for name in TOKEN_COLUMNS]
    columns += [
        sa.cast(total(S.c.estimated_cost_usd), sa.Float).label("estimated_cost_usd"),
        sa.cast(total(S.c.actual_cost_usd), sa.Float).label("actual_cost_usd"),
    ]
    return columns


def usage(
    by: Dimension | Sequence[Dimension] = "model",
    *,
    since: When | None = None,
    until: When | None = None,
    source: Sources = None,
) -> Query:
    """Sessions, messages, tool calls, the five token counters and both costs, grouped ``by``.

    ``by`` is ``"day"``, ``"model"``, ``"source"`` or a sequence of them (``("day", "model")``).
    ``since``/``until`` bound ``started_at`` (epoch seconds, a ``datetime`` (naive = UTC), a
    ``date`` or a ``pandas.Timestamp``); ``source`` keeps one source or
    a list of them.
    Rows are ordered by the dimensions (days oldest first).
    """
    names: list[Dimension] = [by] if isinstance(by, str) else list(by)
    if not names:
        raise ValueError("usage() needs at least one dimension")
    dimensions = [_dimension(name) for name in names]
    statement = select(*dimensions, *_usage_columns()).group_by(*dimensions)
    # NULL (no model) last on both backends: SQLite sorts NULLs first by default.
    statement = statement.order_by(*(d.asc().nulls_last() for d in dimensions))
    return _session_filters(statement, since, until, source)


def usage_per_day(
    *, since: When | None = None, until: When | None = None, source: Sources = None
) -> Query:
    """:func:`usage` by UTC day of ``started_at``, oldest day first."""
    return usage("day", since=since, until=until, source=source)


def usage_per_model(
    *, since: When | None = None, until: When | None = None, source: Sources = None
) -> Query:
    """:func:`usage` by model (sessions without a model form one ``None`` row)."""
    return usage("model", since=since, until=until, source=source)


def usage_per_source(
    *, since: When | None = None, until: When | None = None, source: Sources = None
) -> Query:
    """:func:`usage` by source (``cli``, ``telegram``, ...)."""
    return usage("source", since=since, until=until, source=source)


def totals(
    *, since: When | None = None, until: When | None = None, source: Sources = None
) -> Query:
    """One row: the :func:`usage` figures over every (matching) session."""
    return _session_filters(select(*_usage_columns()), since, until, source)


def tool_usage(*, since: When | None = None, source: Sources = None) -> Query:
    """Per ``messages.tool_name``: calls, sessions using it, first and last use; busiest first.

    The agent records a tool's name on the ``role="tool"`` reply, so each row counts results.
    ``since`` bounds the message timestamp; ``source`` keeps the sessions of one source (or of
    a list).
    """
    calls = func.count(M.c.id)
    statement = (
        select(
            M.c.tool_name.label("tool_name"),
            calls.label("calls"),
            func.count(sa.distinct(M.c.session_id)).label("sessions"),
            func.min(M.c.timestamp).label("first_used"),
            func.max(M.c.timestamp).label("last_used"),
        )
        .where(M.c.tool_name.is_not(None))
        .group_by(M.c.tool_name)
        .order_by(calls.desc(), M.c.tool_name)
    )
    low = epoch_seconds("since", since)
    if low is not None:
        statement = statement.where(M.c.timestamp >= low)
    by_source = _source_filter(source)
    if by_source is not None:
        statement = statement.join(S, S.c.id == M.c.session_id).where(by_source)
    return statement


def session_durations(*, source: Sources = None) -> Query:
    """Ended sessions with ``duration_s = ended_at - started_at``, oldest first."""
    statement = (
        select(
            S.c.id,
            S.c.source,
            S.c.model,
            S.c.started_at,
            S.c.ended_at,
            (S.c.ended_at - S.c.started_at).label("duration_s"),
            S.c.end_reason,
            S.c.message_count,
        )
        .where(S.c.ended_at.is_not(None))
        .order_by(S.c.started_at, S.c.id)
    )
    return _session_filters(statement, None, None, source)


def lineage_depth() -> Query:
    """Every session reachable from a root, with its ``root_id`` and ``depth`` (root = 0).

    A recursive CTE over ``parent_session_id`` (compression continuations, delegated
    subagents, branches). Sessions whose parent row is missing are not reachable and left out.
    """
    roots = select(
        S.c.id.label("id"),
        S.c.id.label("root_id"),
        literal_column("0", sa.Integer).label("depth"),
    ).where(S.c.parent_session_id.is_(None))
    tree = roots.cte("lineage", recursive=True)
    step = select(S.c.id, tree.c.root_id, (tree.c.depth + literal_column("1", sa.Integer))).where(
        S.c.parent_session_id == tree.c.id,
        tree.c.depth < literal_column(str(MAX_LINEAGE_DEPTH), sa.Integer),
    )
    tree = tree.union_all(step)
    return select(tree.c.id, tree.c.root_id, tree.c.depth).order_by(
        tree.c.root_id, tree.c.depth, tree.c.id
    )


def lineages(*, min_sessions: int = 1) -> Query:
    """Per root session: how many sessions its lineage holds and how deep it goes."""
    tree = lineage_depth().order_by(None).subquery()
    size = func.count(tree.c.id)
    return (
        select(tree.c.root_id, size.label("sessions"), func.max(tree.c.depth).label("max_depth"))
        .group_by(tree.c.root_id)
        .having(size >= min_sessions)
        .order_by(size.desc(), tree.c.root_id)
    )


# -- running a query ---------------------------------------------------------------------------


def summary(
    db: SessionDB, *, days: int = 30, source: Sources = None, now: float | None = None
) -> dict[str, Any]:
    """The figures ``hermes-store stats`` shows: ``totals`` (one row), ``by_model``,
    ``by_source`` and ``by_day`` (the last ``days`` UTC days, today included) as row dicts,
    read in one read transaction."""
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= 100_000:
        raise InvalidInputError("days must be a whole number from 1 to 100000")
    today = datetime.fromtimestamp(time.time() if now is None else now, UTC).date()
    since = datetime.combine(today - timedelta(days=days - 1), datetime.min.time(), UTC)
    queries = {
        "totals": totals(source=source),
        "by_model": usage_per_model(source=source),
        "by_source": usage_per_source(source=source),
        "by_day": usage_per_day(since=since, source=source),
    }
    with db.uow.connect(write=False) as conn:
        found = {
            name: [dict(row._mapping) for row in conn.execute(query)]
            for name, query in queries.items()
        }
    return {"totals": found.pop("totals")[0], **found, "days": days}


#: Columns holding float epoch seconds: datetime64 (UTC) in a frame.
TIME_COLUMNS = frozenset(
    {"started_at", "ended_at", "timestamp", "first_used", "last_used", "last_active"}
)
#: Columns holding a ``'YYYY-MM-DD'`` UTC day: datetime64 (UTC midnight) in a frame.
DAY_COLUMNS = frozenset({"day"})
#: One resolution for every time column, whatever pandas infers from the values.
UTC_DTYPE = "datetime64[ns, UTC]"


def to_dataframe(statement: sa.Executable, target: Target) -> pandas.DataFrame:
    """Run ``statement`` on ``target`` and return a ``pandas.DataFrame`` of the rows.

    ``target`` is a :class:`~hermes_store.SessionDB`, an Engine, a Connection, a URL or a
    SQLite file path (opened read-only as it is: no migration). Needs pandas
    (``pip install 'hermes-store[analytics]'``).

    Columns get the same dtypes on both backends and in empty results: timestamps
    (:data:`TIME_COLUMNS`) and days are ``datetime64[ns, UTC]``, integer columns ``int64``
    (``Int64`` when they hold NULLs), floats ``float64``. A timestamp such a column cannot hold
    (before 1677 or after 2262, or a number no date holds: a file the original store wrote
    may have any) is ``NaT``, as a NULL one is.
    """
    with extras_named():
        pd: Any = importlib.import_module("pandas")
    kinds = _column_kinds(statement)

    def frame(conn: Connection) -> pandas.DataFrame:
        result = conn.execute(statement)
        names = list(result.keys())
        table: pandas.DataFrame = pd.DataFrame(result.all(), columns=names)
        for name in names:
            table[name] = _typed(pd, table[name], name, kinds.get(name))
        return table

    if isinstance(target, Connection):
        return frame(target)
    from hermes_store.store import SessionDB

    if isinstance(target, SessionDB):
        with target.uow.connect(write=False) as conn:
            return frame(conn)
    if isinstance(target, Engine):
        with target.connect() as conn:
            return frame(conn)
    from hermes_store.schema.migrate import read_engine

    engine = read_engine(target)
    try:
        with engine.connect() as conn:
            return frame(conn)
    finally:
        engine.dispose()


def _column_kinds(statement: sa.Executable) -> dict[str, str]:
    """``"int"``, ``"float"`` or ``"text"`` per selected column, from the statement's types."""
    kinds: dict[str, str] = {}
    for column in getattr(statement, "selected_columns", ()):
        try:
            python_type = column.type.python_type
        except NotImplementedError:
            continue
        if python_type is int:
            kinds[column.key] = "int"
        elif python_type is float:
            kinds[column.key] = "float"
        elif python_type is str:
            kinds[column.key] = "text"
    return kinds


def _typed(pd: Any, values: Any, name: str, kind: str | None) -> Any:
    if name in TIME_COLUMNS:
        moments = pd.to_datetime(
            pd.to_numeric(values, errors="coerce"), unit="s", utc=True, errors="coerce"
        )
        return moments.astype(UTC_DTYPE)
    if name in DAY_COLUMNS:
        return pd.to_datetime(values, utc=True, format="%Y-%m-%d").astype(UTC_DTYPE)
    if kind == "int":
        numbers = pd.to_numeric(values)
        return numbers.astype("Int64" if numbers.isna().any() else "int64")
    if kind == "float":
        return pd.to_numeric(values).astype("float64")
    return values
