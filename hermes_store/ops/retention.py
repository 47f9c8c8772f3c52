"""Retention: which old sessions a policy deletes, and a chunked job that deletes them.

One function, :func:`candidates`, says which sessions a policy selects; the store's one-shot
``prune_sessions``, the CLI's ``--dry-run`` preview and the periodic :func:`run` all use it, so a
preview lists exactly what a prune deletes.

:func:`run` deletes in steps, each its own write unit (``BEGIN IMMEDIATE`` on SQLite) sized to
hold the write lock for a bounded time (:mod:`hermes_store.ops.pacing`), so a writer never waits
behind more than one step. Each step re-selects its candidates inside the locked transaction, so
two jobs racing (two cron entries, two machines on one PostgreSQL) delete every session once and
their reported counts add up to what was deleted. A full-text index that a few reads find
damaged is refused before the first step (each step would commit its deletes into it, and the
first merge of the lost pages would fail midway); a run that fails midway all the same says
what its committed steps deleted. :func:`maybe_run` runs a policy by itself, at most once a
day across processes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql import CompoundSelect, Select

from hermes_store import jsontext
from hermes_store.echo import echoed
from hermes_store.engine import placement
from hermes_store.engine.factory import default_db_path, make_private_dirs, sqlite_file
from hermes_store.errors import InvalidInputError, NotADatabaseError, UnsafePathError
from hermes_store.ops import maintenance, pacing
from hermes_store.schema import fulltext
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.tables import write_keys_table as K
from hermes_store.uow.unit import UnitOfWork

log = logging.getLogger(__name__)

#: The most sessions one step (write unit) considers; how much text it deletes is paced.
DEFAULT_CHUNK = 200
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
            raise InvalidInputError(f"older_than_days must be a number, not {echoed(days)}")
        if not math.isfinite(float(days) * 86400):  # as prune_sessions: inf would pass cutoff()
            raise InvalidInputError(f"older_than_days must be a finite number, not {echoed(days)}")
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
    """Delete these sessions, their messages and their writes' idempotency keys on ``conn``;
    their children are orphaned.

    Returns (sessions, messages) actually deleted: rows another job removed first count 0.
    """
    if not ids:
        return 0, 0
    # Lock the rows first (PostgreSQL; SQLite's write lock already covers it): an append
    # bumps its session's row (after inserting its message, in the same statement), so it
    # either lands before this delete, which then removes its message too, or waits and
    # finds the session gone (UnknownSessionError). Without it a racing append's message
    # broke the final DELETE's foreign key. Only the sessions locked here are deleted: one
    # created meanwhile (invisible to the lock, its messages committed after the messages'
    # DELETE) came after this delete, and stays.
    chunk = list(conn.scalars(select(S.c.id).where(S.c.id.in_(list(ids))).with_for_update()))
    if not chunk:
        return 0, 0
    conn.execute(update(S).where(S.c.parent_session_id.in_(chunk)).values(parent_session_id=None))
    messages = conn.execute(delete(M).where(M.c.session_id.in_(chunk))).rowcount
    conn.execute(delete(K).where(K.c.session_id.in_(chunk)))  # a re-send finds no session
    sessions = conn.execute(delete(S).where(S.c.id.in_(chunk))).rowcount
    return int(sessions), int(messages)


@dataclass
class Report(pacing.StepTally):
    """What a retention run did. ``chunks``: the steps (write units) that deleted something;
    ``largest_chunk``: the most sessions one of them deleted; the tally counts every step, the
    index merge's included (kinds "prune": deletes, "merge": the index)."""

    sessions: int = 0
    messages: int = 0
    chunks: int = 0
    largest_chunk: int = 0
    index_merged: bool = False

    def add_merge(self, merged: maintenance.Report, *, full: bool = True) -> None:
        """Count the index merge that followed the deletes (``full``: the whole index was
        merged, not only its small segments)."""
        self.index_merged = self.index_merged or full
        self.add(merged)


#: What deleting a message costs beside its text (its row, its index entries, the full-text
#: delete record), counted as characters of text: a step's size is characters deleted.
ROW_COST = 512
#: A first step deletes this much (then the pace follows what steps measure).
FIRST_STEP_CHARS = 256 * 1024
#: The least a step deletes: a few milliseconds of work beside its commit, so a step that
#: took long (a stalled machine) does not leave the job crawling at one message a step.
MIN_STEP_CHARS = 64 * 1024
MAX_STEP_CHARS = 1 << 30
#: Messages read at a time while a step picks what fits in it.
ROWS_PER_READ = 500
#: Messages one DELETE statement removes at most (by count and by characters): the step
#: looks at its clock between statements.
GROUP_ROWS = 64
GROUP_CHARS = 64 * 1024
_SIZES = (
    select(M.c.id, func.coalesce(func.length(M.c.content), 0))
    .where(M.c.session_id == sa.bindparam("sid"))
    .order_by(M.c.id)
    .limit(sa.bindparam("rows"))
)
_DELETE_MESSAGES = delete(M).where(M.c.id.in_(sa.bindparam("ids", expanding=True)))


@dataclass
class _Deleted:
    sessions: int = 0
    messages: int = 0
    found: bool = False
    characters: int = 0


def _delete_within(conn: Connection, ids: Sequence[str], budget: pacing.Budget) -> _Deleted:
    """Delete the sessions ``ids`` (oldest first), each whole with its messages, while the
    budget has room for another (at least one, so every step progresses), a few dozen
    messages per statement.

    A session is never split across steps: a step that ended inside one committed the loss of
    its oldest messages, and when the policy stopped selecting it before the next step (the
    session reopened, titled or continued meanwhile) it was kept without them. A session
    with more text than a step's budget holds the write lock for its own deletion alone."""
    done = _Deleted(found=bool(ids))
    for sid in ids:
        if done.characters and (done.characters >= budget.size or not budget.left()):
            break
        gone = 0
        while True:
            rows = conn.execute(_SIZES, {"sid": sid, "rows": ROWS_PER_READ}).all()
            group: list[int] = []
            group_chars = 0
            for message_id, size in rows:
                cost = int(size) + ROW_COST
                group.append(int(message_id))
                group_chars += cost
                done.characters += cost
                if len(group) >= GROUP_ROWS or group_chars >= GROUP_CHARS:
                    gone += int(conn.execute(_DELETE_MESSAGES, {"ids": group}).rowcount)
                    group, group_chars = [], 0
            if group:
                gone += int(conn.execute(_DELETE_MESSAGES, {"ids": group}).rowcount)
            if len(rows) < ROWS_PER_READ:
                break
        sessions, messages = delete_sessions(conn, [sid])
        done.sessions += sessions
        done.messages += gone + messages
        done.characters += ROW_COST
    return done


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
    step_seconds: float = pacing.STEP_SECONDS,
    step_log: pacing.StepLog | None = None,
    stop: threading.Event | None = None,
    on_merge: maintenance.OnStep | None = None,
    report: Report | None = None,
) -> Report:
    """Delete what ``policy`` selects, in steps that each hold the write lock for about
    ``step_seconds`` at most (see :mod:`hermes_store.ops.pacing`), until none is left.

    A step re-selects at most ``chunk`` candidates inside its locked transaction and deletes
    as many of them, each whole, as the pace says fits (at least one: a session with more
    text than that is a step of its own). The cutoff is fixed when the run starts.
    ``secure_delete`` (SQLite) overwrites the freed pages with zeros, so deleted text does not
    linger in the file's free pages. The deletes' records in the full-text index are merged
    as the run goes, and at its end the small segments are folded together
    (:func:`hermes_store.ops.maintenance.settle_index`); ``merge_index`` merges the whole
    index instead, so the deleted words leave its big segments too (see
    :func:`hermes_store.ops.maintenance.merge_index`: its steps for common words hold the
    write lock longer than the bound; ``db optimize`` runs it too). ``on_merge(kind, pages)``
    follows those merge steps. ``on_chunk(sessions, messages)`` is
    called after each committed step (progress bars). Between steps the WAL is checkpointed
    and the job pauses (``pause`` seconds; default: half the step's hold on SQLite, none on
    PostgreSQL) so waiting writers go first. ``step_log`` receives every step. ``stop``, once
    set, ends the run after the step in progress (what was committed stays deleted).

    A full-text index found damaged (:func:`check_index`) is refused before anything is
    deleted. ``report``, when given, is the one filled in as each step commits, so a caller
    knows what landed when the run fails or is interrupted midway; the error raised then
    also carries it as a note (the committed steps stay deleted).
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
        raise InvalidInputError(f"chunk must be a whole number from 1 to {MAX_CHUNK}")
    bound = pacing.check_bound(step_seconds)
    if pause is not None and (
        isinstance(pause, bool) or not isinstance(pause, int | float) or not 0 <= pause <= 10
    ):
        raise InvalidInputError("pause must be a number of seconds from 0 to 10")
    steps = step_log if step_log is not None else pacing.StepLog()
    started = time.time() if now is None else now
    select_chunk = candidates(policy, started).limit(chunk)
    report = Report() if report is None else report
    report.bound_s = bound
    pace = pacing.Pace("prune", FIRST_STEP_CHARS, MIN_STEP_CHARS, MAX_STEP_CHARS, bound)
    check_index(uow)  # before the first write (the job's FTS5 settings are one)

    def body(conn: Connection, budget: pacing.Budget) -> tuple[_Deleted, int]:
        with maintenance.secure_deletes(conn, secure_delete):
            done = _delete_within(conn, list(conn.scalars(select_chunk)), budget)
        return done, done.characters

    merging = pacing.Pace(
        "merge", maintenance.MERGE_PAGES, maintenance.MIN_MERGE_PAGES, 4096, bound
    )
    try:
        with maintenance.paced_index_merging(uow) as tables:
            while True:
                if stop is not None and stop.is_set():
                    return report
                done, step = pacing.run_step(uow, pace, steps, body)
                report.record(step)
                if not done.found:
                    break
                report.chunks += 1
                report.sessions += done.sessions
                report.messages += done.messages
                report.largest_chunk = max(report.largest_chunk, done.sessions)
                if on_chunk is not None:
                    on_chunk(done.sessions, done.messages)
                pacing.between_steps(uow, step, pause)
                if tables:  # the delete records of the step merged as they come
                    tidied = maintenance.tidy_step(
                        uow, merging, steps, tables, secure_delete=secure_delete
                    )
                    report.record(tidied)
                    pacing.between_steps(uow, tidied, pause)
            stopped = stop is not None and stop.is_set()
            if report.sessions and not stopped:
                # Inside the job's FTS5 settings: with FTS5's own merging back on, a writer's
                # append continued the merge in progress inside its own transaction.
                merged = maintenance.Report(uow.engine.dialect.name, 0)
                options: dict[str, Any] = {
                    "secure_delete": secure_delete,
                    "step_seconds": bound,
                    "step_log": steps,
                    "pause": pause,
                    "on_step": on_merge,
                    "stop": stop,
                }
                if merge_index:
                    maintenance.merge_index(uow, merged, **options)
                else:
                    maintenance.settle_index(uow, tables, merged, **options)
                report.add_merge(merged, full=merge_index)
        if not (stop is not None and stop.is_set()):
            expire_write_keys(uow, now=started)
    except BaseException as error:
        # The steps committed before it stay deleted: say so, whoever catches it.
        if report.sessions or report.messages:
            error.add_note(f"retention: {landed(report)}")
        raise
    return report


def landed(report: Report) -> str:
    """What a run that stopped midway had committed, in words."""
    return (
        f"{report.sessions} session(s) and {report.messages} message(s) were deleted before "
        "it stopped (whole steps, committed); the others are kept"
    )


def check_index(uow: UnitOfWork) -> None:
    """Refuse (:class:`NotADatabaseError`) a SQLite database whose full-text index a few
    reads find damaged (:func:`hermes_store.schema.fulltext.missing_index_pages`): a prune would
    commit its deletes into it step by step, then fail at its first merge of the lost pages.
    Cheap at any size; FTS5's whole 'integrity-check' is the doctor's."""
    if not uow.is_sqlite:
        return
    with uow.connect(write=False) as conn:
        problems = fulltext.missing_index_pages(conn)
    if problems:
        raise NotADatabaseError(
            f"the full-text index is damaged: {'; '.join(problems)}. Nothing was deleted: "
            "run `hermes-store doctor --rebuild-index`, then prune again"
        )


#: How long an idempotency key is kept (seconds): a re-send comes within minutes of the call
#: it repeats; a week leaves room for a gateway that was down for days, and no more.
WRITE_KEY_LIFETIME_S = 7 * 86400.0
#: Keys one expiry unit deletes at most (each unit is short).
WRITE_KEY_CHUNK = 1000


def expire_write_keys(
    uow: UnitOfWork, *, now: float | None = None, lifetime_s: float = WRITE_KEY_LIFETIME_S
) -> int:
    """Delete idempotency keys recorded more than ``lifetime_s`` ago, in short units of
    :data:`WRITE_KEY_CHUNK` keys; how many were deleted. A call re-sent after that lands anew.
    Every :func:`run` of a policy ends with it."""
    before = (time.time() if now is None else now) - lifetime_s
    oldest = (
        select(K.c.key)
        .where(K.c.created_at < before)
        .order_by(K.c.created_at)
        .limit(WRITE_KEY_CHUNK)
        .scalar_subquery()
    )
    statement = delete(K).where(K.c.key.in_(oldest))
    total = 0
    while True:
        gone = uow.run(lambda conn: int(conn.execute(statement).rowcount))
        total += gone
        if gone < WRITE_KEY_CHUNK:
            break
    if total:
        log.info("retention: expired %d idempotency keys older than %.0f s", total, lifetime_s)
    return total


def would_delete(uow: UnitOfWork, policy: Policy, now: float | None = None) -> list[dict[str, Any]]:
    """What a :func:`run` of ``policy`` starting now would delete, read in one read unit of
    ``uow``: :func:`preview`'s rows, for a dry run or the question before a prune."""
    with uow.connect(write=False) as conn:
        return preview(conn, policy, now)


# -- retention that runs by itself ---------------------------------------------------------------

#: How often a policy runs by itself at most (seconds): once a day.
EVERY_S = 86400.0
#: Beside a SQLite database: when its policy last started, which process, what it deleted.
MARKER_SUFFIX = "-retention"


def marker_for(uow: UnitOfWork) -> Path:
    """Where the last run of a database's policy is recorded.

    A SQLite file: beside it (the file a symlink names), so every process using the file
    finds it. A server database (PostgreSQL) has no file: the marker is kept under
    ``$HERMES_HOME/retention/`` (else ``~/.hermes/retention/``), named by a digest of the
    server, database, user and schema (never the password), so the processes of one machine
    share it. Machines of a fleet each keep their own, so each runs the policy at most once a
    day; a run is safe beside another (each session is deleted once), so that costs repeated
    work, never a wrong result. An in-memory database lives only as long as its process:
    :class:`InvalidInputError` (pass ``marker=PATH`` to :func:`maybe_run` anyway).
    """
    url = uow.engine.url
    path = sqlite_file(url)
    if path is not None:
        return Path(f"{os.path.realpath(path)}{MARKER_SUFFIX}")
    if url.get_backend_name() == "sqlite":
        raise InvalidInputError(
            "retention that runs by itself keeps its last run beside the database, and an "
            "in-memory database has no lasting place for it: pass marker=PATH to maybe_run, "
            "or prune with SessionDB.prune_sessions"
        )
    schema = placement.of(uow.engine).schema or ""
    identity = f"{url.set(password=None).render_as_string(hide_password=True)}#{schema}"
    digest = hashlib.sha256(identity.encode("utf-8")).hexdigest()[:32]
    folder = marker_home()
    make_private_dirs(folder)
    return folder / f"{url.get_backend_name()}-{digest}{MARKER_SUFFIX}"


def marker_home() -> Path:
    """The folder of the markers of server databases: ``retention`` beside the default
    database (``$HERMES_HOME``, else ``~/.hermes``; resolved now, not at import)."""
    return default_db_path().parent / "retention"


def _read_marker(fd: int) -> dict[str, Any]:
    raw = os.pread(fd, 64 * 1024, 0)
    try:
        record = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (UnicodeDecodeError, ValueError):
        log.warning("retention marker unreadable (%d bytes): taken as never run", len(raw))
        return {}
    return record if isinstance(record, dict) else {}


def _write_marker(fd: int, record: dict[str, Any]) -> None:
    data = jsontext.dumps(record, sort_keys=True).encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


@contextmanager
def _locked_marker(marker: Path) -> Iterator[int]:
    """The marker file, created owner-only, under an exclusive ``flock`` (held for the
    microseconds a claim takes, so waiting is fine); never through a symbolic link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(marker, flags, 0o600)
    except OSError as error:
        raise UnsafePathError(f"cannot open the retention marker {marker}: {error}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"the retention marker {marker} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def claim(marker: Path, *, now: float | None = None, every: float = EVERY_S) -> bool:
    """Record a run starting now unless one started less than ``every`` seconds ago: True
    when this caller may run. Atomic across processes and threads (the check and the write
    happen under one ``flock`` of the marker), so of many processes opening the database at
    once exactly one runs the policy."""
    now = time.time() if now is None else now
    with _locked_marker(marker) as fd:
        record = _read_marker(fd)
        last = record.get("started_at")
        if isinstance(last, int | float) and not isinstance(last, bool) and now - last < every:
            return False
        _write_marker(fd, {"started_at": now, "pid": os.getpid()})
    return True


def last_run(marker: Path) -> dict[str, Any]:
    """What the marker records (empty: never run): ``started_at``, ``pid``, and once the run
    ended ``finished_at``, ``sessions``, ``messages``."""
    if not marker.exists():
        return {}
    with _locked_marker(marker) as fd:
        return _read_marker(fd)


def maybe_run(
    uow: UnitOfWork,
    policy: Policy,
    *,
    marker: Path | None = None,
    now: float | None = None,
    every: float = EVERY_S,
    stop: threading.Event | None = None,
    **options: Any,
) -> Report | None:
    """Run ``policy`` (:func:`run`, then the index merge) unless it started less than
    ``every`` seconds ago in any process; None when it did not run. The start is recorded
    before the run (:func:`claim`), so a run cut short (``stop`` set, the process ended)
    waits for the next day like a finished one, having kept every step it committed."""
    marker = marker_for(uow) if marker is None else marker
    if not claim(marker, now=now, every=every):
        return None
    report = run(uow, policy, now=now, merge_index=True, stop=stop, **options)
    with _locked_marker(marker) as fd:
        record = _read_marker(fd)
        record.update(
            finished_at=time.time(),
            sessions=report.sessions,
            messages=report.messages,
            stopped=bool(stop is not None and stop.is_set()),
        )
        _write_marker(fd, record)
    return report


class Background:
    """:func:`maybe_run` in a daemon thread, for a store opened with a retention policy: the
    agent's work goes on while old sessions go, a step at a time. :meth:`stop` ends it between
    two steps and waits for it (the store's ``close``)."""

    def __init__(self, uow: UnitOfWork, policy: Policy, marker: Path | None = None) -> None:
        self.marker = marker_for(uow) if marker is None else marker
        self.report: Report | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(uow, policy), name="hermes-retention", daemon=True
        )
        self._thread.start()

    def _run(self, uow: UnitOfWork, policy: Policy) -> None:
        try:
            self.report = maybe_run(uow, policy, marker=self.marker, stop=self._stop)
        except Exception as error:  # kept and logged: no caller is there to raise to
            self.error = error
            notes = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))
            log.error("retention run failed: %s%s", error, notes)
        finally:
            self.done.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the run to end after its current step; wait up to ``timeout`` seconds."""
        self._stop.set()
        self._thread.join(timeout)
