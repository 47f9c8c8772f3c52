"""PostgreSQL's full-text search: a tsquery against the stored, GIN-indexed tsvector, in ONE
statement per page: ranked by ``ts_rank`` among the newest RANK_WINDOW matches, with
``ts_headline`` for short contents and the same-session context seeks for the page's rows
only.

The stored tsvector holds a message's first 200,000 characters; a longer message's whole text
is also indexed in chunks (``message_text_chunks``). The statement unions the two: the query
holds for a long message when it holds over the union of its chunks' words, evaluated per term
(a term in one chunk, another in the next: still an AND match; a NOT term anywhere: no match),
and a long message found through its chunks ranks by its best chunk."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select, Subquery
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
#: The same column of the message a long match joins, to leave it to the stored column's side.
_HEAD_VECTOR: ColumnClause[Any] = sa.literal_column(f"head.{ddl.PG_TSV_COLUMN}")
#: The chunks of long messages (the migrations own the table, like the column above). A Table
#: of its own MetaData, not the models': a placement's schema_translate_map names it by schema
#: like the others (a lightweight ``sa.table`` would stay unqualified).
_CHUNKS = sa.Table(
    ddl.PG_CHUNK_TABLE,
    sa.MetaData(),
    sa.Column("message_id", sa.BigInteger, primary_key=True),
    sa.Column("chunk_no", sa.Integer, primary_key=True),
    sa.Column("tsv", postgresql.TSVECTOR),
)
_PG_HEADLINE = "StartSel=>>>, StopSel=<<<, MaxWords=35, MinWords=15"
_PG_EDGE_CHARS = 400  # how much of each end of the content tells whether the headline is cut
#: How much of a content PostgreSQL returns for its snippet: a match past it shows the start.
_PG_CONTENT_CHARS = 1 << 20


def _operand(term: Term) -> str:
    """One term as a quoted ``to_tsquery`` operand (``'...':*`` for a prefix)."""
    quoted = "'" + term.words.replace("\\", "\\\\").replace("'", "''") + "'"
    return quoted + ":*" if term.prefix else quoted


def _group(joiner: str) -> Callable[[list[str]], str]:
    return lambda parts: parts[0] if len(parts) == 1 else "(" + joiner.join(parts) + ")"


def tsquery(items: list[Item]) -> str:
    """The query as a ``to_tsquery`` string of quoted operands (``'...':*`` for prefixes)."""
    return fold(items, _operand, _group(" & "), _group(" | "), lambda part: "!" + part)


def long_text_params(items: list[Item]) -> dict[str, Any]:
    """What the chunk side of the statement binds: ``pg_terms``, each term's own tsquery (in
    the query's order) and ``pg_negated``, whether a NOT precedes it; ``pg_shape``, the query
    over markers standing for them (``'t1' & !'t2'``), held against the markers of the terms
    a message's chunks contain; and ``pg_positive``, the terms not negated ORed, which a
    matching message must contain (every alternative of a query starts with a term that is
    not negated)."""
    terms: list[str] = []
    negated = _negated_terms(items)
    flags: list[bool] = []

    def marker(term: Term) -> str:
        terms.append(_operand(term))
        flags.append(id(term) in negated)
        return f"'t{len(terms)}'"

    shape = fold(items, marker, _group(" & "), _group(" | "), lambda part: "!" + part)
    wanted = [_operand(t) for t in items if isinstance(t, Term) and id(t) not in negated]
    return {
        "pg_terms": terms,
        "pg_negated": flags,
        "pg_shape": shape,
        "pg_positive": " | ".join(wanted),
    }


def _negated_terms(items: list[Item]) -> set[int]:
    """The ids of the terms right after a NOT (the query's only negation)."""
    found: set[int] = set()
    negated = False
    for item in items:
        if isinstance(item, str):
            negated = item == "NOT"
            continue
        if negated:
            found.add(id(item))
        negated = False
    return found


def negates(items: list[Item]) -> bool:
    """Whether the query has a NOT: then the first 200,000 characters cannot decide a long
    message (the negated word may come later) and only its chunks do."""
    return any(item == "NOT" for item in items)


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
        rows = full_text_rows(conn, terms, filters, page)
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


def full_text_rows(
    conn: Connection, query_items: list[Item], filters: Filters, page: Page
) -> list[Hit]:
    """One page of full-text hits in ONE statement: the contract's columns, the content's first
    _PG_CONTENT_CHARS (as ``snippet``), ``headline`` (ts_headline, for short contents only) and
    the same-session context."""
    statement = _full_text_statement(page.sort, *filters.shape, negates(query_items))
    params = {
        "tsquery": tsquery(query_items),
        "pg_window": page.window(),
        "pg_upto": page.limit + page.offset,
        **long_text_params(query_items),
        **page.params("pg"),
        **filters.params("pg"),
    }
    return fold_contexts(dicts(conn.execute(statement, params)))


def _long_matches(query: ColumnElement[Any], negating: bool, ranked: bool) -> Subquery:
    """The long messages the query matches through their chunks, with their rank (their best
    chunk's ``ts_rank``). Candidates come off the chunks' GIN index (a chunk holding a term
    that is not negated); each is kept when the query holds over the markers of the terms its
    chunks hold. Without a NOT, a message the stored column matches is left to that side."""
    positive = func.to_tsquery(_PG_CONFIG, sa.bindparam("pg_positive", type_=sa.Text))
    candidates = (
        select(_CHUNKS.c.message_id)
        .where(_CHUNKS.c.tsv.op("@@")(positive))
        .distinct()
        .subquery("candidates")
    )
    chunk = _CHUNKS.alias("chunk")
    terms = (
        sa.func.unnest(
            sa.bindparam("pg_terms", type_=postgresql.ARRAY(sa.Text)),
            sa.bindparam("pg_negated", type_=postgresql.ARRAY(sa.Boolean)),
        )
        .table_valued("term", "negated", with_ordinality="n")
        .render_derived(name="terms")
    )
    term_query = func.to_tsquery(_PG_CONFIG, terms.c.term)
    in_a_chunk = (
        select(chunk.c.message_id)
        .where(chunk.c.message_id == candidates.c.message_id, chunk.c.tsv.op("@@")(term_query))
        .correlate(candidates, terms)
        .exists()
    )
    # A term the parser finds no word in ('²') is dropped from the stored column's query
    # (an AND without it): its marker is one that makes its place true.
    wordless = func.numnode(term_query) == 0
    held = (
        select(sa.literal("t") + sa.cast(terms.c.n, sa.Text))
        .select_from(terms)
        .where(
            sa.or_(
                sa.and_(wordless, sa.not_(terms.c.negated)),
                sa.and_(sa.not_(wordless), in_a_chunk),
            )
        )
    )
    markers = func.array_to_tsvector(sa.func.array(held.correlate(candidates).scalar_subquery()))
    shape = sa.cast(sa.bindparam("pg_shape", type_=sa.Text), postgresql.TSQUERY)
    best = _CHUNKS.alias("best")
    rank = (
        select(func.max(func.ts_rank(best.c.tsv, query)))
        .where(best.c.message_id == candidates.c.message_id)
        .scalar_subquery()
    )
    criteria: list[ColumnElement[bool]] = [markers.op("@@")(shape)]
    found = select(candidates.c.message_id.label("id")).select_from(candidates)
    if ranked:
        found = found.add_columns(rank.label("rank"))
    if not negating:
        head = M.alias("head")
        found = found.join(head, head.c.id == candidates.c.message_id)
        criteria.append(sa.not_(_HEAD_VECTOR.op("@@")(query)))
    return found.where(*criteria).subquery("long_matches")


@functools.cache
def _full_text_statement(
    sort: str, by_source: bool, excluding: bool, by_role: bool, negating: bool
) -> Select[Any]:
    """Built once per order, filter shape and negation. The matches come off the GIN indexes
    alone (rank: the newest RANK_WINDOW by id, then ``ts_rank`` of those); ``sessions`` is
    joined there only for a source filter, otherwise for the page's rows alone; ts_headline
    and the context seeks run for the page's rows only."""
    query = func.to_tsquery(_PG_CONFIG, sa.bindparam("tsquery", type_=sa.Text))
    filtering: list[ColumnElement[bool]] = []
    if by_source:
        filtering.append(S.c.source.in_(sa.bindparam("pg_sources", expanding=True)))
    if excluding:
        filtering.append(S.c.source.not_in(sa.bindparam("pg_excluded", expanding=True)))
    if by_role:
        filtering.append(M.c.role.in_(sa.bindparam("pg_roles", expanding=True)))
    criteria = [_PG_VECTOR.op("@@")(query), *filtering]
    if negating:  # a long message is decided by its chunks alone
        criteria.append(
            ~select(_CHUNKS.c.message_id).where(_CHUNKS.c.message_id == M.c.id).exists()
        )
    matching = M.join(S, S.c.id == M.c.session_id) if by_source or excluding else M
    long_matches = _long_matches(query, negating, ranked=sort == "rank")
    long_rows = long_matches.join(M, M.c.id == long_matches.c.id)
    if by_source or excluding:
        long_rows = long_rows.join(S, S.c.id == M.c.session_id)
    limit = sa.bindparam("pg_limit", type_=sa.BigInteger)
    offset = sa.bindparam("pg_offset", type_=sa.BigInteger)
    # Each side is cut to what the page can use before the union (the stored column's side
    # exactly as a plain search would be: ts_rank computed after its top-N sort), so the union
    # carries at most twice that, never every match of a common word.
    if sort == "rank":
        window_size = sa.bindparam("pg_window", type_=sa.BigInteger)
        both = sa.union_all(
            select(M.c.id, func.ts_rank(_PG_VECTOR, query).label("rank"), M.c.timestamp)
            .select_from(matching)
            .where(*criteria)
            .order_by(M.c.id.desc())
            .limit(window_size),
            select(M.c.id, long_matches.c.rank, M.c.timestamp)
            .select_from(long_rows)
            .where(*filtering)
            .order_by(M.c.id.desc())
            .limit(window_size),
        ).subquery("matches")
        window = (
            select(both.c.id, both.c.rank, both.c.timestamp)
            .order_by(both.c.id.desc())
            .limit(window_size)
            .subquery("window")
        )
        found = select(window.c.id, window.c.rank, window.c.timestamp).order_by(
            window.c.rank.desc(), window.c.id.desc()
        )
    else:
        direction = sa.desc if sort == "newest" else sa.asc
        upto = sa.bindparam("pg_upto", type_=sa.BigInteger)
        both = sa.union_all(
            select(M.c.id, M.c.timestamp)
            .select_from(matching)
            .where(*criteria)
            .order_by(direction(M.c.timestamp), direction(M.c.id))
            .limit(upto),
            select(M.c.id, M.c.timestamp)
            .select_from(long_rows)
            .where(*filtering)
            .order_by(direction(M.c.timestamp), direction(M.c.id))
            .limit(upto),
        ).subquery("matches")
        found = select(both.c.id, both.c.timestamp).order_by(
            direction(both.c.timestamp), direction(both.c.id)
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
