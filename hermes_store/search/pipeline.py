"""Full-text search over ``messages.content`` on SQLite FTS5 and PostgreSQL.

The original store answered any FTS5 syntax error with ``[]``, so ``TODO: fix`` or
``src/app/main.py`` found nothing. Here every query goes through the original store's
sanitizer, is parsed once into terms and AND/OR/NOT operators, and is rendered for each
engine from that parse: an FTS5 query of quoted phrases, a PostgreSQL tsquery of quoted
operands, or a substring (LIKE/ILIKE) predicate. The user's text only ever travels as a bound
parameter. The substring predicate is the fallback for CJK text (which neither tokenizer
splits into words) and for punctuation-heavy terms.
"""

from __future__ import annotations

import codecs
import functools
import logging
import re
import sqlite3
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import and_, func, not_, or_, select
from sqlalchemy.engine import Connection, Result
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnClause, ColumnElement

from hermes_store.engine import fastpath
from hermes_store.errors import InvalidInputError
from hermes_store.schema import ddl, fulltext
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S

_INT64_MAX = 2**63 - 1

log = logging.getLogger(__name__)

CONTEXT_CHARS = 200
#: Past these, queries are clipped: SQLite refuses LIKE patterns over 50,000 bytes and
#: expressions deeper than 1,000 terms; no real query comes near either.
MAX_QUERY_CHARS = 10_000
MAX_ITEMS = 64
MAX_PIECES = 16
SUBSTRING_SNIPPET_CHARS = 120
OPERATORS = frozenset({"AND", "OR", "NOT"})

# -- the original store's sanitizer ----------------------------------------------------------

_QUOTED_PHRASE = re.compile(r'"[^"]*"')
_UNMATCHED_SPECIAL = re.compile(r'[+{}()"^]')
_STAR_RUN = re.compile(r"\*+")
_LEADING_STAR = re.compile(r"(^|\s)\*")
_LEADING_OPERATOR = re.compile(r"^(?:AND|OR|NOT)(?=\s|$)\s*")
_TRAILING_OPERATOR = re.compile(r"(?:^|\s+)(?:AND|OR|NOT)$")
_JOINED_TERM = re.compile(r"\b(\w+(?:[.-]\w+)+)\b")
_PLACEHOLDER = re.compile("\x00Q(\\d+)\x00")

_CJK_RANGES = (
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0x3400, 0x4DBF),  # extension A
    (0x20000, 0x2A6DF),  # extension B
    (0x3000, 0x303F),  # CJK symbols and punctuation
    (0x3040, 0x309F),  # hiragana
    (0x30A0, 0x30FF),  # katakana
    (0xAC00, 0xD7AF),  # hangul syllables
)


def sanitize_fts5_query(query: str) -> str:
    """The original store's six steps, so user text cannot break FTS5's grammar in the common cases.

    (1) protect balanced ``"..."`` phrases; (2) unmatched ``+ { } ( ) " ^`` become spaces;
    (3) collapse ``*`` runs and drop a ``*`` that starts a term; (4) drop dangling AND/OR/NOT at
    either end; (5) quote terms joined by ``-`` or ``.``; (6) restore the phrases and strip.
    NUL characters become spaces first: neither engine can take them.
    """
    phrases: list[str] = []

    def protect(match: re.Match[str]) -> str:
        phrases.append(match.group(0))
        return f"\x00Q{len(phrases) - 1}\x00"

    text = _QUOTED_PHRASE.sub(protect, query.replace("\x00", " "))
    text = _UNMATCHED_SPECIAL.sub(" ", text)
    text = _STAR_RUN.sub("*", text)
    text = _LEADING_STAR.sub(r"\1", text)
    previous = None
    while previous != text:  # "a AND OR" needs two rounds
        previous = text
        text = _LEADING_OPERATOR.sub("", text.strip())
        text = _TRAILING_OPERATOR.sub("", text).strip()
    text = _JOINED_TERM.sub(r'"\1"', text)
    text = _PLACEHOLDER.sub(lambda m: phrases[int(m.group(1))], text)
    return text.strip()


def contains_cjk(text: str) -> bool:
    """The original store's test: any Chinese character, Japanese kana, Korean hangul or CJK
    punctuation."""
    return any(lo <= ord(ch) <= hi for ch in text for lo, hi in _CJK_RANGES)


def unsegmented(text: str) -> bool:
    """Whether any character is of a script written without spaces (CJK, Thai, Khmer...: the
    ranges the CJK index's triggers test), so words are only findable as substrings."""
    return any(lo <= ord(ch) <= hi for ch in text for lo, hi in ddl.UNSEGMENTED_RANGES)


# -- one parse of the sanitized query, three renderings --------------------------------------------


@dataclass(frozen=True)
class Term:
    """One phrase of the query.

    ``words`` is what the full-text engines tokenize (quotes and ``*`` are separators there);
    ``pieces`` are the literal fragments a substring match needs, each a verbatim slice of what
    the user typed, so text the tokenizers cannot see (``!=``, ``->``, new scripts) is findable.
    """

    words: str
    pieces: tuple[str, ...]
    prefix: bool

    @property
    def indexable(self) -> bool:
        """Whether a tokenizer can make a token of it (letters, digits, private use)."""
        return any(_word_character(ch) for ch in self.words)


def _word_character(ch: str) -> bool:
    category = unicodedata.category(ch)
    return category[0] in "LN" or category == "Co"


Item = Term | str  # a str item is one of OPERATORS
T = TypeVar("T")


def parse_query(sanitized: str) -> list[Item]:
    """Split a sanitized query into terms and operators (whitespace inside quotes is kept)."""
    items: list[Item] = []
    for token in _tokens(sanitized):
        if token in OPERATORS:
            items.append(token)
            continue
        # A token of nothing but quotes and stars (a literal '""') is its own piece.
        pieces = tuple(p for p in re.split(r'["*]', token) if p.strip()) or (token,)
        words = " ".join(re.sub(r'["*]', " ", token).split())
        items.append(Term(words, pieces[:MAX_PIECES], prefix=token.endswith("*")))
    return items


def _tokens(text: str) -> list[str]:
    tokens: list[str] = []
    current: list[str] = []
    quoted = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch.isspace() and not quoted:
            if current:
                tokens.append("".join(current))
                current = []
            continue
        current.append(ch)
    if current:
        tokens.append("".join(current))
    return tokens


def well_formed(items: Sequence[Item]) -> list[Item]:
    """Drop operators with nothing on one side; of adjacent operators keep the last ("AND NOT")."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, str):
            if out and isinstance(out[-1], str):
                out[-1] = item
            elif out:
                out.append(item)
        else:
            out.append(item)
    while out and isinstance(out[-1], str):
        out.pop()
    return out


def fold(
    items: Sequence[Item],
    leaf: Callable[[Term], T],
    all_of: Callable[[list[T]], T],
    any_of: Callable[[list[T]], T],
    negate: Callable[[T], T],
) -> T:
    """Evaluate a well-formed item list with FTS5's precedence: NOT, then AND, then OR."""
    alternatives: list[T] = []
    conjunction: list[T] = []
    pending: str | None = None
    for item in items:
        if isinstance(item, str):
            pending = item
            if item == "OR":
                alternatives.append(all_of(conjunction))
                conjunction = []
            continue
        value = leaf(item)
        if pending == "NOT":  # binary: "a NOT b" is a AND NOT b
            conjunction[-1] = all_of([conjunction[-1], negate(value)])
        else:
            conjunction.append(value)
        pending = None
    alternatives.append(all_of(conjunction))
    return any_of(alternatives)


def fts5_query(items: Sequence[Item]) -> str:
    """Every term as a quoted FTS5 phrase (``"..."*`` for prefixes): never a syntax error."""
    parts = []
    for item in items:
        if isinstance(item, str):
            parts.append(item)
        else:
            phrase = '"' + item.words.replace('"', '""') + '"'
            parts.append(phrase + "*" if item.prefix else phrase)
    return " ".join(parts)


def tsquery(items: Sequence[Item]) -> str:
    """The same query as a ``to_tsquery`` string of quoted operands (``'...':*`` for prefixes)."""

    def leaf(term: Term) -> str:
        quoted = "'" + term.words.replace("\\", "\\\\").replace("'", "''") + "'"
        return quoted + ":*" if term.prefix else quoted

    def group(joiner: str) -> Callable[[list[str]], str]:
        return lambda parts: parts[0] if len(parts) == 1 else "(" + joiner.join(parts) + ")"

    return fold(items, leaf, group(" & "), group(" | "), lambda part: "!" + part)


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def substring_predicate(items: Sequence[Item], *, ilike: bool) -> ColumnElement[bool]:
    """The query as LIKE (SQLite, ASCII case-insensitive) or ILIKE (PostgreSQL) predicates."""

    def leaf(term: Term) -> ColumnElement[bool]:
        patterns = ["%" + _escape_like(piece) + "%" for piece in term.pieces]
        if ilike:
            return and_(*(M.c.content.ilike(p, escape="\\") for p in patterns))
        return and_(*(M.c.content.like(p, escape="\\") for p in patterns))

    def all_of(parts: list[ColumnElement[bool]]) -> ColumnElement[bool]:
        return and_(*parts)

    def any_of(parts: list[ColumnElement[bool]]) -> ColumnElement[bool]:
        return or_(*parts)

    return fold(items, leaf, all_of, any_of, not_)


def positive_pieces(items: Sequence[Item]) -> list[str]:
    """Fragments to highlight: those of every term that is not negated."""
    pieces: list[str] = []
    negated = False
    for item in items:
        if isinstance(item, str):
            negated = item == "NOT"
            continue
        if not negated:
            pieces.extend(item.pieces)
        negated = False
    return pieces


# -- search ---------------------------------------------------------------------------------------

#: The orders ``search_messages`` offers: ``rank`` (the contract's, best first), ``newest`` and
#: ``oldest`` (by timestamp, then id).
SORTS = ("rank", "newest", "oldest")
#: ``rank`` scores at most this many matches, the newest by id: BM25 of every match of a word in
#: a quarter of a million messages took 0.4 s at 1M. Fewer matches are ranked exactly.
RANK_WINDOW = 2_000
#: Longer contents get their snippet from a bounded window around the first match, computed
#: here: FTS5's snippet() and ts_headline() walk every occurrence (quadratic in FTS5: a 256 KB
#: log repeating the word took 50 s).
SNIPPET_INLINE_CHARS = 2_000
SNIPPET_TOKENS = 40
#: How far around the first match the bounded snippet looks (characters).
_SNIPPET_REACH = 1_000
#: At most this many trigrams of one CJK fragment go into the index query (evenly spread).
_TRIGRAMS_PER_PIECE = 6

_FTS = sa.table(ddl.FTS_TABLE, sa.column("rowid"), sa.column("rank"))
_FTS_MATCH = sa.literal_column(ddl.FTS_TABLE).op("MATCH")
_FTS_SNIPPET: ColumnClause[Any] = sa.literal_column(
    f"snippet({ddl.FTS_TABLE}, 0, '>>>', '<<<', '...', 40)"
)
_CJK = sa.table(ddl.CJK_TABLE, sa.column("rowid"))
_CJK_MATCH = sa.literal_column(ddl.CJK_TABLE).op("MATCH")
_CJK_DOCS = sa.table(ddl.CJK_DOCSIZE, sa.column("id"))
_FTS_QUERY_ERRORS = ("fts5:", "no such column", "unterminated string", "unknown special query")
# FTS5 barewords: ASCII letters, digits, "_", 0x1A and anything beyond ASCII; plus the spaces
# FTS5 skips and the prefix star. Anything else outside quotes is syntax (":" "-" "." ...).
_FTS5_PLAIN = re.compile(r"[A-Za-z0-9_\x1a \t\n\r*\u0080-\U0010ffff]*")
_ASCII_WORDS = re.compile(r'[A-Za-z0-9 \t\n\r*"]*')
_UNUSABLE = re.compile("[\x00\ud800-\udfff]")  # NUL and lone surrogates: no engine takes them
_TOKEN = re.compile(r"[^\W_]+")

_PG_CONFIG: ColumnClause[Any] = sa.literal_column("'simple'::regconfig")
# The stored tsvector column (not in the ORM models: the migrations own it), GIN-indexed.
_PG_VECTOR: ColumnClause[Any] = sa.literal_column(f"{M.name}.{ddl.PG_TSV_COLUMN}")
_PG_HEADLINE = "StartSel=>>>, StopSel=<<<, MaxWords=35, MinWords=15"
_PG_EDGE_CHARS = 400  # how much of each end of the content tells whether the headline is cut
#: How much of a content PostgreSQL returns for its snippet: a match past it shows the start.
_PG_CONTENT_CHARS = 1 << 20


def search_messages(
    conn: Connection,
    query: str,
    *,
    source_filter: Sequence[str] | None,
    exclude_sources: Sequence[str] | None,
    role_filter: Sequence[str] | None,
    limit: int,
    offset: int,
    sort: str = "rank",
) -> list[dict[str, Any]]:
    """Messages matching ``query`` in ``sort`` order, with snippet and same-session context.

    Syntax never reaches the caller: a query FTS5 cannot parse is re-run with every term quoted.
    A query with CJK (or another unsegmented script) is a substring match, so a word inside a
    longer run is found wherever it occurs; on SQLite the CJK trigram index narrows it to its
    candidates (newest first for ``rank``: substring matches carry no score). Otherwise, when
    the full-text path finds nothing at all, a substring match takes over: on SQLite for
    queries with punctuation or non-ASCII letters and for terms without letters or digits
    (``->``); on PostgreSQL always, since its parser keeps paths, e-mails and URLs whole.
    Errors other than FTS5 syntax propagate.
    """
    if sort not in SORTS:
        raise InvalidInputError(f"sort must be one of {', '.join(SORTS)}, not {sort!r}")
    limit, offset = max(0, int(limit)), max(0, int(offset))
    limit = min(limit, _INT64_MAX - offset)  # the rank window is limit + offset: a 64-bit bind
    if not query or not query.strip() or limit == 0:
        return []
    if source_filter is not None and not _listed(source_filter):
        return []
    sanitized = sanitize_fts5_query(_UNUSABLE.sub(" ", _clip(query)))
    if not sanitized:
        return []
    items = well_formed(well_formed(parse_query(sanitized))[:MAX_ITEMS])
    if not items:
        return []
    filters = _filters(source_filter, exclude_sources, role_filter)
    sqlite = conn.dialect.name == "sqlite"
    page = _Page(limit, offset, sort)
    rows: list[dict[str, Any]] | None
    cjk = unsegmented(sanitized)
    restriction = cjk_restriction(items) if cjk else None
    if cjk:
        # A word inside a longer CJK run is no token of either full-text index: the whole query
        # is a substring match, narrowed by SQLite's CJK trigram index where its terms allow
        # (a CJK part ORed with a Latin word or only negated cannot be narrowed: it scans).
        if not sqlite or not _has_cjk_index(conn):
            restriction = None  # PostgreSQL's trigram index serves ILIKE; SQLite scans
        rows = _substring_search(conn, items, filters, page, ilike=not sqlite, within=restriction)
    else:
        full_text: Callable[[_Page], list[dict[str, Any]] | None]
        if sqlite:
            full_text = functools.partial(_sqlite_full_text, conn, sanitized, items, filters)
        else:
            values = PgFilters(
                None if source_filter is None else tuple(_listed(source_filter)),
                tuple(_listed(exclude_sources or ())),
                tuple(_listed(role_filter or ())),
            )
            full_text = functools.partial(_pg_full_text, conn, sanitized, items, values)
        rows = full_text(page)
        if not rows:
            fallback = (
                rows is None  # nothing a tokenizer could index: '->', '!=', '""'
                or not sqlite
                or contains_cjk(query)
                or not _ASCII_WORDS.fullmatch(sanitized)
            )
            if offset and rows is not None and full_text(_Page(1, 0, sort)):
                fallback = False  # the full-text result set exists; this page is past its end
            if fallback:
                rows = _substring_search(conn, items, filters, page, ilike=not sqlite)
    if not rows:
        return []
    if "context" in rows[0]:  # the one PostgreSQL full-text statement carried it
        return rows
    if "context_content" in rows[0]:  # the page statement carried the context columns
        for row in rows:
            row["context"] = _folded_context(row)
        return rows
    contexts = _contexts(conn, [row["id"] for row in rows])
    for row in rows:
        row["context"] = contexts.get(row["id"], [])
    return rows


@dataclass(frozen=True)
class _Page:
    limit: int
    offset: int
    sort: str

    def params(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_limit": self.limit, f"{prefix}_offset": self.offset}


def _clip(query: str) -> str:
    """At most MAX_QUERY_CHARS, cut at a space so no half word becomes a required term."""
    if len(query) <= MAX_QUERY_CHARS:
        return query
    clipped = query[:MAX_QUERY_CHARS]
    cut = clipped.rfind(" ")
    return clipped[:cut] if cut > 0 else clipped


def _filters(
    source_filter: Sequence[str] | None,
    exclude_sources: Sequence[str] | None,
    role_filter: Sequence[str] | None,
) -> list[ColumnElement[bool]]:
    filters: list[ColumnElement[bool]] = []
    if source_filter is not None:
        filters.append(S.c.source.in_(_listed(source_filter)))
    if exclude_sources:
        filters.append(S.c.source.not_in(_listed(exclude_sources)))
    if role_filter:
        filters.append(M.c.role.in_(_listed(role_filter)))
    return filters


def _listed(values: Sequence[str]) -> list[str]:
    """A lone string means that one value, not its characters."""
    return [values] if isinstance(values, str) else list(values)


def _columns(snippet: ColumnElement[Any]) -> tuple[ColumnElement[Any], ...]:
    """The contract's result keys, in its order (``context`` is added afterwards)."""
    return (
        M.c.id,
        M.c.session_id,
        M.c.role,
        snippet.label("snippet"),
        M.c.timestamp,
        M.c.tool_name,
        S.c.source,
        S.c.model,
        S.c.started_at.label("session_started"),
    )


def _sqlite_full_text(
    conn: Connection,
    sanitized: str,
    items: list[Item],
    filters: list[ColumnElement[bool]],
    page: _Page,
) -> list[dict[str, Any]] | None:
    """FTS5 MATCH; the page is cut first (for ``rank``, among the newest RANK_WINDOW matches,
    BM25 being exact below that) and snippets are computed for its rows only. None when no term
    has anything to index."""
    terms = well_formed([i for i in items if isinstance(i, str) or i.indexable])
    if not terms:
        return None
    statement = _fts_statement(page.sort, tuple(filters))

    def run(params: dict[str, Any]) -> list[dict[str, Any]]:
        if filters:
            rows = _dicts(conn.execute(statement, params))
        else:
            rows = fastpath.rows(conn, statement, params)  # built once: run on the driver

        def engine(ids: list[int]) -> dict[int, str]:
            found = fastpath.rows(
                conn,
                _fts_snippet_statement(),
                {"fts_query": params["fts_query"], "ids": ids, "lo": min(ids), "hi": max(ids)},
                expanding=["ids"],
            )
            return {row["id"]: row["snippet"] for row in found}

        raw = _driver(conn)
        patterns = _term_patterns(terms)
        short: list[int] = []
        for row in rows:
            prefix, complete = _read_content(raw, row["id"], patterns)
            if complete and len(prefix) <= SNIPPET_INLINE_CHARS:
                row["snippet"] = prefix
                short.append(row["id"])
            else:
                row["snippet"] = bounded_snippet(prefix, patterns, complete=complete)
        made = engine(short) if short else {}
        for row in rows:
            if row["id"] in made:
                row["snippet"] = made[row["id"]]
        return rows

    params = {**page.params("fts"), "fts_window": max(RANK_WINDOW, page.limit + page.offset)}
    quoted = fts5_query(terms)
    if quoted != sanitized and _FTS5_PLAIN.fullmatch(_QUOTED_PHRASE.sub(" ", sanitized)):
        try:  # the original store's query, when FTS5 can read it
            return run({"fts_query": sanitized, **params})
        except sa.exc.OperationalError as error:
            if not str(error.orig).startswith(_FTS_QUERY_ERRORS):
                raise
            log.debug("FTS5 rejected %r (%s); retrying with quoted terms", sanitized, error.orig)
    try:
        return run({"fts_query": quoted, **params})
    except sa.exc.OperationalError as error:
        if not str(error.orig).startswith(_FTS_QUERY_ERRORS):
            raise
        # Quoted phrases cannot be a syntax error; if FTS5 still refuses, say so and let the
        # substring search answer instead of failing the caller.
        log.warning("FTS5 rejected the quoted query %r: %s", quoted, error.orig)
        return None


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
        hits = select(window.c.id, window.c.score).order_by(*order)
    else:
        direction = sa.desc if sort == "newest" else sa.asc
        hits = (
            select(M.c.id, M.c.timestamp)
            .select_from(source)
            .where(match, *filters)
            .order_by(direction(M.c.timestamp), direction(M.c.id))
        )
    paged = hits.limit(limit).offset(offset).subquery("page")
    if sort == "rank":
        outer_order: tuple[Any, ...] = (paged.c.score, paged.c.id)
    else:
        direction = sa.desc if sort == "newest" else sa.asc
        outer_order = (direction(paged.c.timestamp), direction(paged.c.id))
    # No content: it is read afterwards through blob handles, only as far as the snippet needs
    # (SQLite loads a whole value for any function of it, 50 MB for a pasted log).
    return (
        select(*_columns(sa.null()))
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


def _pg_full_text(
    conn: Connection,
    sanitized: str,
    items: list[Item],
    filters: PgFilters,
    page: _Page,
) -> list[dict[str, Any]] | None:
    """tsquery against the stored, GIN-indexed tsvector, ranked by ``ts_rank`` among the newest
    RANK_WINDOW matches, in one statement (:func:`pg_full_text_rows`); ``ts_headline`` runs
    only for contents of at most SNIPPET_INLINE_CHARS. None when no term has anything to index."""
    terms = well_formed([i for i in items if isinstance(i, str) or i.indexable])
    if not terms:
        return None
    rows = pg_full_text_rows(conn, tsquery(terms), filters, page)
    patterns: list[re.Pattern[str]] | None = None
    for row in rows:
        content = row["snippet"] or ""
        headline = row.pop("headline")
        if len(content) <= SNIPPET_INLINE_CHARS:
            head, tail = content[:_PG_EDGE_CHARS], content[-_PG_EDGE_CHARS:]
            row["snippet"] = _mark_cuts(headline or "", head, tail)
        else:
            if patterns is None:
                patterns = _term_patterns(terms)
            row["snippet"] = bounded_snippet(content, patterns, complete=_pg_complete(content))
    return rows


@dataclass(frozen=True)
class PgFilters:
    """A search's filter values, bound into the cached PostgreSQL statement (None: no filter)."""

    sources: tuple[str, ...] | None = None
    excluded: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()

    def params(self) -> dict[str, Any]:
        values = {"pg_sources": self.sources, "pg_excluded": self.excluded, "pg_roles": self.roles}
        return {name: list(value) for name, value in values.items() if value}

    @property
    def shape(self) -> tuple[bool, bool, bool]:
        return self.sources is not None, bool(self.excluded), bool(self.roles)


def pg_full_text_rows(
    conn: Connection, tsquery_text: str, filters: PgFilters, page: _Page
) -> list[dict[str, Any]]:
    """One page of full-text hits on PostgreSQL in ONE statement: the contract's columns, the
    content's first _PG_CONTENT_CHARS (as ``snippet``), ``headline`` (ts_headline, for short
    contents only) and the packed same-session context (see :func:`_folded_context`)."""
    statement = _pg_full_text_statement(page.sort, *filters.shape)
    params = {
        "tsquery": tsquery_text,
        "pg_window": max(RANK_WINDOW, page.limit + page.offset),
        **page.params("pg"),
        **filters.params(),
    }
    rows = _dicts(conn.execute(statement, params))
    for row in rows:
        row["context"] = _folded_context(row)
    return rows


@functools.cache
def _pg_full_text_statement(
    sort: str, by_source: bool, excluding: bool, by_role: bool
) -> Select[Any]:
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
        hits = select(window.c.id, window.c.rank, window.c.timestamp).order_by(
            window.c.rank.desc(), window.c.id.desc()
        )
    else:
        direction = sa.desc if sort == "newest" else sa.asc
        hits = (
            select(M.c.id, M.c.timestamp)
            .select_from(matching)
            .where(*criteria)
            .order_by(direction(M.c.timestamp), direction(M.c.id))
        )
    paged = hits.limit(limit).offset(offset).subquery("page")
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
        select(*_columns(prefix), headline.label("headline"), *_context_columns(sqlite=False))
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


def _dicts(result: Result[Any]) -> list[dict[str, Any]]:
    return [dict(row._mapping) for row in result]


# -- bounded snippets -----------------------------------------------------------------------------


def _pg_complete(content: str) -> bool:
    return len(content) < _PG_CONTENT_CHARS


_BLOB_CHUNK = 64 * 1024


def _driver(conn: Connection) -> sqlite3.Connection:
    """The sqlite3 connection under a SQLite read unit (blob handles live there)."""
    raw = conn.connection.driver_connection
    assert isinstance(raw, sqlite3.Connection)
    return raw


#: Past this much text without a match (one the tokenizer folded, say), the snippet shows the
#: beginning of the content instead of reading on.
_SNIPPET_SEARCH_CHARS = 1 << 20


def _read_content(
    raw: sqlite3.Connection, message_id: int, patterns: Sequence[re.Pattern[str]]
) -> tuple[str, bool]:
    """A message's content through a read-only blob handle, in chunks, only as far as a bounded
    snippet needs (the first match and its window); and whether that is the whole content."""
    try:
        blob = raw.blobopen("messages", "content", message_id, readonly=True)
    except sqlite3.OperationalError as error:
        if "of type null" not in str(error):
            raise
        return "", True
    with blob:
        size = len(blob)
        if size <= SNIPPET_INLINE_CHARS * 4:
            return blob.read().decode("utf-8", "replace"), True
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text, searched, first = "", 0, None
        while True:
            chunk = blob.read(_BLOB_CHUNK)
            done = blob.tell() >= size or not chunk
            text += decoder.decode(chunk, final=done)
            if first is None:
                start = max(0, searched - 1_000)  # a match across the chunk boundary
                hits = [m.start() for p in patterns if (m := p.search(text, start))]
                first = min(hits) if hits else None
                searched = len(text)
            if done:
                return text, True
            if first is None and len(text) >= _SNIPPET_SEARCH_CHARS:
                return text, False
            if first is not None and len(text) >= first + _SNIPPET_REACH * 2:
                return text, False


def _term_patterns(items: Sequence[Item]) -> list[re.Pattern[str]]:
    """A case-insensitive pattern per positive term: its words in order, separated by anything
    that is not a letter or digit (as the tokenizers see them), a prefix term open at its end."""
    patterns = []
    negated = False
    for item in items:
        if isinstance(item, str):
            negated = item == "NOT"
            continue
        words = _TOKEN.findall(item.words)
        if words and not negated:
            body = r"[\W_]+".join(re.escape(w) for w in words)
            end = r"[^\W_]*" if item.prefix else r"(?![^\W_])"  # FTS5 marks whole tokens
            patterns.append(re.compile(r"(?<![^\W_])" + body + end, re.IGNORECASE))
        negated = False
    return patterns


def bounded_snippet(
    content: str, patterns: Sequence[re.Pattern[str]], *, complete: bool = True
) -> str:
    """FTS5's snippet shape (``>>>match<<<`` in about SNIPPET_TOKENS tokens, ``...`` where cut)
    from a window around the FIRST match: the cost is the search for that match plus a window
    of a few kilobytes, however long or repetitive the content."""
    found = [m for p in patterns if (m := p.search(content))]
    start = min((m.start() for m in found), default=0)
    lo = max(0, start - _SNIPPET_REACH)
    hi = min(len(content), start + _SNIPPET_REACH * 2)
    window = content[lo:hi]
    tokens = list(_TOKEN.finditer(window))
    if not tokens:
        return window[:SUBSTRING_SNIPPET_CHARS]
    first = next((i for i, t in enumerate(tokens) if t.start() + lo >= start), 0)
    begin = max(0, first - SNIPPET_TOKENS // 4)
    end = min(len(tokens), begin + SNIPPET_TOKENS)
    begin = max(0, end - SNIPPET_TOKENS)
    cut_lo = lo + tokens[begin].start() if begin > 0 or lo > 0 else 0
    cut_hi = lo + tokens[end - 1].end()
    whole_end = complete and end == len(tokens) and hi == len(content)
    if whole_end:
        cut_hi = len(content)
    text = content[cut_lo:cut_hi]
    marks = sorted(
        {(m.start(), m.end()) for p in patterns for m in p.finditer(text)}, key=lambda s: s[0]
    )
    out, at = [], 0
    for a, b in marks:
        if a < at:
            continue
        out += [text[at:a], ">>>", text[a:b], "<<<"]
        at = b
    out.append(text[at:])
    return ("..." if cut_lo > 0 else "") + "".join(out) + ("" if whole_end else "...")


# -- substring search and the CJK index -----------------------------------------------------------

#: What narrows a substring query to the CJK index: a MATCH expression over trigrams, ALL (any
#: row the index holds: a fragment shorter than a trigram) or None (rows outside it may match).
ALL_CJK = "\x00all"


def cjk_restriction(items: Sequence[Item]) -> str | None:
    """The FTS5 query on the CJK trigram index whose hits include every message matching
    ``items`` (each still checked with LIKE), ALL_CJK, or None when the index cannot narrow it."""

    def leaf(term: Term) -> str | None:
        if not unsegmented(term.words):
            return None
        grams = [g for piece in term.pieces for g in _trigrams(piece)]
        return " AND ".join(grams) if grams else ALL_CJK

    def all_of(parts: list[str | None]) -> str | None:
        exprs = [p for p in parts if p is not None and p != ALL_CJK]
        if exprs:
            return exprs[0] if len(exprs) == 1 else " AND ".join(f"({e})" for e in exprs)
        return ALL_CJK if ALL_CJK in parts else None

    def any_of(parts: list[str | None]) -> str | None:
        if None in parts:
            return None
        if ALL_CJK in parts:
            return ALL_CJK
        exprs = [p for p in parts if p is not None]
        return exprs[0] if len(exprs) == 1 else " OR ".join(f"({e})" for e in exprs)

    return fold(items, leaf, all_of, any_of, lambda _part: None)


def _trigrams(piece: str) -> list[str]:
    """Quoted trigrams of a fragment, at most _TRIGRAMS_PER_PIECE of them, spread from its
    first to its last (a fragment shorter than three characters has none)."""
    count = len(piece) - 2
    if count <= 0:
        return []
    if count <= _TRIGRAMS_PER_PIECE:
        starts = list(range(count))
    else:
        step = (count - 1) / (_TRIGRAMS_PER_PIECE - 1)
        starts = sorted({round(i * step) for i in range(_TRIGRAMS_PER_PIECE)})
    return ['"' + piece[i : i + 3].replace('"', '""') + '"' for i in starts]


def _has_cjk_index(conn: Connection) -> bool:
    return bool(fastpath.rows(conn, _CJK_PRESENT, {"name": ddl.CJK_TABLE}))


_CJK_PRESENT: Select[Any] = (
    select(sa.literal_column("1").label("present"))
    .select_from(sa.table("sqlite_master", sa.column("name")))
    .where(sa.column("name") == sa.bindparam("name"))
)


@dataclass(frozen=True)
class _Candidates:
    """Rows of the CJK index to start from: its MATCH hits, or every row it holds."""

    source: Any
    id: ColumnElement[Any]
    where: tuple[ColumnElement[bool], ...]


def _candidates(kind: str | None) -> _Candidates | None:
    if kind is None:
        return None
    if kind == "all":
        return _Candidates(_CJK_DOCS, _CJK_DOCS.c.id, ())
    return _Candidates(_CJK, _CJK.c.rowid, (_CJK_MATCH(sa.bindparam("cjk_query")),))


def _substring_search(
    conn: Connection,
    items: list[Item],
    filters: list[ColumnElement[bool]],
    page: _Page,
    *,
    ilike: bool,
    within: str | None = None,
) -> list[dict[str, Any]]:
    """LIKE/ILIKE on the raw fragments, newest first for ``rank``; snippets of ~120 characters
    around the first fragment found. ``within`` narrows the rows to the CJK index's candidates
    (SQLite); PostgreSQL's trigram index serves ILIKE when pg_trgm is there.

    The usual query, one term of one fragment (a CJK word), runs a statement built once with
    the pattern bound; on SQLite the statement also carries the same-session context."""
    sqlite = not ilike
    params: dict[str, Any] = page.params("sub")
    kind = None if within is None else ("all" if within == ALL_CJK else "match")
    if kind == "match":
        params["cjk_query"] = within
    term = items[0] if len(items) == 1 else None
    if isinstance(term, Term) and len(term.pieces) == 1:
        params["pattern"] = "%" + _escape_like(term.pieces[0]) + "%"
        if not filters:  # built once: run on the driver
            statement = _single_substring_statement(sqlite, page.sort, kind)
            rows = fastpath.rows(conn, statement, params)
        else:
            predicates = [_single_substring_predicate(sqlite), *filters]
            statement = _substring_statement(
                predicates, sqlite=sqlite, sort=page.sort, candidates=_candidates(kind)
            )
            rows = _dicts(conn.execute(statement, params))
    else:
        predicates = [M.c.content.is_not(None), substring_predicate(items, ilike=ilike), *filters]
        statement = _substring_statement(
            predicates, sqlite=sqlite, sort=page.sort, candidates=_candidates(kind)
        )
        rows = _dicts(conn.execute(statement, params))
    pieces = positive_pieces(items)
    for row in rows:
        row["snippet"] = substring_snippet(row["snippet"] or "", pieces)
    return rows


def _substring_statement(
    predicates: Sequence[ColumnElement[bool]],
    *,
    sqlite: bool,
    sort: str = "rank",
    candidates: _Candidates | None = None,
) -> Select[Any]:
    """Newest first (oldest first for ``oldest``). On SQLite the page of ids is cut first and
    the outer statement computes the columns (content, same-session context) for its rows only:
    a sorter fed whole rows would run the context seeks and copy the content for every match.

    From the CJK index's ``candidates``, ``rank`` means newest stored first (by id): the index
    yields its rows in that order, so the page stops after ``limit`` verified matches instead of
    sorting them all by timestamp (ids follow time, except for imported messages)."""
    limit = sa.bindparam("sub_limit", type_=sa.BigInteger)
    offset = sa.bindparam("sub_offset", type_=sa.BigInteger)
    direction = sa.asc if sort == "oldest" else sa.desc
    matching = M.join(S, S.c.id == M.c.session_id)
    if not sqlite:
        # The page first (sessions joined there only for a source filter), then the columns
        # and the context seeks for its rows: one statement.
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
            select(*_columns(M.c.content), *_context_columns(sqlite=False))
            .select_from(page.join(M, M.c.id == page.c.id).join(S, S.c.id == M.c.session_id))
            .order_by(direction(page.c.timestamp), direction(page.c.id))
        )
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
    outer = (page.c.id.desc(),) if by_id else (direction(page.c.timestamp), direction(page.c.id))
    return (
        select(*_columns(M.c.content), *_context_columns(sqlite=True))
        .select_from(page.join(M, M.c.id == page.c.id).join(S, S.c.id == M.c.session_id))
        .order_by(*outer)
    )


def _single_substring_predicate(sqlite: bool) -> ColumnElement[bool]:
    """One fragment, pattern bound (NULL content never matches LIKE)."""
    pattern = sa.bindparam("pattern", type_=sa.Text)
    if sqlite:
        return M.c.content.like(pattern, escape="\\")
    return M.c.content.ilike(pattern, escape="\\")


@functools.cache
def _single_substring_statement(sqlite: bool, sort: str, kind: str | None) -> Select[Any]:
    """The usual substring query (one CJK word), built once per order and narrowing: its
    construction cost as much as running it on a small database."""
    return _substring_statement(
        [_single_substring_predicate(sqlite)],
        sqlite=sqlite,
        sort=sort,
        candidates=_candidates(kind),
    )


def substring_snippet(content: str, pieces: Sequence[str]) -> str:
    """About 120 characters centred on the earliest fragment, marked ``>>>...<<<``."""
    found = [m for p in pieces if (m := re.search(re.escape(p), content, re.IGNORECASE))]
    if not found:
        return content[:SUBSTRING_SNIPPET_CHARS]
    match = min(found, key=lambda m: m.start())
    start, end = match.span()
    room = max(0, SUBSTRING_SNIPPET_CHARS - (end - start))
    left = max(0, start - room // 2)
    right = min(len(content), end + room - (start - left))
    left = max(0, min(left, right - SUBSTRING_SNIPPET_CHARS))
    return (
        ("..." if left > 0 else "")
        + content[left:start]
        + ">>>"
        + content[start:end]
        + "<<<"
        + content[end:right]
        + ("..." if right < len(content) else "")
    )


@functools.cache
def _neighbours() -> tuple[Any, ColumnElement[bool], ColumnElement[bool], ColumnElement[bool]]:
    """An alias of ``messages`` for a match's neighbours, and the predicates that make one of
    them the same session's, earlier, or later by ``(timestamp, id)``."""
    near = M.alias("near")
    same_session = near.c.session_id == M.c.session_id
    before = or_(
        near.c.timestamp < M.c.timestamp,
        and_(near.c.timestamp == M.c.timestamp, near.c.id < M.c.id),
    )
    after = or_(
        near.c.timestamp > M.c.timestamp,
        and_(near.c.timestamp == M.c.timestamp, near.c.id > M.c.id),
    )
    return near, same_session, before, after


def _context_columns(*, sqlite: bool) -> tuple[ColumnElement[Any], ...]:
    """The match's previous and next message of the same session, by (timestamp, id),
    as correlated columns (one index seek each, run only for the rows returned: folded into the
    substring page statement on SQLite, a second statement after the full-text page), plus the
    match's own clipped content.

    A neighbour comes back as one text value, ``<bytes of role>:<role><content>``, so a
    single seek yields both fields; NULL when there is no such message. The length is in
    UTF-8 bytes: SQLite's character ``length()`` stops at a NUL, which SQLite text may hold.
    """
    near, same_session, before, after = _neighbours()
    role_bytes = (
        func.length(sa.cast(near.c.role, sa.LargeBinary))
        if sqlite
        else func.octet_length(near.c.role)
    )
    packed = (
        sa.cast(role_bytes, sa.Text)
        + ":"
        + near.c.role
        + func.coalesce(func.substr(near.c.content, 1, CONTEXT_CHARS), "")
    )
    # The redundant bound on timestamp gives the index a range to seek instead of a scan.
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
    return (
        previous.label("context_previous"),
        func.substr(M.c.content, 1, CONTEXT_CHARS).label("context_content"),
        following.label("context_next"),
    )


def _unpack(packed: str) -> dict[str, str]:
    size, _, rest = packed.partition(":")
    cut = int(size)
    role = rest[:cut]
    if role.isascii():  # as many characters as bytes: the usual case
        return {"role": role, "content": rest[cut:][:CONTEXT_CHARS]}
    data = rest.encode("utf-8")
    content = data[cut:].decode("utf-8")
    return {"role": data[:cut].decode("utf-8"), "content": content[:CONTEXT_CHARS]}


def _folded_context(row: dict[str, Any]) -> list[dict[str, str]]:
    """Pop the context columns of :func:`_context_columns` into the contract's list."""
    previous, following = row.pop("context_previous"), row.pop("context_next")
    content = row.pop("context_content")
    context = [] if previous is None else [_unpack(previous)]
    context.append({"role": row["role"], "content": (content or "")[:CONTEXT_CHARS]})
    if following is not None:
        context.append(_unpack(following))
    return context


def _contexts(conn: Connection, ids: list[int]) -> dict[int, list[dict[str, str]]]:
    """Previous message, the match and next message of the SAME session, by (timestamp, id),
    for a whole page in one query: per match, a primary-key lookup and two seeks on
    idx_messages_session (ids bind as a list)."""
    if conn.dialect.name == "sqlite":
        return _sqlite_contexts(conn, ids)
    statement = _contexts_statement(False)
    rows = fastpath.rows(conn, statement, {"ids": ids}, expanding=["ids"])
    return {row["id"]: _folded_context(row) for row in rows}


def _sqlite_contexts(conn: Connection, ids: list[int]) -> dict[int, list[dict[str, str]]]:
    """The same on SQLite, where any function of a content loads all of it (50 MB for a pasted
    log, whether it is the match or its neighbour): the seeks return the neighbours' ids, and
    the first CONTEXT_CHARS characters of each content are read through a blob handle."""
    rows = fastpath.rows(conn, _sqlite_neighbours_statement(), {"ids": ids}, expanding=["ids"])
    near = {i for row in rows for i in (row["previous_id"], row["next_id"]) if i is not None}
    roles = {row["id"]: row["role"] for row in rows}
    missing = sorted(near - set(roles))
    if missing:
        found = fastpath.rows(conn, _roles_statement(), {"ids": missing}, expanding=["ids"])
        roles.update({row["id"]: row["role"] for row in found})
    raw = _driver(conn)
    out: dict[int, list[dict[str, str]]] = {}
    for row in rows:
        context = []
        for key in ("previous_id", "id", "next_id"):
            message_id = row[key]
            if message_id is not None:
                text = _content_prefix(raw, message_id, CONTEXT_CHARS)
                context.append({"role": roles[message_id], "content": text})
        out[row["id"]] = context
    return out


def _content_prefix(raw: sqlite3.Connection, message_id: int, chars: int) -> str:
    """The first ``chars`` characters of a content ("" for NULL), reading at most 4 bytes each."""
    try:
        blob = raw.blobopen("messages", "content", message_id, readonly=True)
    except sqlite3.OperationalError as error:
        if "of type null" not in str(error):
            raise
        return ""
    with blob:
        data = blob.read(chars * 4)
        complete = blob.tell() >= len(blob)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    return decoder.decode(data, final=complete)[:chars]


@functools.cache
def _sqlite_neighbours_statement() -> Select[Any]:
    """Per match: its role and the ids of its previous and next message of the same session
    (seeks on idx_messages_session, which covers timestamp and the rowid)."""
    near, same_session, before, after = _neighbours()
    previous = (
        select(near.c.id)
        .where(same_session, near.c.timestamp <= M.c.timestamp, before)
        .order_by(near.c.timestamp.desc(), near.c.id.desc())
        .limit(1)
        .correlate(M)
        .scalar_subquery()
    )
    following = (
        select(near.c.id)
        .where(same_session, near.c.timestamp >= M.c.timestamp, after)
        .order_by(near.c.timestamp, near.c.id)
        .limit(1)
        .correlate(M)
        .scalar_subquery()
    )
    return select(
        M.c.id, M.c.role, previous.label("previous_id"), following.label("next_id")
    ).where(M.c.id.in_(sa.bindparam("ids", expanding=True)))


@functools.cache
def _roles_statement() -> Select[Any]:
    return select(M.c.id, M.c.role).where(M.c.id.in_(sa.bindparam("ids", expanding=True)))


@functools.cache
def _contexts_statement(sqlite: bool) -> Select[Any]:
    """Built once: constructing it cost more than running it."""
    return select(M.c.id, M.c.role, *_context_columns(sqlite=sqlite)).where(
        M.c.id.in_(sa.bindparam("ids", expanding=True))
    )


# -- index maintenance ----------------------------------------------------------------------------


def rebuild_index(conn: Connection) -> None:
    """Rebuild the full-text index from ``messages``, first recreating whatever went missing
    (see :mod:`hermes_store.schema.fulltext`). Run it in a write transaction."""
    fulltext.of(conn).rebuild(conn)


def optimize_index(conn: Connection) -> None:
    """Merge the index into its most compact form (see :mod:`hermes_store.schema.fulltext`)."""
    fulltext.of(conn).optimize(conn)


def check_index(conn: Connection) -> bool:
    """True when the full-text index is sound (see :mod:`hermes_store.schema.fulltext`); on SQLite a
    write statement: use a write transaction."""
    return fulltext.of(conn).check(conn)
