"""SQLite's full-text search: FTS5 MATCH over ``messages_fts``, BM25 for ``rank``.

The page is cut first (for ``rank``, among the newest RANK_WINDOW matches, BM25 being exact
below that), then snippets are made for its rows only: FTS5's own for short contents, a
bounded one for long contents (read through blob handles only as far as the snippet needs);
then the same-session context, in one more query. The original store's query runs when FTS5
can read it; when FTS5 rejects it, every term goes quoted.
"""

from __future__ import annotations

import functools
import logging
import re
import sqlite3
from typing import Any

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnClause, ColumnElement

from hermes_store.engine import fastpath
from hermes_store.schema import ddl
from hermes_store.search import blobs, hits, stored
from hermes_store.search.hits import CONTEXT_CHARS, Filters, Hit, Page, columns, dicts
from hermes_store.search.query import QUOTED_PHRASE, Item, Query
from hermes_store.search.snippets import SNIPPET_INLINE_CHARS, bounded_snippet, term_patterns
from hermes_store.search.substring import sqlite_octets
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.uow.interrupts import uninterrupted

log = logging.getLogger(__name__)

_FTS = sa.table(ddl.FTS_TABLE, sa.column("rowid"), sa.column("rank"))
_FTS_MATCH = sa.literal_column(ddl.FTS_TABLE).op("MATCH")
_FTS_SNIPPET: ColumnClause[Any] = sa.literal_column(
    f"snippet({ddl.FTS_TABLE}, 0, '>>>', '<<<', '...', 40)"
)
#: SQLite's length limit while a page's neighbours are loaded in SQL (see :func:`_contexts`).
NEIGHBOUR_LOAD_LIMIT = 1 << 20
#: How the sqlite3 module says a text it read is not UTF-8 (it has no error code for it).
_NOT_UTF8 = "Could not decode to UTF-8"
_FTS_QUERY_ERRORS = ("fts5:", "no such column", "unterminated string", "unknown special query")
# FTS5 barewords: ASCII letters, digits, "_", 0x1A and anything beyond ASCII; plus the spaces
# FTS5 skips and the prefix star. Anything else outside quotes is syntax (":" "-" "." ...).
_FTS5_PLAIN = re.compile(r"[A-Za-z0-9_\x1a \t\n\r*\u0080-\U0010ffff]*")


def fts5_query(items: list[Item]) -> str:
    """Every term as a quoted FTS5 phrase (``"..."*`` for prefixes): never a syntax error."""
    parts = []
    for item in items:
        if isinstance(item, str):
            parts.append(item)
        else:
            phrase = '"' + item.words.replace('"', '""') + '"'
            parts.append(phrase + "*" if item.prefix else phrase)
    return " ".join(parts)


class Fts5:
    """The full-text searcher of a SQLite store."""

    def find(
        self, conn: Connection, query: Query, filters: Filters, page: Page
    ) -> list[Hit] | None:
        """The page of matches with snippets and context; None when no term has anything to
        index. Syntax never reaches the caller: a query FTS5 cannot parse runs again with every
        term quoted. Errors other than FTS5 syntax propagate."""
        read: dict[int, str] = {}
        text = stored.of(conn)
        rows = self._page(conn, query, filters, page, text, read)
        if rows:
            contexts = _contexts(conn, [row["id"] for row in rows], read, text)
            for row in rows:
                row["context"] = contexts.get(row["id"], [])
        return rows

    def matches_any(self, conn: Connection, query: Query, filters: Filters, sort: str) -> bool:
        """Whether the query has any match at all (a page past the end is empty too)."""
        return bool(self._page(conn, query, filters, Page(1, 0, sort), stored.of(conn)))

    def _page(
        self,
        conn: Connection,
        query: Query,
        filters: Filters,
        page: Page,
        text: stored.Stored,
        read: dict[int, str] | None = None,
    ) -> list[Hit] | None:
        """:meth:`find` without the context; ``read`` gets the start of each row's content (its
        first CONTEXT_CHARS characters), read for the snippet anyway; ``text``: how the file
        stores it."""
        terms = query.indexable()
        if terms is None:
            return None
        predicates = tuple(filters.predicates())
        statement = _fts_statement(page.sort, predicates)
        patterns = term_patterns(terms)

        def run(params: dict[str, Any]) -> list[Hit]:
            if predicates:
                rows = dicts(conn.execute(statement, params))
            else:
                rows = fastpath.rows(conn, statement, params)  # built once: run on the driver
            _add_snippets(conn, rows, params["fts_query"], patterns, text, read)
            return rows

        params = {**page.params("fts"), "fts_window": page.window()}
        quoted = fts5_query(terms)
        sanitized = query.sanitized
        rows: list[Hit] | None = None
        if quoted != sanitized and _FTS5_PLAIN.fullmatch(QUOTED_PHRASE.sub(" ", sanitized)):
            try:  # the original store's query, when FTS5 can read it
                rows = run({"fts_query": sanitized, **params})
            except sa.exc.OperationalError as error:
                if not str(error.orig).startswith(_FTS_QUERY_ERRORS):
                    raise
                log.debug(
                    "FTS5 rejected %r (%s); retrying with quoted terms", sanitized, error.orig
                )
        if rows is None:
            try:
                rows = run({"fts_query": quoted, **params})
            except sa.exc.OperationalError as error:
                if not str(error.orig).startswith(_FTS_QUERY_ERRORS):
                    raise
                # Quoted phrases cannot be a syntax error; if FTS5 still refuses, say so and
                # let the substring search answer instead of failing the caller.
                log.warning("FTS5 rejected the quoted query %r: %s", quoted, error.orig)
                return None
        return rows


def _add_snippets(
    conn: Connection,
    rows: list[Hit],
    fts_query: str,
    patterns: list[re.Pattern[str]],
    text: stored.Stored,
    read: dict[int, str] | None,
) -> None:
    """FTS5's own snippet for the contents of at most SNIPPET_INLINE_CHARS, a bounded one
    (:func:`bounded_snippet`) for longer ones, whose text is read only as far as it needs.
    The start of each content goes to ``read`` (the match's own context: no second read)."""
    raw = blobs.driver(conn)
    short: list[Hit] = []
    for row in rows:
        prefix, complete = blobs.read_content(raw, row["id"], patterns, text)
        if read is not None:
            read[row["id"]] = prefix[:CONTEXT_CHARS]  # read from the start, at least that far
        if complete and len(prefix) <= SNIPPET_INLINE_CHARS:
            row["snippet"] = prefix
            short.append(row)
        else:
            row["snippet"] = bounded_snippet(prefix, patterns, complete=complete)
    if not short:
        return
    ids = [row["id"] for row in short]
    try:
        found = fastpath.rows(
            conn,
            _fts_snippet_statement(),
            {"fts_query": fts_query, "ids": ids, "lo": min(ids), "hi": max(ids)},
            expanding=["ids"],
        )
    except sa.exc.DBAPIError as error:
        if _NOT_UTF8 not in str(error.orig):
            raise
        # A content another program stored as bytes that are not UTF-8: FTS5's snippet hands
        # them back raw, which sqlite3 cannot decode. The page's short snippets are made from
        # what the blob handles read, undecodable bytes replaced, as the long ones are.
        log.debug("search: a short snippet is made from its blob (%s)", error.orig)
        for row in short:
            row["snippet"] = bounded_snippet(row["snippet"], patterns, complete=True)
        return
    made = {row["id"]: row["snippet"] for row in found}
    for row in rows:
        if row["id"] in made:
            row["snippet"] = made[row["id"]]


def _fts_statement(sort: str, filters: tuple[ColumnElement[bool], ...]) -> Select[Any]:
    if not filters:
        return _fts_statement_unfiltered(sort)
    return _build_fts_statement(sort, filters)


@functools.cache
def _fts_statement_unfiltered(sort: str) -> Select[Any]:
    """Built once per order: its construction cost more than a rare word's search."""
    return _build_fts_statement(sort, ())


def _build_fts_statement(sort: str, filters: tuple[ColumnElement[bool], ...]) -> Select[Any]:
    """The page of ids first (for ``rank``: the newest RANK_WINDOW matches by rowid, which FTS5
    yields in order, then their ``rank``), then the columns and snippets of its rows."""
    match = _FTS_MATCH(sa.bindparam("fts_query"))
    limit = sa.bindparam("fts_limit", type_=sa.BigInteger)
    offset = sa.bindparam("fts_offset", type_=sa.BigInteger)
    source = _FTS.join(M, M.c.id == _FTS.c.rowid)
    if filters:
        source = source.join(S, S.c.id == M.c.session_id)
    if sort == "rank":
        window = (
            select(_FTS.c.rowid.label("id"), _FTS.c.rank.label("score"))
            .select_from(source if filters else _FTS)
            .where(match, *filters)
            .order_by(_FTS.c.rowid.desc())
            .limit(sa.bindparam("fts_window", type_=sa.BigInteger))
            .subquery("window")
        )
        order: tuple[Any, ...] = (window.c.score, window.c.id)
        found = select(window.c.id, window.c.score).order_by(*order)
    else:
        direction = sa.desc if sort == "newest" else sa.asc
        found = (
            select(M.c.id, M.c.timestamp)
            .select_from(source)
            .where(match, *filters)
            .order_by(direction(M.c.timestamp), direction(M.c.id))
        )
    paged = found.limit(limit).offset(offset).subquery("page")
    if sort == "rank":
        outer_order: tuple[Any, ...] = (paged.c.score, paged.c.id)
    else:
        direction = sa.desc if sort == "newest" else sa.asc
        outer_order = (direction(paged.c.timestamp), direction(paged.c.id))
    # No content: it is read afterwards through blob handles, only as far as the snippet needs
    # (SQLite loads a whole value for any function of it, 50 MB for a pasted log).
    return (
        select(*columns(sa.null()))
        .select_from(paged.join(M, M.c.id == paged.c.id).join(S, S.c.id == M.c.session_id))
        .order_by(*outer_order)
    )


@functools.cache
def _fts_snippet_statement() -> Select[Any]:
    """FTS5's own snippet for the given rows: one pass over the match's rowid range, which
    FTS5 serves (``rowid + 0`` keeps the id list from becoming one fresh seek per id, each
    re-opening a common word's whole doclist: 20 ms a page at 1M messages, 0.4 ms this way)."""
    rowid = _FTS.c.rowid
    return select(rowid.label("id"), _FTS_SNIPPET.label("snippet")).where(
        _FTS_MATCH(sa.bindparam("fts_query")),
        rowid >= sa.bindparam("lo", type_=sa.Integer),
        rowid <= sa.bindparam("hi", type_=sa.Integer),
        (rowid + 0).in_(sa.bindparam("ids", expanding=True)),
    )


# -- same-session context -------------------------------------------------------------------------


def _contexts(
    conn: Connection, ids: list[int], read: dict[int, str], text: stored.Stored
) -> dict[int, list[dict[str, str]]]:
    """Previous message, the match and next message of the SAME session, by (timestamp, id),
    for a whole page, in one query: the seeks (on idx_messages_session, which covers timestamp
    and the rowid) return each neighbour's role and the first CONTEXT_CHARS characters of its
    content, and the match's own start comes from ``read`` (read for its snippet).

    Any function of a content loads all of it (50 MB for a pasted log), so the query runs with
    SQLite's length limit lowered to NEIGHBOUR_LOAD_LIMIT bytes: a longer neighbour (or one
    that is not valid UTF-8) fails it at once, unread, and that page's contexts are read
    through blob handles instead, each only as far as it needs."""
    raw = blobs.driver(conn)
    rows = _neighbours_loaded(conn, raw, ids)
    if rows is None:
        rows = fastpath.rows(conn, _neighbour_ids_statement(), {"ids": ids}, expanding=["ids"])
        for row in rows:
            row["context_previous"] = _read_neighbour(raw, row["context_previous"], text)
            row["context_next"] = _read_neighbour(raw, row["context_next"], text)
    out: dict[int, list[dict[str, str]]] = {}
    for row in rows:
        row["context_content"] = read[row["id"]]  # every match's start, read for its snippet
        out[row["id"]] = hits.folded_context(row, text.unpack)
    return out


def _neighbours_loaded(
    conn: Connection, raw: sqlite3.Connection, ids: list[int]
) -> list[Hit] | None:
    """The page's neighbours, role and start, in one query; None when one of them is longer
    than NEIGHBOUR_LOAD_LIMIT bytes or not valid UTF-8 (refused before it is loaded)."""
    limit = raw.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)

    def restore() -> None:
        raw.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limit)

    try:
        raw.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, min(limit, NEIGHBOUR_LOAD_LIMIT))
        return fastpath.rows(conn, _neighbours_statement(), {"ids": ids}, expanding=["ids"])
    except sa.exc.DBAPIError as error:
        code = getattr(error.orig, "sqlite_errorcode", None)
        if code != sqlite3.SQLITE_TOOBIG and _NOT_UTF8 not in str(error.orig):
            raise
        log.debug("search: a neighbour is read through a blob handle (%s)", code or "not UTF-8")
        return None
    finally:
        uninterrupted(restore)  # a pooled connection never keeps the lowered limit


def _read_neighbour(raw: sqlite3.Connection, packed: str | None, text: stored.Stored) -> str | None:
    """``<id>:<role>`` as :func:`~hermes_store.search.hits.context_columns` packs a neighbour
    (``<bytes of role>:<role><start>``), its start read through a blob handle."""
    if packed is None:
        return None
    number, _, role = packed.partition(":")
    start = blobs.content_prefix(raw, int(number), CONTEXT_CHARS, text)
    return f"{text.octets(role)}:{role}{start}"


@functools.cache
def _neighbours_statement() -> Select[Any]:
    """Per match: its role, and its previous and next message of the same session packed as
    :func:`~hermes_store.search.hits.context_columns` packs them (role and start)."""
    previous, _, following = hits.context_columns(sqlite_octets)
    return select(M.c.id, M.c.role, previous, following).where(
        M.c.id.in_(sa.bindparam("ids", expanding=True))
    )


@functools.cache
def _neighbour_ids_statement() -> Select[Any]:
    """Per match: its role and its previous and next message of the same session, each as
    ``<id>:<role>`` (one seek gives both)."""
    near, same_session, before, after = hits.neighbours()
    packed = sa.cast(near.c.id, sa.Text) + ":" + near.c.role
    previous = (
        select(packed)
        .where(same_session, near.c.timestamp <= M.c.timestamp, before)
        .order_by(near.c.timestamp.desc(), near.c.id.desc())
        .limit(1)
        .correlate(M)
        .scalar_subquery()
    )
    following = (
        select(packed)
        .where(same_session, near.c.timestamp >= M.c.timestamp, after)
        .order_by(near.c.timestamp, near.c.id)
        .limit(1)
        .correlate(M)
        .scalar_subquery()
    )
    return select(
        M.c.id, M.c.role, previous.label("context_previous"), following.label("context_next")
    ).where(M.c.id.in_(sa.bindparam("ids", expanding=True)))
