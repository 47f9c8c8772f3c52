"""Session listing: the one-query rich list, the compression chain, children and what a prune
would delete (the one definition both the prune and its dry run use)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Integer, and_, bindparam, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnElement

from hermes_store.engine import fastpath
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.titles import escape_like

MAX_COMPRESSION_HOPS = 100
PREVIEW_CHARS = 60
#: The longest prefix :func:`starts_with` matches with LIKE alone. SQLite refuses a LIKE
#: pattern over 50,000 bytes ("LIKE or GLOB pattern too complex"); 10,000 characters escape
#: to at most 40,001 (4 bytes a character, 2 for an escaped wildcard, 1 for the ``%``).
LIKE_PREFIX_CHARS = 10_000
#: The fields a compression root shows from its tip (the root keeps its started_at and the rest).
TIP_FIELDS = (
    "id", "ended_at", "end_reason", "message_count", "tool_call_count", "title", "last_active",
    "preview", "model", "system_prompt",
)  # fmt: skip
#: Every character for which str.isspace() is true, so the SQL trim strips what str.strip() does.
_WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
    "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def compression_tip(conn: Connection, session_id: str) -> str | None:
    """Follow ``end_reason == 'compression'`` forward to the newest child started at or after
    the parent ended; children made earlier (subagents, branches) are never followed."""
    current = session_id
    for _ in range(MAX_COMPRESSION_HOPS):
        row = conn.execute(select(S.c.ended_at, S.c.end_reason).where(S.c.id == current)).first()
        if row is None or row.end_reason != "compression" or row.ended_at is None:
            break
        child = conn.scalar(
            select(S.c.id)
            .where(S.c.parent_session_id == current, S.c.started_at >= row.ended_at)
            .order_by(S.c.started_at.desc(), S.c.id.desc())
            .limit(1)
        )
        if child is None:
            break
        current = child
    return current


def compression_tips(conn: Connection, session_ids: Iterable[str]) -> dict[str, str]:
    """:func:`compression_tip` for many sessions at once: one query per hop for all chains."""
    tips = {sid: sid for sid in session_ids}
    pending = {sid: sid for sid in tips}  # root -> where its chain stands now
    for _ in range(MAX_COMPRESSION_HOPS):
        if not pending:
            break
        found = fastpath.rows(
            conn, _successors(), {"at": sorted(set(pending.values()))}, expanding=["at"]
        )
        steps = {row["id"]: row["next_id"] for row in found}
        pending = {root: steps[at] for root, at in pending.items() if steps.get(at) is not None}
        tips.update(pending)
    return tips


@functools.cache
def _successors() -> Select[Any]:
    """One hop of many compression chains: each ``:at`` session's continuation (built once)."""
    child = S.alias("child")
    successor = (
        select(child.c.id)
        .where(child.c.parent_session_id == S.c.id, child.c.started_at >= S.c.ended_at)
        .order_by(child.c.started_at.desc(), child.c.id.desc())
        .limit(1)
        .scalar_subquery()
    )
    return select(S.c.id, successor.label("next_id")).where(
        S.c.id.in_(bindparam("at", expanding=True)),
        S.c.end_reason == "compression",
        S.c.ended_at.is_not(None),
    )


@functools.cache
def rich_select() -> Select[Any]:
    """Every session column plus ``_preview`` and ``last_active`` as correlated subqueries,
    each a seek on idx_messages_session (session_id, timestamp) for one session. Built once:
    its construction cost more than running it (callers extend it generatively)."""
    m = M.alias("m")
    flat = func.replace(func.replace(m.c.content, "\n", " "), "\r", " ")
    first_user_text = (
        select(func.substr(func.trim(flat, _WHITESPACE), 1, PREVIEW_CHARS + 1))
        .where(m.c.session_id == S.c.id, m.c.role == "user", m.c.content.is_not(None))
        .order_by(m.c.timestamp, m.c.id)
        .limit(1)
        .scalar_subquery()
    )
    latest = (
        select(m.c.timestamp)
        .where(m.c.session_id == S.c.id)
        .order_by(m.c.timestamp.desc())
        .limit(1)
        .scalar_subquery()
    )
    return select(
        S,
        func.coalesce(first_user_text, "").label("_preview"),
        func.coalesce(latest, S.c.started_at).label("last_active"),
    )


def _rich_dict(row: Any) -> dict[str, Any]:
    item = dict(row) if isinstance(row, dict) else dict(row._mapping)
    preview = item.pop("_preview") or ""
    item["preview"] = preview[:PREVIEW_CHARS] + "..." if len(preview) > PREVIEW_CHARS else preview
    return item


def list_sessions_rich(
    conn: Connection,
    *,
    source: str | None,
    exclude_sources: Sequence[str] | None,
    limit: int,
    offset: int,
    include_children: bool,
    project_compression_tips: bool,
) -> list[dict[str, Any]]:
    """Sessions newest first with ``preview`` and ``last_active``, in one query.

    The page (ids only, off idx_sessions_started) is cut first, so the correlated subqueries run
    for its rows alone however deep the offset. Compression roots then show their tip, whose
    rows come in one more query (after one query per hop of all the page's chains; PostgreSQL
    follows them inside one statement instead: :func:`projected_page`).
    """
    excluded = list(exclude_sources or ())
    params = _page_params(source, excluded, limit, offset)
    statement = _page_statement(include_children, bool(source), bool(excluded))
    found = fastpath.rows(conn, statement, params, expanding=["excluded"] if excluded else [])
    rows = [_rich_dict(row) for row in found]
    if project_compression_tips and not include_children:
        _project_tips(conn, rows)
    return rows


def _page_params(
    source: str | None, excluded: list[str], limit: int, offset: int
) -> dict[str, Any]:
    return {"source": source, "excluded": excluded, "lim": max(0, limit), "off": max(0, offset)}


def count_sessions(
    conn: Connection,
    *,
    sources: Sequence[str],
    exclude_sources: Sequence[str],
    include_children: bool,
) -> int:
    """How many sessions :func:`list_sessions_rich` pages through for these filters (any
    number of sources), so a listing can say how much it left out."""
    criteria: list[ColumnElement[bool]] = []
    if not include_children:
        criteria.append(S.c.parent_session_id.is_(None))
    if sources:
        criteria.append(S.c.source.in_(list(sources)))
    if exclude_sources:
        criteria.append(S.c.source.not_in(list(exclude_sources)))
    return int(conn.scalar(select(func.count()).select_from(S).where(*criteria)) or 0)


def _page_ids(include_children: bool, by_source: bool, excluding: bool) -> Select[Any]:
    """The page's ids and start times, newest first (bound filters, limit and offset)."""
    criteria: list[ColumnElement[bool]] = []
    if not include_children:
        # Most sessions are top-level: wrapped so SQLite (no statistics) walks
        # idx_sessions_started in order instead of idx_sessions_parent plus a full sort.
        criteria.append(func.coalesce(S.c.parent_session_id, None).is_(None))
    if by_source:
        criteria.append(S.c.source == bindparam("source"))
    if excluding:
        criteria.append(S.c.source.not_in(bindparam("excluded", expanding=True)))
    return (
        select(S.c.id, S.c.started_at)
        .where(*criteria)
        .order_by(S.c.started_at.desc(), S.c.id.desc())
        .limit(bindparam("lim", type_=BigInteger))
        .offset(bindparam("off", type_=BigInteger))
    )


@functools.cache
def _page_statement(include_children: bool, by_source: bool, excluding: bool) -> Select[Any]:
    """The rich page for one shape of filters, built once (values are bound per call)."""
    page = _page_ids(include_children, by_source, excluding).subquery("page")
    return (
        rich_select()
        .join(page, page.c.id == S.c.id)
        .order_by(page.c.started_at.desc(), page.c.id.desc())
    )


def projected_page(
    conn: Connection,
    *,
    source: str | None,
    exclude_sources: Sequence[str] | None,
    limit: int,
    offset: int,
) -> list[dict[str, Any]]:
    """:func:`list_sessions_rich` of the top-level sessions with compression roots showing their
    tips, in ONE statement (PostgreSQL: a recursive CTE follows the chains): each row comes with
    ``_root`` and, for a root whose chain leads on, its tip's rich row follows it
    (``_is_tip``)."""
    excluded = list(exclude_sources or ())
    params = _page_params(source, excluded, limit, offset)
    statement = _pg_projected_statement(bool(source), bool(excluded))
    expanding = ["excluded"] if excluded else []
    found = fastpath.rows(conn, statement, params, expanding=expanding)
    rows: list[dict[str, Any]] = []
    for item in map(_rich_dict, found):
        root, is_tip = item.pop("_root"), item.pop("_is_tip")
        if not is_tip:
            rows.append(item)
            continue
        row = rows[-1]
        assert row["id"] == root  # the tip follows its root (see the statement's order)
        row.update({field: item[field] for field in TIP_FIELDS})
        row["_lineage_root_id"] = root
    return rows


@functools.cache
def _pg_projected_statement(by_source: bool, excluding: bool) -> Select[Any]:
    """The page, each compression chain followed by a recursive CTE (the same hops as
    :func:`compression_tip`, at most MAX_COMPRESSION_HOPS), then the rich rows of the page
    and of the tips that differ from their roots. Built once per filter shape."""
    page = _page_ids(False, by_source, excluding).cte("page")
    at = S.alias("at_session")
    child = S.alias("child")
    start = select(
        page.c.id.label("root"), page.c.id.label("at"), sa.literal(0, Integer).label("hop")
    ).cte("chain", recursive=True)
    successor = (
        select(child.c.id)
        .where(child.c.parent_session_id == at.c.id, child.c.started_at >= at.c.ended_at)
        .order_by(child.c.started_at.desc(), child.c.id.desc())
        .limit(1)
        .lateral("successor")
    )
    step = (
        select(start.c.root, successor.c.id, start.c.hop + 1)
        .select_from(start.join(at, at.c.id == start.c.at).join(successor, sa.true()))
        .where(
            at.c.end_reason == "compression",
            at.c.ended_at.is_not(None),
            start.c.hop < MAX_COMPRESSION_HOPS,
        )
    )
    chain = start.union_all(step)
    further = chain.alias("further")
    tip = (
        select(chain.c.root, chain.c.at)
        .where(~sa.exists().where(further.c.root == chain.c.root, further.c.hop > chain.c.hop))
        .cte("tip")
    )
    targets = sa.union_all(
        select(tip.c.root, tip.c.root.label("sid"), sa.literal(0, Integer).label("is_tip")),
        select(tip.c.root, tip.c.at, sa.literal(1, Integer)).where(tip.c.at != tip.c.root),
    ).subquery("targets")
    return (
        rich_select()
        .add_columns(targets.c.root.label("_root"), targets.c.is_tip.label("_is_tip"))
        .join(targets, targets.c.sid == S.c.id)
        .join(page, page.c.id == targets.c.root)
        .order_by(page.c.started_at.desc(), page.c.id.desc(), targets.c.is_tip)
    )


@functools.cache
def _tips_statement() -> Select[Any]:
    return rich_select().where(S.c.id.in_(bindparam("tips", expanding=True)))


def _project_tips(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Show each compression root's live continuation in its place (roots are few)."""
    roots = [row["id"] for row in rows if row.get("end_reason") == "compression"]
    if not roots:
        return
    tips = {root: tip for root, tip in compression_tips(conn, roots).items() if tip != root}
    if not tips:
        return
    found = fastpath.rows(
        conn, _tips_statement(), {"tips": sorted(set(tips.values()))}, expanding=["tips"]
    )
    tip_rows = {row["id"]: row for row in map(_rich_dict, found)}
    for row in rows:
        tip = tip_rows.get(tips.get(row["id"], ""))
        if tip is None:
            continue
        root_id = row["id"]
        row.update({field: tip[field] for field in TIP_FIELDS})
        row["_lineage_root_id"] = root_id


def children_of(conn: Connection, session_id: str) -> list[dict[str, Any]]:
    """The sessions whose parent is ``session_id``, oldest first (id, title, source, started_at)."""
    statement = (
        select(S.c.id, S.c.title, S.c.source, S.c.started_at)
        .where(S.c.parent_session_id == session_id)
        .order_by(S.c.started_at, S.c.id)
    )
    return [dict(row._mapping) for row in conn.execute(statement)]


def starts_with(column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
    """``column`` starts with ``prefix`` taken literally (``LIKE 'prefix%'``, wildcards escaped),
    for a prefix of any length: a longer one than :data:`LIKE_PREFIX_CHARS` is matched by LIKE
    on that many characters and by ``substr`` on the rest, so SQLite's pattern limit never
    turns a long lookup into a database error. The rest compares exactly on both backends
    (SQLite's LIKE would ignore its ASCII case)."""
    head = prefix[:LIKE_PREFIX_CHARS]
    match = column.like(escape_like(head) + "%", escape="\\")
    if len(prefix) == len(head):
        return match
    rest = prefix[len(head) :]
    return and_(match, func.substr(column, len(head) + 1, len(rest)) == rest)


def unique_id_prefixes(
    conn: Connection, session_ids: Iterable[str], minimum: int = 8
) -> dict[str, str]:
    """Each id cut to the shortest prefix (at least ``minimum`` characters) that no other
    session in the whole database starts with, so a shortened id always resolves.

    The id's neighbours in index order give the length; a prefix count confirms it (a
    collation that does not sort by bytes only makes the first guess short). Past the guess,
    a binary search finds the length: fewer sessions share a longer prefix, so a handful of
    counts settle even an id of a million characters (one count per character did not).
    """
    below = select(S.c.id).where(S.c.id < bindparam("id")).order_by(S.c.id.desc()).limit(1)
    above = select(S.c.id).where(S.c.id > bindparam("id")).order_by(S.c.id).limit(1)
    shortened: dict[str, str] = {}
    for session_id in dict.fromkeys(session_ids):
        found = (conn.scalar(query, {"id": session_id}) for query in (below, above))
        neighbours = [n for n in found if n is not None]
        shared = max((_common_prefix(session_id, n) for n in neighbours), default=0)
        length = max(minimum, shared + 1)
        if length < len(session_id):
            length = _unique_length(conn, session_id, length)
        shortened[session_id] = session_id[:length]
    return shortened


def _sharing(conn: Connection, prefix: str) -> int:
    """How many sessions start with ``prefix``, counted up to 2: all the search needs."""
    matching = select(S.c.id).where(starts_with(S.c.id, prefix)).limit(2).subquery()
    return int(conn.scalar(select(func.count()).select_from(matching)) or 0)


def _unique_length(conn: Connection, session_id: str, guess: int) -> int:
    """The shortest length from ``guess`` on whose prefix of ``session_id`` exactly one
    session starts with, else the whole id's length: what counting each length in turn gave.

    Sharing only shrinks as the prefix grows, so the first length that at most one session
    shares is found by bisection: it is the answer when one session shares it, and when none
    does (an id not in the database) no longer one can be. The guess is counted first: for an
    id in the database and a collation that sorts by bytes, it is the answer.
    """
    low, high, sharing_high = guess, len(session_id), 2  # high: no such length yet
    middle = guess
    while low < high:
        count = _sharing(conn, session_id[:middle])
        if count <= 1:
            high, sharing_high = middle, count
        else:
            low = middle + 1
        middle = (low + high) // 2
    return high if sharing_high == 1 else len(session_id)


def _common_prefix(a: str, b: str) -> int:
    size = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        size += 1
    return size
