"""Full-text search: one parse of the query, then the backend's searcher.

May import: ``hermes_store.repo``, ``hermes_store.schema``, ``hermes_store.engine`` and the
leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_store.faces import lazy_names

if TYPE_CHECKING:
    from hermes_store.search.pipeline import parse_query, sanitize_fts5_query, search_messages

__all__ = ["parse_query", "sanitize_fts5_query", "search_messages"]

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "pipeline"))
