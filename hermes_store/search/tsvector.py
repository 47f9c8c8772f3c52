"""PostgreSQL's full-text search: a tsquery against the stored, GIN-indexed tsvector, in ONE
statement per page: ranked by ``ts_rank`` among the newest RANK_WINDOW matches, with
``ts_headline`` for short contents and the same-session context seeks for the page's rows
only."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import func, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnClause, ColumnElement

from hermes_store.schema import ddl
from hermes_store.search.hits import (
    Filters,
    Hit,
    Page,
    columns,
    context_columns,
    dicts,
    fold_contexts,
)
from hermes_store.search.query import Item, Query, Term, fold
from hermes_store.search.snippets import SNIPPET_INLINE_CHARS, bounded_snippet, term_patterns
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S

_PG_CONFIG: ColumnClause[Any] = sa.literal_column("'simple'::regconfig")
# The stored tsvector column (not in the ORM models: the migrations own it), GIN-indexed.
_PG_VECTOR: ColumnClause[Any] = sa.literal_column(f"{M.name}.{ddl.PG_TSV_COLUMN}")
_PG_HEADLINE = "StartSel=>>>, StopSel=<<<, MaxWords=35, MinWords=15"
_PG_EDGE_CHARS = 400  # how much of each end of the content tells whether the headline is cut
#: How much of a content PostgreSQL returns for its snippet: a match past it shows the start.
_PG_CONTENT_CHARS = 1 << 20


def tsquery(items: list[Item]) -> str:
    """The query as a ``to_tsquery`` string of quoted operands (``'...':*`` for prefixes)."""

    def leaf(term: Term) -> str:
        quoted = "'" + term.words.replace("\\", "\\\\").replace("'", "''") + "'"
        return quoted + ":*" if term.prefix else quoted

    def group(joiner: str) -> Callable[[list[str]], str]:
        return lambda parts: parts[0] if len(parts) == 1 else "(" + joiner.join(parts) + ")"

    return fold(items, leaf, group(" & "), group(" | "), lambda part: "!" + part)


class Tsvector:
    """The full-text searcher of a PostgreSQL store."""

    def find(
        self, conn: Connection, query: Query, filters: Filters, page: Page
    ) -> list[Hit] | None:
        """The page of matches with snippets and context, in one statement
        (:func:`full_text_rows`); None when no term has anything to index."""
        terms = query.indexable()
        if terms is None:
            return None
        rows = full_text_rows(conn, tsquery(terms), filters, page)
        patterns: list[re.Pattern[str]] | None = None
        for row in rows:
            content = row["snippet"] or ""
            headline = row.pop("headline")
            if len(content) <= SNIPPET_INLINE_CHARS:
                head, tail = content[:_PG_EDGE_CHARS], content[-_PG_EDGE_CHARS:]
                row["snippet"] = _mark_cuts(headline or "", head, tail)
            else:
                if patterns is None:
                    patterns = term_patterns(terms)
                row["snippet"] = bounded_snippet(content, patterns, complete=_complete(content))
        return rows

    def matches_any(self, conn: Connection, query: Query, filters: Filters, sort: str) -> bool:
        """Whether the query has any match at all (a page past the end is empty too)."""
        return bool(self.find(conn, query, filters, Page(1, 0, sort)))


def full_text_rows(conn: Connection, tsquery_text: str, filters: Filters, page: Page) -> list[Hit]:
    """One page of full-text hits in ONE statement: the contract's columns, the content's first
    _PG_CONTENT_CHARS (as ``snippet``), ``headline`` (ts_headline, for short contents only) and
    the same-session context."""
    statement = _full_text_statement(page.sort, *filters.shape)
    params = {
        "tsquery": tsquery_text,
        "pg_window": page.window(),
        **page.params("pg"),
        **filters.params("pg"),
    }
    return fold_contexts(dicts(conn.execute(statement, params)))


@functools.cache
def _full_text_statement(sort: str, by_source: bool, excluding: bool, by_role: bool) -> Select[Any]:
    """Built once per order and filter shape. The matches come off the GIN index alone (rank:
    the newest RANK_WINDOW by id, then ``ts_rank`` of those); ``sessions`` is joined there only
    for a source filter, otherwise for the page's rows alone; ts_headline and the context seeks
    run for the page's rows only."""
    query = func.to_tsquery(_PG_CONFIG, sa.bindparam("tsquery", type_=sa.Text))
    criteria: list[ColumnElement[bool]] = [_PG_VECTOR.op("@@")(query)]
    if by_source:
        criteria.append(S.c.source.in_(sa.bindparam("pg_sources", expanding=True)))
    if excluding:
        criteria.append(S.c.source.not_in(sa.bindparam("pg_excluded", expanding=True)))
    if by_role:
        criteria.append(M.c.role.in_(sa.bindparam("pg_roles", expanding=True)))
    matching = M.join(S, S.c.id == M.c.session_id) if by_source or excluding else M
    limit = sa.bindparam("pg_limit", type_=sa.BigInteger)
    offset = sa.bindparam("pg_offset", type_=sa.BigInteger)
    if sort == "rank":
        # ts_rank in the window itself: computed for its rows only, from the row just read.
        window = (
            select(M.c.id, func.ts_rank(_PG_VECTOR, query).label("rank"), M.c.timestamp)
            .select_from(matching)
            .where(*criteria)
            .order_by(M.c.id.desc())
            .limit(sa.bindparam("pg_window", type_=sa.BigInteger))
            .subquery("window")
        )
        found = select(window.c.id, window.c.rank, window.c.timestamp).order_by(
            window.c.rank.desc(), window.c.id.desc()
        )
    else:
        direction = sa.desc if sort == "newest" else sa.asc
        found = (
            select(M.c.id, M.c.timestamp)
            .select_from(matching)
            .where(*criteria)
            .order_by(direction(M.c.timestamp), direction(M.c.id))
        )
    paged = found.limit(limit).offset(offset).subquery("page")
    if sort == "rank":
        order: tuple[Any, ...] = (paged.c.rank.desc(), paged.c.id.desc())
    else:
        direction = sa.desc if sort == "newest" else sa.asc
        order = (direction(paged.c.timestamp), direction(paged.c.id))
    # At most _PG_CONTENT_CHARS of each content: PostgreSQL decompresses only that slice.
    prefix = func.substr(M.c.content, 1, _PG_CONTENT_CHARS)
    headline = sa.case(
        (
            func.char_length(prefix) <= SNIPPET_INLINE_CHARS,
            func.ts_headline(_PG_CONFIG, M.c.content, query, _PG_HEADLINE),
        ),
        else_=sa.null(),
    )
    return (
        select(*columns(prefix), headline.label("headline"), *context_columns(func.octet_length))
        .select_from(paged.join(M, M.c.id == paged.c.id).join(S, S.c.id == M.c.session_id))
        .order_by(*order)
    )


def _mark_cuts(headline: str, head: str, tail: str) -> str:
    """Add FTS5's ``...`` where ts_headline's window does not reach the content's ends."""
    plain = headline.replace(">>>", "").replace("<<<", "")
    edge = min(len(plain), _PG_EDGE_CHARS)
    starts = head.startswith(plain[:edge])
    ends = tail.endswith(plain[len(plain) - edge :])
    return ("" if starts else "...") + headline + ("" if ends else "...")


def _complete(content: str) -> bool:
    """Whether the content came whole (not cut at _PG_CONTENT_CHARS)."""
    return len(content) < _PG_CONTENT_CHARS
