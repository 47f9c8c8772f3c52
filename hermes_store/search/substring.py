"""The substring search: LIKE (SQLite, ASCII case-insensitive) or ILIKE (PostgreSQL) on the raw
fragments of the query, newest first for ``rank`` (a substring match carries no score), with
snippets of ~120 characters around the first fragment found and the same-session context in
the same statement.

It answers what the tokenizers cannot: CJK text (a word inside a longer run is no token),
punctuation-heavy terms (``->``, ``!=``), and, when the full-text search finds nothing, paths,
e-mails and URLs that a parser keeps whole. PostgreSQL's trigram index serves ILIKE when
pg_trgm is there; SQLite may start from its CJK index's candidates (:mod:`.cjk`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_, func, not_, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnElement

from hermes_store.engine import fastpath
from hermes_store.search import cjk, stored
from hermes_store.search.hits import (
    Filters,
    Hit,
    Page,
    Unpack,
    columns,
    context_columns,
    dicts,
    fold_contexts,
    unpack_utf8,
)
from hermes_store.search.query import Item, Query, Term, fold, positive_pieces
from hermes_store.search.snippets import substring_snippet
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.titles import escape_like


class Substring(abc.ABC):
    """The search, its statements built by the backend's subclass."""

    def __init__(self) -> None:
        #: The usual query's statements (one term of one fragment: a CJK word), built once per
        #: order and narrowing: their construction cost as much as running them.
        self._single: dict[tuple[str, str | None], Select[Any]] = {}

    @abc.abstractmethod
    def matches(self, pattern: str | sa.BindParameter[Any]) -> ColumnElement[bool]:
        """``content`` matches the LIKE ``pattern`` (``\\`` escapes)."""

    @abc.abstractmethod
    def statement(
        self,
        predicates: Sequence[ColumnElement[bool]],
        sort: str,
        candidates: cjk.Candidates | None,
    ) -> Select[Any]:
        """The page of matches of ``predicates`` in ``sort`` order (bound ``sub_limit`` and
        ``sub_offset``) with the contract's columns and the context columns."""

    def unpacker(self, conn: Connection) -> Unpack:
        """How the context columns read back (:func:`.hits.context_columns`): UTF-8."""
        return unpack_utf8

    def predicate(self, items: Sequence[Item]) -> ColumnElement[bool]:
        """The query as LIKE/ILIKE predicates, with FTS5's precedence."""

        def leaf(term: Term) -> ColumnElement[bool]:
            patterns = ["%" + escape_like(piece) + "%" for piece in term.pieces]
            return and_(*(self.matches(p) for p in patterns))

        def all_of(parts: list[ColumnElement[bool]]) -> ColumnElement[bool]:
            return and_(*parts)

        def any_of(parts: list[ColumnElement[bool]]) -> ColumnElement[bool]:
            return or_(*parts)

        return fold(items, leaf, all_of, any_of, not_)

    def _single_predicate(self) -> ColumnElement[bool]:
        """One fragment, pattern bound (NULL content never matches LIKE)."""
        return self.matches(sa.bindparam("pattern", type_=sa.Text))

    def _single_statement(self, sort: str, kind: str | None) -> Select[Any]:
        key = (sort, kind)
        statement = self._single.get(key)
        if statement is None:
            statement = self.statement([self._single_predicate()], sort, cjk.candidates(kind))
            self._single[key] = statement
        return statement

    def find(
        self,
        conn: Connection,
        query: Query,
        filters: Filters,
        page: Page,
        *,
        within: str | None = None,
    ) -> list[Hit]:
        """The page of matches, with snippets and context. ``within`` narrows the rows to the
        CJK index's candidates (:func:`.cjk.restriction`)."""
        items = query.items
        params: dict[str, Any] = page.params("sub")
        kind = None if within is None else ("all" if within == cjk.ALL_CJK else "match")
        if kind == "match":
            params["cjk_query"] = within
        predicates = filters.predicates()
        term = items[0] if len(items) == 1 else None
        if isinstance(term, Term) and len(term.pieces) == 1:
            params["pattern"] = "%" + escape_like(term.pieces[0]) + "%"
            if not predicates:  # built once: run on the driver
                statement = self._single_statement(page.sort, kind)
                rows = fastpath.rows(conn, statement, params)
            else:
                statement = self.statement(
                    [self._single_predicate(), *predicates], page.sort, cjk.candidates(kind)
                )
                rows = dicts(conn.execute(statement, params))
        else:
            statement = self.statement(
                [M.c.content.is_not(None), self.predicate(items), *predicates],
                page.sort,
                cjk.candidates(kind),
            )
            rows = dicts(conn.execute(statement, params))
        pieces = positive_pieces(items)
        for row in rows:
            row["snippet"] = substring_snippet(row["snippet"] or "", pieces)
        return fold_contexts(rows, self.unpacker(conn))


def _bounds() -> tuple[sa.BindParameter[int], sa.BindParameter[int]]:
    limit = sa.bindparam("sub_limit", type_=sa.BigInteger)
    offset = sa.bindparam("sub_offset", type_=sa.BigInteger)
    return limit, offset


class SqliteSubstring(Substring):
    def unpacker(self, conn: Connection) -> Unpack:
        """In the file's encoding (:func:`sqlite_octets` counts its bytes)."""
        return stored.of(conn).unpack

    def matches(self, pattern: str | sa.BindParameter[Any]) -> ColumnElement[bool]:
        return M.c.content.like(pattern, escape="\\")

    def statement(
        self,
        predicates: Sequence[ColumnElement[bool]],
        sort: str,
        candidates: cjk.Candidates | None,
    ) -> Select[Any]:
        """The page of ids is cut first and the outer statement computes the columns (content,
        same-session context) for its rows only: a sorter fed whole rows would run the context
        seeks and copy the content for every match.

        From the CJK index's ``candidates``, ``rank`` means newest stored first (by id): the
        index yields its rows in that order, so the page stops after ``limit`` verified matches
        instead of sorting them all by timestamp (ids follow time, except for imported
        messages)."""
        limit, offset = _bounds()
        direction = sa.asc if sort == "oldest" else sa.desc
        matching = M.join(S, S.c.id == M.c.session_id)
        by_id = candidates is not None and sort == "rank"
        if candidates is not None:
            matching = candidates.source.join(M, M.c.id == candidates.id).join(
                S, S.c.id == M.c.session_id
            )
            predicates = [*predicates, *candidates.where]
        order: tuple[Any, ...] = (
            (candidates.id.desc(),)
            if by_id and candidates is not None
            else (direction(M.c.timestamp), direction(M.c.id))
        )
        page = (
            select(M.c.id, M.c.timestamp)
            .select_from(matching)
            .where(*predicates)
            .order_by(*order)
            .limit(limit)
            .offset(offset)
            .subquery("page")
        )
        outer = (
            (page.c.id.desc(),) if by_id else (direction(page.c.timestamp), direction(page.c.id))
        )
        return (
            select(*columns(M.c.content), *context_columns(sqlite_octets))
            .select_from(page.join(M, M.c.id == page.c.id).join(S, S.c.id == M.c.session_id))
            .order_by(*outer)
        )


class PostgresSubstring(Substring):
    def matches(self, pattern: str | sa.BindParameter[Any]) -> ColumnElement[bool]:
        return M.c.content.ilike(pattern, escape="\\")

    def statement(
        self,
        predicates: Sequence[ColumnElement[bool]],
        sort: str,
        candidates: cjk.Candidates | None,
    ) -> Select[Any]:
        """The page first (sessions joined there only for a source filter), then the columns
        and the context seeks for its rows: one statement. (No CJK index: ILIKE is served by
        the trigram index when pg_trgm is there.)"""
        assert candidates is None, "PostgreSQL has no CJK index to start from"
        limit, offset = _bounds()
        direction = sa.asc if sort == "oldest" else sa.desc
        matching = M.join(S, S.c.id == M.c.session_id)
        touches_sessions = any(
            S in sa.sql.util.find_tables(p, check_columns=True) for p in predicates
        )
        page = (
            select(M.c.id, M.c.timestamp)
            .select_from(matching if touches_sessions else M)
            .where(*predicates)
            .order_by(direction(M.c.timestamp), direction(M.c.id))
            .limit(limit)
            .offset(offset)
            .subquery("page")
        )
        return (
            select(*columns(M.c.content), *context_columns(func.octet_length))
            .select_from(page.join(M, M.c.id == page.c.id).join(S, S.c.id == M.c.session_id))
            .order_by(direction(page.c.timestamp), direction(page.c.id))
        )


def sqlite_octets(text: ColumnElement[Any]) -> ColumnElement[Any]:
    """A text's length in the bytes the SQLite file stores it in (``length()`` of it as a
    BLOB): UTF-8, or UTF-16 (:mod:`.stored`)."""
    return func.length(sa.cast(text, sa.LargeBinary))
