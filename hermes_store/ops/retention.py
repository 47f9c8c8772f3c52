"""Retention: which old sessions a policy deletes, and a chunked job that deletes them.

One function, :func:`candidates`, says which sessions a policy selects; the store's one-shot
``prune_sessions``, the CLI's ``--dry-run`` preview and the periodic :func:`run` all use it, so a
preview lists exactly what a prune deletes.

:func:`run` deletes in chunks, each its own write unit (``BEGIN IMMEDIATE`` on SQLite), so a
writer never waits behind more than one chunk. Each chunk re-selects its candidates inside the
locked transaction, so two jobs racing (two cron entries, two machines on one PostgreSQL) delete
every session once and their reported counts add up to what was deleted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import delete, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql import CompoundSelect, Select

from hermes_store.errors import InvalidInputError
from hermes_store.ops import maintenance
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.uow.unit import UnitOfWork

#: Sessions per write unit: small enough that a chunk holds the write lock for milliseconds.
DEFAULT_CHUNK = 200
#: Pause after each chunk (SQLite): longer than a waiting writer's longest poll interval
#: (SQLite's busy handler polls every 100 ms at most; the Unit of Work's jitter is <= 150 ms),
#: so a writer queued behind a chunk gets the lock before the job's next chunk.
YIELD_S = 0.16
#: The largest chunk accepted: beyond it one unit would hold the write lock too long.
MAX_CHUNK = 5000


@dataclass(frozen=True)
class Policy:
    """What to delete: ended sessions started more than ``older_than_days`` ago.

    ``sources`` limits it to those sources (empty: every source). ``keep_titled`` keeps
    sessions with a title. ``keep_lineage`` keeps every session of a parent/child chain that
    holds a session the policy keeps (recent, still active, or titled with ``keep_titled``), so
    a kept conversation never loses the earlier parts it was compressed from.
    """

    older_than_days: float = 90
    sources: tuple[str, ...] = ()
    keep_titled: bool = False
    keep_lineage: bool = False

    def __post_init__(self) -> None:
        days = self.older_than_days
        if isinstance(days, bool) or not isinstance(days, int | float) or days != days:
            raise InvalidInputError(f"older_than_days must be a number, not {days!r}")
        if isinstance(self.sources, str) or not all(isinstance(s, str) for s in self.sources):
            raise InvalidInputError("sources must be a sequence of strings")

    @classmethod
    def of(
        cls,
        older_than_days: float = 90,
        source: str | Sequence[str] | None = None,
        **flags: bool,
    ) -> Policy:
        """A policy from the store's ``prune_sessions`` arguments (one source or several)."""
        sources = () if source is None else (source,) if isinstance(source, str) else source
        return cls(older_than_days, tuple(sources), **flags)


def cutoff(policy: Policy, now: float | None = None) -> float:
    """The ``started_at`` before which sessions are old enough to delete."""
    return (time.time() if now is None else now) - policy.older_than_days * 86400


def _lineage_of(anchor: Select[Any]) -> CompoundSelect[Any]:
    """Ids of the anchors' ancestors and descendants (the anchors included)."""
    up = anchor.cte("lineage_up", recursive=True)
    step = S.alias("up_step")
    up = up.union(
        select(step.c.parent_session_id).where(
            step.c.id == up.c.id, step.c.parent_session_id.is_not(None)
        )
    )
    down = anchor.cte("lineage_down", recursive=True)
    child = S.alias("down_child")
    down = down.union(select(child.c.id).where(child.c.parent_session_id == down.c.id))
    return select(up.c.id).union(select(down.c.id))


def candidates(policy: Policy, now: float | None = None) -> Select[Any]:
    """``SELECT sessions.id`` of every session ``policy`` deletes, oldest first.

    The one definition of a prune: :meth:`SessionDB.prune_sessions`, :func:`run` and the CLI
    preview all build on it. Active sessions (``ended_at IS NULL``) are never selected.
    """
    old = [S.c.started_at < cutoff(policy, now), S.c.ended_at.is_not(None)]
    if policy.sources:
        old.append(S.c.source.in_(policy.sources))
    criteria = list(old)
    if policy.keep_titled:
        criteria.append(S.c.title.is_(None))
    if policy.keep_lineage:
        kept = S.alias("kept")
        keeps = [
            kept.c.started_at >= cutoff(policy, now),
            kept.c.ended_at.is_(None),
        ]
        if policy.sources:
            keeps.append(kept.c.source.not_in(policy.sources))
        if policy.keep_titled:
            keeps.append(kept.c.title.is_not(None))
        anchors = select(kept.c.id.label("id")).where(sa.or_(*keeps))
        criteria.append(S.c.id.not_in(_lineage_of(anchors)))
    return select(S.c.id).where(*criteria).order_by(S.c.started_at, S.c.id)


def preview(conn: Connection, policy: Policy, now: float | None = None) -> list[dict[str, Any]]:
    """What :func:`candidates` selects, oldest first, with what a person checks before a prune
    (id, title, source, started_at, ended_at, message_count)."""
    doomed = candidates(policy, now).subquery()
    columns = (S.c.id, S.c.title, S.c.source, S.c.started_at, S.c.ended_at, S.c.message_count)
    statement = (
        select(*columns).where(S.c.id.in_(select(doomed.c.id))).order_by(S.c.started_at, S.c.id)
    )
    return [dict(row._mapping) for row in conn.execute(statement)]


def delete_sessions(conn: Connection, ids: Sequence[str]) -> tuple[int, int]:
    """Delete these sessions and their messages on ``conn``; their children are orphaned.

    Returns (sessions, messages) actually deleted: rows another job removed first count 0.
    """
    if not ids:
        return 0, 0
    chunk = list(ids)
    # Lock the rows first (PostgreSQL; SQLite's write lock already covers it): an append
    # bumps its session's row before inserting, so it either lands before this delete, which
    # then removes its message too, or waits and finds the session gone (UnknownSessionError).
    # Without it a racing append's message broke the final DELETE's foreign key.
    conn.execute(select(S.c.id).where(S.c.id.in_(chunk)).with_for_update())
    conn.execute(update(S).where(S.c.parent_session_id.in_(chunk)).values(parent_session_id=None))
    messages = conn.execute(delete(M).where(M.c.session_id.in_(chunk))).rowcount
    sessions = conn.execute(delete(S).where(S.c.id.in_(chunk))).rowcount
    return int(sessions), int(messages)


@dataclass
class Report:
    """What a retention run did."""

    sessions: int = 0
    messages: int = 0
    chunks: int = 0
    largest_chunk: int = 0
    index_merged: bool = False


def run(
    uow: UnitOfWork,
    policy: Policy,
    *,
    chunk: int = DEFAULT_CHUNK,
    secure_delete: bool = False,
    merge_index: bool = False,
    now: float | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
    pause: float | None = None,
) -> Report:
    """Delete what ``policy`` selects, ``chunk`` sessions per write unit, until none is left.

    The cutoff is fixed when the run starts. ``secure_delete`` (SQLite) overwrites the freed
    pages with zeros, so deleted text does not linger in the file's free pages; ``merge_index``
    then compacts the full-text index in bounded steps so the deleted words leave its segments
    too (see :func:`hermes_store.ops.maintenance.merge_index`). ``on_chunk(sessions, messages)``
    is called after each committed chunk (progress bars). ``pause`` (default
    :data:`YIELD_S` on SQLite, 0 on PostgreSQL, whose row locks queue nobody behind the whole
    table) is slept between chunks so writers waiting for SQLite's one write lock go first.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
        raise InvalidInputError(f"chunk must be a whole number from 1 to {MAX_CHUNK}")
    if pause is None:
        pause = YIELD_S if uow.is_sqlite else 0.0
    started = time.time() if now is None else now
    select_chunk = candidates(policy, started).limit(chunk)
    report = Report()

    def unit(conn: Connection) -> tuple[list[str], int, int]:
        with maintenance.secure_deletes(conn, secure_delete):
            ids = list(conn.scalars(select_chunk))
            sessions, messages = delete_sessions(conn, ids)
        return ids, sessions, messages

    while True:
        ids, sessions, messages = uow.run(unit)
        if not ids:
            break
        report.chunks += 1
        report.sessions += sessions
        report.messages += messages
        report.largest_chunk = max(report.largest_chunk, sessions)
        if on_chunk is not None:
            on_chunk(sessions, messages)
        if pause > 0:
            time.sleep(pause)  # not synchronisation: leave the write lock to queued writers
    if merge_index and report.sessions:
        maintenance.merge_index(uow, secure_delete=secure_delete)
        report.index_merged = True
    return report


def would_delete(uow: UnitOfWork, policy: Policy, now: float | None = None) -> list[dict[str, Any]]:
    """What a :func:`run` of ``policy`` starting now would delete, read in one read unit of
    ``uow``: :func:`preview`'s rows, for a dry run or the question before a prune."""
    with uow.connect(write=False) as conn:
        return preview(conn, policy, now)
