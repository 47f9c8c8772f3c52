"""A session's messages as the store returns them: read in ``(timestamp, id)`` order, their JSON
columns decoded. The one decoding every reader shares (``get_messages``, the paged export and
PostgreSQL's streamed export), so the three hand out the same dicts."""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select

from hermes_store.engine import fastpath
from hermes_store.tables import messages_table as M

log = logging.getLogger(__name__)

RowDict = dict[str, Any]
#: The order of a session's messages (timestamps may tie: the id breaks the tie).
MESSAGE_ORDER = (M.c.timestamp, M.c.id)


def from_json(value: str | None, fallback: Any, what: str, message_id: object) -> Any:
    """A JSON column's value, ``fallback`` when empty; text that is not JSON (written by hand,
    or by another program) gives ``fallback`` too, with a warning, instead of failing the read."""
    try:
        return json.loads(value) if value else fallback
    except (TypeError, ValueError):
        log.warning("message %s: %s is not valid JSON; using %r", message_id, what, fallback)
        return fallback


def decode_tool_calls(rows: list[RowDict]) -> list[RowDict]:
    """``tool_calls`` decoded in place (bad JSON gives ``[]``); the rows, for chaining."""
    for message in rows:
        if message.get("tool_calls"):
            message["tool_calls"] = from_json(
                message["tool_calls"], [], "tool_calls", message["id"]
            )
    return rows


@functools.cache
def messages_statement(after: bool, limited: bool) -> Select[Any]:
    """One session's messages by ``(timestamp, id)``; optionally after the message ``:after``
    (keyset) and at most ``:lim`` of them. Built once per shape (the hot read of export)."""
    statement = select(M).where(M.c.session_id == sa.bindparam("sid")).order_by(*MESSAGE_ORDER)
    if after:
        after_id = sa.bindparam("after", type_=sa.BigInteger)
        anchor = select(M.c.timestamp).where(M.c.id == after_id).scalar_subquery()
        statement = statement.where(
            M.c.timestamp >= anchor,  # redundant, but it lets the index seek instead of scan
            or_(M.c.timestamp > anchor, and_(M.c.timestamp == anchor, M.c.id > after_id)),
        )
    if limited:
        statement = statement.limit(sa.bindparam("lim", type_=sa.BigInteger))
    return statement


def messages_params(
    session_id: str, *, limit: int | None = None, after_id: int | None = None
) -> dict[str, Any]:
    """The parameters :func:`messages_statement` binds."""
    return {"sid": session_id, "after": after_id, "lim": limit}


def fetch_messages(
    conn: Connection, session_id: str, *, limit: int | None = None, after_id: int | None = None
) -> list[RowDict]:
    """One session's messages on ``conn``, ``tool_calls`` decoded (bad JSON gives ``[]``)."""
    statement = messages_statement(after_id is not None, limit is not None)
    params = messages_params(session_id, limit=limit, after_id=after_id)
    return decode_tool_calls(fastpath.rows(conn, statement, params))
