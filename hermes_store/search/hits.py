"""What every searcher shares: the page asked for, the filters, the contract's result columns,
and the same-session context around each hit (the previous and next message of the match's
session, by ``(timestamp, id)``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_, func, or_, select
from sqlalchemy.engine import Result
from sqlalchemy.sql.elements import ColumnElement

from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S

#: One hit as the contract returns it (``snippet``, ``context`` ...).
Hit = dict[str, Any]

CONTEXT_CHARS = 200
#: The orders ``search_messages`` offers: ``rank`` (the contract's, best first), ``newest`` and
#: ``oldest`` (by timestamp, then id).
SORTS = ("rank", "newest", "oldest")
#: ``rank`` scores at most this many matches, the newest by id: BM25 of every match of a word in
#: a quarter of a million messages took 0.4 s at 1M. Fewer matches are ranked exactly.
RANK_WINDOW = 2_000


@dataclass(frozen=True)
class Page:
    limit: int
    offset: int
    sort: str

    def params(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_limit": self.limit, f"{prefix}_offset": self.offset}

    def window(self) -> int:
        """How many of the newest matches ``rank`` scores: RANK_WINDOW, or the whole page."""
        return max(RANK_WINDOW, self.limit + self.offset)


def listed(values: Sequence[str]) -> list[str]:
    """A lone string means that one value, not its characters."""
    return [values] if isinstance(values, str) else list(values)


@dataclass(frozen=True)
class Filters:
    """A search's filters: the sources to search (None: all), those to leave out, the roles."""

    sources: tuple[str, ...] | None = None
    excluded: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        source_filter: Sequence[str] | None,
        exclude_sources: Sequence[str] | None,
        role_filter: Sequence[str] | None,
    ) -> Filters:
        return cls(
            None if source_filter is None else tuple(listed(source_filter)),
            tuple(listed(exclude_sources or ())),
            tuple(listed(role_filter or ())),
        )

    def predicates(self) -> list[ColumnElement[bool]]:
        """The filters as SQL predicates over ``messages`` joined to ``sessions``."""
        found: list[ColumnElement[bool]] = []
        if self.sources is not None:
            found.append(S.c.source.in_(list(self.sources)))
        if self.excluded:
            found.append(S.c.source.not_in(list(self.excluded)))
        if self.roles:
            found.append(M.c.role.in_(list(self.roles)))
        return found

    def params(self, prefix: str) -> dict[str, Any]:
        """The filter values, for a statement built once per :attr:`shape` that binds them as
        ``<prefix>_sources``, ``<prefix>_excluded`` and ``<prefix>_roles``."""
        values = {"sources": self.sources, "excluded": self.excluded, "roles": self.roles}
        return {f"{prefix}_{name}": list(value) for name, value in values.items() if value}

    @property
    def shape(self) -> tuple[bool, bool, bool]:
        """Which filters there are: (by source, excluding sources, by role)."""
        return self.sources is not None, bool(self.excluded), bool(self.roles)


def columns(snippet: ColumnElement[Any]) -> tuple[ColumnElement[Any], ...]:
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


def dicts(result: Result[Any]) -> list[Hit]:
    return [dict(row._mapping) for row in result]


# -- same-session context -------------------------------------------------------------------------


@functools.cache
def neighbours() -> tuple[Any, ColumnElement[bool], ColumnElement[bool], ColumnElement[bool]]:
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


def context_columns(
    octets: Callable[[ColumnElement[Any]], ColumnElement[Any]],
) -> tuple[ColumnElement[Any], ...]:
    """The match's previous and next message of the same session, by (timestamp, id),
    as correlated columns (one index seek each, run only for the rows returned), plus the
    match's own clipped content.

    A neighbour comes back as one text value, ``<bytes of role>:<role><content>``, so a
    single seek yields both fields; NULL when there is no such message. ``octets`` is the
    backend's length of a text in the bytes it stores it in (UTF-8, or a SQLite file's
    UTF-16: :mod:`.stored`, whose ``unpack`` reads it back): SQLite's character ``length()``
    stops at a NUL, which SQLite text may hold.
    """
    near, same_session, before, after = neighbours()
    packed = (
        sa.cast(octets(near.c.role), sa.Text)
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


#: Reads a packed neighbour back as ``{"role", "content"}``.
Unpack = Callable[[str], dict[str, str]]


def unpack_utf8(packed: str) -> dict[str, str]:
    """A neighbour packed by :func:`context_columns` where text is stored as UTF-8."""
    size, _, rest = packed.partition(":")
    cut = int(size)
    role = rest[:cut]
    if role.isascii():  # as many characters as bytes: the usual case
        return {"role": role, "content": rest[cut:][:CONTEXT_CHARS]}
    data = rest.encode("utf-8")
    content = data[cut:].decode("utf-8")
    return {"role": data[:cut].decode("utf-8"), "content": content[:CONTEXT_CHARS]}


def unpack_in(codec: str) -> Unpack:
    """:func:`unpack_utf8` where text is stored in ``codec`` (a SQLite file's UTF-16), whose
    bytes the role's length counts."""

    def unpack(packed: str) -> dict[str, str]:
        size, _, rest = packed.partition(":")
        data, cut = rest.encode(codec), int(size)
        content = data[cut:].decode(codec)[:CONTEXT_CHARS]
        return {"role": data[:cut].decode(codec), "content": content}

    return unpack


def folded_context(row: Hit, unpack: Unpack = unpack_utf8) -> list[dict[str, str]]:
    """Pop the context columns of :func:`context_columns` into the contract's list."""
    previous, following = row.pop("context_previous"), row.pop("context_next")
    content = row.pop("context_content")
    context = [] if previous is None else [unpack(previous)]
    context.append({"role": row["role"], "content": (content or "")[:CONTEXT_CHARS]})
    if following is not None:
        context.append(unpack(following))
    return context


def fold_contexts(rows: list[Hit], unpack: Unpack = unpack_utf8) -> list[Hit]:
    """Each row's context columns folded into its ``context``; the rows, for chaining."""
    for row in rows:
        row["context"] = folded_context(row, unpack)
    return rows
