"""SQLite's search of unsegmented text (CJK, Thai ...): a substring match, narrowed to the rows
its CJK trigram index names as candidates.

A word inside a longer CJK run is no token of either full-text index, so such a query is a
substring match; SQLite's trigram index (``messages_cjk``, filled by triggers for the rows that
hold such text) turns its terms into an FTS5 query over trigrams whose hits include every row
that can match, each still checked with LIKE. A CJK part ORed with a Latin word, or only
negated, cannot be narrowed: it scans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnElement

from hermes_store.engine import fastpath
from hermes_store.schema import ddl
from hermes_store.search.hits import Filters, Hit, Page
from hermes_store.search.query import Item, Query, Term, fold, unsegmented

#: What narrows a substring query to the CJK index: a MATCH expression over trigrams, ALL (any
#: row the index holds: a fragment shorter than a trigram) or None (rows outside it may match).
ALL_CJK = "\x00all"
#: At most this many trigrams of one CJK fragment go into the index query (evenly spread).
_TRIGRAMS_PER_PIECE = 6

_CJK = sa.table(ddl.CJK_TABLE, sa.column("rowid"))
_CJK_MATCH = sa.literal_column(ddl.CJK_TABLE).op("MATCH")
_CJK_DOCS = sa.table(ddl.CJK_DOCSIZE, sa.column("id"))
_CJK_PRESENT: Select[Any] = (
    select(sa.literal_column("1").label("present"))
    .select_from(sa.table("sqlite_master", sa.column("name")))
    .where(sa.column("name") == sa.bindparam("name"))
)


def restriction(items: list[Item]) -> str | None:
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


def has_index(conn: Connection) -> bool:
    """Whether the file has the CJK index (a file the original store last migrated may not)."""
    return bool(fastpath.rows(conn, _CJK_PRESENT, {"name": ddl.CJK_TABLE}))


@dataclass(frozen=True)
class Candidates:
    """Rows of the CJK index to start from: its MATCH hits, or every row it holds."""

    source: Any
    id: ColumnElement[Any]
    where: tuple[ColumnElement[bool], ...]


def candidates(kind: str | None) -> Candidates | None:
    """``match``: the index's hits for ``:cjk_query``; ``all``: every row it holds."""
    if kind is None:
        return None
    if kind == "all":
        return Candidates(_CJK_DOCS, _CJK_DOCS.c.id, ())
    return Candidates(_CJK, _CJK.c.rowid, (_CJK_MATCH(sa.bindparam("cjk_query")),))


class Narrowable(Protocol):
    """A substring search that can start from the CJK index's rows (``within``)."""

    def find(
        self,
        conn: Connection,
        query: Query,
        filters: Filters,
        page: Page,
        *,
        within: str | None = None,
    ) -> list[Hit]: ...


class CjkTrigram:
    """Unsegmented queries on SQLite: ``substring``'s match, from the CJK index's candidates
    when the file has the index and the terms allow it."""

    def __init__(self, substring: Narrowable) -> None:
        self.substring = substring

    def find(self, conn: Connection, query: Query, filters: Filters, page: Page) -> list[Hit]:
        within = restriction(query.items) if has_index(conn) else None
        return self.substring.find(conn, query, filters, page, within=within)
