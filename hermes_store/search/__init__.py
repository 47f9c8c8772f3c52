"""Full-text search: one parse of the query, then the backend's searcher.

``query`` parses (pure text: the original store's sanitizer, terms, AND/OR/NOT); ``pipeline``
holds each backend's :class:`Searcher`, which a store looks up once (``for_dialect``), built
from the searchers ``fts5`` (SQLite FTS5), ``cjk`` (SQLite's CJK trigram index), ``tsvector``
(PostgreSQL) and ``substring``; ``snippets``, ``hits`` (page, filters, same-session context)
and ``stored`` (how a SQLite file stores its text: UTF-8 or UTF-16) are what they share.
May import: ``hermes_store.repo``, ``hermes_store.schema``, ``hermes_store.engine`` and the
leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_store.faces import lazy_names

if TYPE_CHECKING:
    from hermes_store.search.pipeline import (
        Searcher,
        check_index,
        for_dialect,
        optimize_index,
        rebuild_index,
    )
    from hermes_store.search.query import (
        Query,
        contains_cjk,
        parse,
        parse_query,
        sanitize_fts5_query,
    )

__all__ = [
    "Query",
    "Searcher",
    "check_index",
    "contains_cjk",
    "for_dialect",
    "optimize_index",
    "parse",
    "parse_query",
    "rebuild_index",
    "sanitize_fts5_query",
]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        **dict.fromkeys(
            ("Searcher", "check_index", "for_dialect", "optimize_index", "rebuild_index"),
            "pipeline",
        ),
        **dict.fromkeys(
            ("Query", "contains_cjk", "parse", "parse_query", "sanitize_fts5_query"), "query"
        ),
    },
)
