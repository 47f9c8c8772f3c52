"""Full-text search over ``messages.content``: one parse of the query, then the store's searcher.

A store looks its :class:`Searcher` up once (:func:`for_dialect`); each search parses the
query once (:mod:`.query`) and hands the parse to the backend's searchers: the full-text one
(:mod:`.fts5` on SQLite, :mod:`.tsvector` on PostgreSQL), the one for unsegmented scripts
(:mod:`.cjk` on SQLite, a plain substring match on PostgreSQL, whose trigram index serves
ILIKE), and the substring search (:mod:`.substring`) where the full text cannot answer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Protocol

from sqlalchemy.engine import Connection

from hermes_store.echo import echoed
from hermes_store.errors import InvalidInputError
from hermes_store.schema import fulltext
from hermes_store.search.cjk import CjkTrigram
from hermes_store.search.fts5 import Fts5
from hermes_store.search.hits import SORTS, Filters, Hit, Page, listed
from hermes_store.search.query import Query, contains_cjk, parse
from hermes_store.search.substring import PostgresSubstring, SqliteSubstring, Substring

_INT64_MAX = 2**63 - 1
# Text FTS5's tokenizer reads as the user does: ASCII letters and digits, spaces, quotes, stars.
_ASCII_WORDS = re.compile(r'[A-Za-z0-9 \t\n\r*"]*')


class Finder(Protocol):
    """One way of finding a page of hits (with snippets and context) for a parsed query."""

    def find(
        self, conn: Connection, query: Query, filters: Filters, page: Page
    ) -> list[Hit] | None: ...


class FullText(Finder, Protocol):
    """A finder by tokens: :meth:`find` gives None when the query has nothing to index."""

    def matches_any(self, conn: Connection, query: Query, filters: Filters, sort: str) -> bool: ...


class Searcher:
    """A store's search, for its backend. ``full_text`` finds by tokens (None: nothing in the
    query to index), ``unsegmented`` answers queries in scripts written without spaces, and
    ``substring`` answers when the full text cannot (:meth:`substring_may_answer`)."""

    def __init__(
        self,
        full_text: FullText,
        unsegmented: Finder,
        substring: Substring,
        index: fulltext.SqliteFullText | fulltext.PostgresFullText,
    ) -> None:
        self.full_text = full_text
        self.unsegmented = unsegmented
        self.substring = substring
        self.index = index

    def substring_may_answer(self, query: Query) -> bool:
        """Whether, when the full-text search finds nothing, a substring match may: on
        PostgreSQL always, since its parser keeps paths, e-mails and URLs whole."""
        return True

    def search_messages(
        self,
        conn: Connection,
        query: str,
        *,
        source_filter: Sequence[str] | None,
        exclude_sources: Sequence[str] | None,
        role_filter: Sequence[str] | None,
        limit: int,
        offset: int,
        sort: str = "rank",
    ) -> list[Hit]:
        """Messages matching ``query`` in ``sort`` order, with snippet and same-session context.

        Syntax never reaches the caller. A query with CJK (or another unsegmented script) is a
        substring match, so a word inside a longer run is found wherever it occurs (newest first
        for ``rank``: substring matches carry no score). Otherwise, when the full-text search
        finds nothing at all, a substring match takes over where it may
        (:meth:`substring_may_answer`), and always for terms without letters or digits (``->``).
        """
        if type(sort) is not str or sort not in SORTS:  # `in` would compare an array per item
            raise InvalidInputError(f"sort must be one of {', '.join(SORTS)}, not {echoed(sort)}")
        limit, offset = max(0, int(limit)), max(0, int(offset))
        limit = min(limit, _INT64_MAX - offset)  # the rank window is limit + offset: a 64-bit bind
        if not query or not query.strip() or limit == 0:
            return []
        if source_filter is not None and not listed(source_filter):
            return []
        parsed = parse(query)
        if parsed is None:
            return []
        filters = Filters.of(source_filter, exclude_sources, role_filter)
        page = Page(limit, offset, sort)
        if parsed.unsegmented:
            return self.unsegmented.find(conn, parsed, filters, page) or []
        rows = self.full_text.find(conn, parsed, filters, page)
        if rows:
            return rows
        fallback = rows is None or self.substring_may_answer(parsed)
        if fallback and offset and rows is not None:
            # The full-text result set exists and this page is past its end: no fallback.
            fallback = not self.full_text.matches_any(conn, parsed, filters, sort)
        if not fallback:
            return []
        return self.substring.find(conn, parsed, filters, page)

    # -- index maintenance ----------------------------------------------------------------------

    def rebuild_index(self, conn: Connection) -> None:
        """Rebuild the full-text index from ``messages``, first recreating whatever went missing
        (see :mod:`hermes_store.schema.fulltext`). Run it in a write transaction."""
        self.index.rebuild(conn)

    def optimize_index(self, conn: Connection) -> None:
        """Merge the index into its most compact form."""
        self.index.optimize(conn)

    def check_index(self, conn: Connection) -> bool:
        """True when the full-text index is sound; on SQLite a write statement: use a write
        transaction."""
        return self.index.check(conn)


class SqliteSearcher(Searcher):
    def substring_may_answer(self, query: Query) -> bool:
        """For queries with punctuation or non-ASCII letters, which FTS5's tokenizer splits or
        folds otherwise than the user wrote them."""
        return contains_cjk(query.text) or not _ASCII_WORDS.fullmatch(query.sanitized)


_SQLITE_SUBSTRING = SqliteSubstring()
_POSTGRES_SUBSTRING = PostgresSubstring()
#: The searchers, built once per process: their statements are built once, and the hot ones run
#: compiled once per statement object (:mod:`hermes_store.engine.fastpath`).
SQLITE = SqliteSearcher(Fts5(), CjkTrigram(_SQLITE_SUBSTRING), _SQLITE_SUBSTRING, fulltext.SQLITE)


@functools.cache
def _postgresql() -> Searcher:
    """PostgreSQL's searcher, built on first use: its statements import PostgreSQL's dialect
    (16-29 ms), which a SQLite process never needs."""
    from hermes_store.search.tsvector import Tsvector

    return Searcher(Tsvector(), _POSTGRES_SUBSTRING, _POSTGRES_SUBSTRING, fulltext.POSTGRESQL)


def __getattr__(name: str) -> Any:
    if name == "POSTGRESQL":
        return _postgresql()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def for_dialect(name: str) -> Searcher:
    """The searcher of a dialect (``engine.dialect.name``): SQLite's, else PostgreSQL's."""
    return SQLITE if name == "sqlite" else _postgresql()


# -- index maintenance on a bare connection -------------------------------------------------


def rebuild_index(conn: Connection) -> None:
    """:meth:`Searcher.rebuild_index` for ``conn``'s backend."""
    fulltext.of(conn).rebuild(conn)


def optimize_index(conn: Connection) -> None:
    """:meth:`Searcher.optimize_index` for ``conn``'s backend."""
    fulltext.of(conn).optimize(conn)


def check_index(conn: Connection) -> bool:
    """:meth:`Searcher.check_index` for ``conn``'s backend."""
    return fulltext.of(conn).check(conn)
