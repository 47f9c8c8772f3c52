"""The one writer of a SQLite file in this process: its turn, its connection, its commits.

Write units wait for their turn as the file's writer in :meth:`SqliteWriter.turn` (the fair
writer queue across processes, :mod:`hermes_store.uow.writequeue`, then an in-process lock
shared by every store on the file), then begin on the one writer connection the process keeps
for that file. The head of the queue polls SQLite's lock without waiting (:class:`_Head`),
marks the line starving once it has waited its share (writers going straight in then queue
behind it), and keeps its place while a foreign writer holds SQLite's lock; a head that writes
back to back, behind a holder that does too, waits out a longer share first (the patient
head). After each commit the WAL the writer wrote into must still be the file's
(:meth:`SqliteWriter.acknowledge`); the PASSIVE checkpoints run here too.

Group commit (:mod:`hermes_store.uow.groupcommit`) drives a writer through its public methods:
``turn()``, ``begin(turn)``, ``is_retryable()``, ``pause()``, ``acknowledge()`` and
``end_group()``.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from hermes_store.engine.factory import BUSY_OPTION, WRITE_OPTION, SqliteSettings, begin_on_driver
from hermes_store.errors import (
    DatabaseLockedError,
    HermesStoreError,
    StoreMisuseError,
    WalDeletedError,
    is_retryable,
    mapped_errors,
    wrap_driver_error,
)
from hermes_store.uow import fork, retry, writequeue
from hermes_store.uow.counters import Counters
from hermes_store.uow.interrupts import NOTHING_HELD, acquire_now, holding

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A head that finds SQLite's lock taken (by a writer that went straight in, or a foreign one)
#: asks again without waiting every HEAD_POLL_S: a holder that is not writing back to back
#: lets go at once (a head sleeping its whole share instead left the lock idle: measured, one
#: hog and five occasional writers, the hog at 0.42x the original's throughput). Once it has
#: waited STARVE_AFTER_S it marks the line starving: newcomers, which try SQLite's lock before
#: the line while no one starves, queue behind it instead, and it asks every
#: HEAD_POLL_STARVING_S for the rest of HEAD_FAST_S: the lock is free at the holder's next
#: commit. Short: each member of a line of N waits about N times STARVE_AFTER_S.
STARVE_AFTER_S = 0.002
HEAD_POLL_S = 0.0005
HEAD_POLL_STARVING_S = 0.0001
HEAD_FAST_S = 0.1
#: A head that has waited this long since it asked for its turn (the line ahead of it
#: included) marks the line at once: when the line is long, it drains in order.
STARVE_IN_LINE_S = 0.1
#: While it polls, the head beats (the line counts as moving) at most this often.
HEAD_BEAT_EVERY_S = 0.05
#: A unit that asks within this of the process's previous commit on the file follows it back
#: to back; after PATIENT_AFTER such units in a row the process is a back-to-back writer.
BACK_TO_BACK_S = 0.01
PATIENT_AFTER = 12
#: A back-to-back writer at the head of the line lets the holder (going straight in) keep the
#: lock for up to PATIENT_SHARE_S, as long as its own wait since it asked stays within
#: PATIENT_WAIT_S (so shares shrink as the line grows, and with a few writers a wait stays
#: under a quarter of the original store's longest: 531-833 ms at 4x1 where it was set).
#: Meanwhile it looks every PATIENT_LOOK_S (``PRAGMA data_version``) and asks SQLite once
#: PATIENT_STILL_LOOKS looks in a row saw no commit land.
PATIENT_SHARE_S = 0.07
PATIENT_WAIT_S = 0.12
PATIENT_LOOK_S = 0.002
PATIENT_STILL_LOOKS = 1
#: Past the fast polls (a foreign writer, the original store or a sqlite3 shell, holds the lock
#: long), the head asks with this busy timeout, then pauses (jittered) and asks again, keeping
#: its place; its heartbeat keeps the line waiting.
QUEUE_HEAD_BUSY_TIMEOUT_S = 0.2
#: How often (seconds) a writer's commits check that its WAL is still the file's.
WAL_CHECK_EVERY_S = 0.1
#: The clock of the back-to-back count (a test moves it).
_monotonic = time.monotonic
#: ``wal_id`` of a writer that found no WAL at its first commit (not in WAL mode).
_NO_WAL = (-1, -1)
#: Whether a pooled writer connection is in WAL mode (its ``info``; see ``in_wal``).
_WAL_KEY = "hermes_writes_wal"


def again(error: HermesStoreError) -> HermesStoreError:
    """A fresh exception like ``error`` (one instance is never raised twice)."""
    return type(error)(*error.args)


def store_closed() -> StoreMisuseError:
    """The error of work that goes on through a closed store (an iterator, a thread's call
    that looked the store up before ``close()``): it may open no connection any more."""
    return StoreMisuseError(
        "this store is closed: work started before close() cannot go on (open the store "
        "again for it)"
    )


def interrupt_of(error: BaseException) -> BaseException:
    """The interrupt (Ctrl-C) ``error`` stands for: SQLAlchemy's commit or rollback,
    interrupted, raises an AssertionError of its own bookkeeping (``finally: assert``) in
    place of it. Any other error is itself."""
    if isinstance(error, AssertionError):
        context = error.__context__
        if context is not None and not isinstance(context, Exception):
            return context
    return error


def reraise(error: BaseException) -> NoReturn:
    """Raise ``error`` again, or the interrupt it stands for (:func:`interrupt_of`): a caller
    cut short sees its Ctrl-C, not SQLAlchemy's bookkeeping."""
    interrupt = interrupt_of(error)
    if interrupt is error:
        raise error
    raise interrupt from None


def discard(conn: Connection, driver: Any = None) -> None:
    """Close ``conn`` for good after a rollback or commit cut short (SQLAlchemy's state for
    it is unknown): its DB-API connection is invalidated, that is closed, which rolls back its
    transaction (SQLite releases its write lock). ``driver``: the DB-API connection, closed
    directly when SQLAlchemy cannot invalidate it."""
    if conn.closed:
        return  # discarded already (its pooled connection let go of)
    try:
        conn.invalidate()
    except Exception as error:
        log.warning("discarding a connection whose rollback was cut short: %s", error)
        if driver is not None:
            try:
                driver.close()
            except Exception as closing:
                log.warning("closing its DB-API connection: %s", closing)
    try:
        conn.close()
    except Exception as error:  # its transaction's bookkeeping, cut short: nothing is open
        log.debug("closing a discarded connection: %s", error)


class SqliteWriter:
    """The writer of one SQLite file in this process (one per Unit of Work, so per file).

    ``lock``: the in-process write lock every write unit of the process holds for its turn;
    ``connection``: the writer connection, kept open between units (None until the first write,
    and after a unit that failed: the next one starts on a fresh connection); ``refused``: why
    this process may not write the file (a forked child refused it, a WAL deleted under it).
    """

    #: Seconds between two checks that the writer's WAL is still the file's (see acknowledge).
    wal_check_every: float = WAL_CHECK_EVERY_S

    def __init__(
        self,
        engine: Engine,
        settings: SqliteSettings,
        *,
        policy: retry.RetryPolicy,
        counters: Counters,
        queue_path: Path | None,
        wal_path: str | None,
        file_key: tuple[int, int] | None,
        where: str,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self._writer_engine = engine.execution_options(**{WRITE_OPTION: True})
        self._dialect = engine.dialect
        self.dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self.policy = policy
        self.counters = counters
        self.queue_path = queue_path
        self.wal_path = wal_path
        self.file_key = file_key
        self.where = where
        # In-process writers queue here; other processes meet SQLite's write lock.
        self.lock = threading.Lock()
        # Held with ``with self._turn_lock`` (entered in C): Condition's own __enter__ is
        # Python code an interrupt (Ctrl-C) can leave after taking the lock, held for good.
        self._turn_lock = counters.lock
        self._turn_changed = threading.Condition(counters.lock)
        self._waiting = 0  # threads of this process waiting for their write turn
        #: Threads of this process in :meth:`turn` (in line, waiting for the lock, or writing):
        #: while there are any, a write of this process takes no shortcut past them.
        self.in_line = 0
        self.connection: Connection | None = None
        #: The writer connection's DB-API connection and its pool record's info (set with it).
        self.driver: Any = None
        self.info: dict[Any, Any] = {}
        #: Released for good (its store closed): opens no connection, attaches to no queue.
        self.closed = False
        self.refused: HermesStoreError | None = (
            fork.REFUSED.get(file_key) if file_key is not None else None
        )
        self._wal_id: tuple[int, int] | None = None  # the WAL the writer connection writes into
        self._wal_check_due = 0.0  # when the next commit stats the WAL (see acknowledge)
        self._queue: writequeue.WriteQueue | None = None  # attached at the first turn
        #: When this process last committed on the file, and how many units in a row asked
        #: within BACK_TO_BACK_S of the commit before them (see :attr:`back_to_back`).
        self.committed_at = 0.0
        self.asked_at = 0.0  #: when the unit in hand asked for a queued turn (0: straight in)
        self.streak = 0
        #: Whether the unit in hand is a hot single-call write's (set as its turn is given):
        #: a unit of a job (a prune or merge step, a migration, a transaction) is not, and
        #: keeps the 2 ms share, so a job's merge steps keep up with a writer appending beside it.
        self.hot = False
        #: Whether this process's next write may go straight in past a line (set by the
        #: straight-in path: off for a process whose threads met, which then waits in line).
        self.goes_straight_in: Callable[[], bool] = _never

    # -- the turn ----------------------------------------------------------------------------

    @property
    def write_queue(self) -> writequeue.WriteQueue | None:
        """This process's fair writer queue for the database file (None: not a file, or off),
        attached from the first look until :meth:`release`."""
        queue = self._queue
        if queue is None and self.queue_path is not None:
            with self._turn_lock:
                queue = self._queue
                if queue is None:
                    if self.closed:
                        raise store_closed()
                    queue = self._queue = writequeue.attach(self.queue_path)
        return queue

    @holding
    def turn(self, *, queued: bool = True, hot: bool = False) -> Iterator[writequeue.Turn | None]:
        """Wait for this unit's turn as the file's writer; held from before BEGIN IMMEDIATE
        until after COMMIT/ROLLBACK: first a place in the fair writer queue across processes
        and threads (``queued=False`` skips it), then the in-process lock. A caller that
        catches an interrupt (Ctrl-C) lets the turn go with ``release()``: one raised as the
        turn is given, or as its ``with`` ends, leaves it held otherwise.

        ``hot``: the turn is a hot single-call write's (or a group of them): only such a turn
        says "goes on" as it ends, and only such a head waits patiently (:attr:`hot`)."""
        lock = self.lock
        queue = self.write_queue if queued else None
        place = queue.turn() if queue is not None else NOTHING_HELD
        entered = False
        try:
            with self._turn_lock:
                self.in_line += 1  # no eval-breaker check between these two lines
                entered = True
            with place as turn:
                if turn is not None and turn.queued:
                    with self._turn_lock:
                        self.counters.stats.queue_turns += 1
                waiting = lock.locked()  # another thread of this process writes: a wait, counted
                started = time.monotonic() if waiting else 0.0
                if waiting:
                    with self._turn_lock:
                        self.counters.stats.lock_waits += 1
                        self._waiting += 1
                        self._turn_changed.notify_all()
                try:
                    with lock:  # entered in C: an interrupt (Ctrl-C) never leaves it held
                        if waiting:
                            waiting = False
                            self._waited(started)
                        self.hot = hot
                        yield turn
                        if (
                            hot
                            and turn is not None
                            and self.back_to_back
                            and self.goes_straight_in()
                        ):
                            turn.say_goes_on()  # before the turn ends: the next head reads it
                finally:
                    if waiting:  # interrupted while it waited
                        self._waited(started)
        except BaseException:
            place.release()  # an interrupt as the place was given or its with ended
            raise
        finally:
            if entered:
                with self._turn_lock:
                    self.in_line -= 1

    def _waited(self, started: float) -> None:
        with self._turn_lock:
            self._waiting -= 1
            self.counters.stats.lock_wait_seconds += time.monotonic() - started

    def wait_for_waiting(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` threads wait for their write turn (False: timed
        out); lets callers and tests know a writer is queued without polling."""
        with self._turn_lock:
            return self._turn_changed.wait_for(lambda: self._waiting >= count, timeout)

    # -- beginning ---------------------------------------------------------------------------

    def connect(self) -> Connection:
        """The writer connection (opened at the first write): writes are serialised by the
        turn anyway, so one connection serves them all."""
        if self.refused is not None:
            raise again(self.refused)
        conn = self.connection
        if conn is None:
            conn = self._open()
        return conn

    def _open(self) -> Connection:
        """A new writer connection, kept only once whole: the connection, its DB-API
        connection and its info are set in one step (an interrupt (Ctrl-C) anywhere before
        leaves no writer connection, never one without its driver)."""
        if self.closed:
            raise store_closed()
        conn = self._writer_engine.connect()
        try:
            pooled = conn.connection
            driver, info = pooled.driver_connection, pooled.info
        except BaseException:
            conn.close()  # given back now, not left to the collector
            raise
        self.connection, self.driver, self.info = conn, driver, info
        return conn

    @property
    def in_wal(self) -> bool:
        """The writer connection (opened) writes into a WAL: once its ``BEGIN IMMEDIATE``
        holds the lock, its statements and ``COMMIT`` never wait for readers, so a begin with
        busy timeout 0 is safe to the end (in rollback-journal mode a ``COMMIT`` waits for
        readers through the busy timeout). Asked once per connection."""
        info = self.info
        known = info.get(_WAL_KEY)
        if known is None:
            try:
                mode = self.driver.execute("PRAGMA journal_mode").fetchone()
            except self.dbapi_error:
                return False  # asked again next time; the busy timeout covers it meanwhile
            known = info[_WAL_KEY] = bool(mode) and str(mode[0]).lower() == "wal"
        return bool(known)

    @property
    def back_to_back(self) -> bool:
        """This process writes the file back to back (its last PATIENT_AFTER units each asked
        right after the commit before them): a head that may wait out a holder's share."""
        return self.streak >= PATIENT_AFTER

    def data_version(self) -> int | None:
        """SQLite's count of commits by other connections (``PRAGMA data_version``), asked on
        the writer connection outside a transaction: a patient head's look at the holder.
        None when it cannot tell (no connection, or the question failed: logged)."""
        driver = self.driver
        if driver is None:
            return None
        try:
            row = driver.execute("PRAGMA data_version").fetchone()
        except self.dbapi_error as error:
            log.debug("%s: cannot read data_version: %s", self.where, error)
            return None
        return int(row[0]) if row else None

    @property
    def head_busy_ms(self) -> int:
        """The head's busy timeout: short, and never longer than the writer's own."""
        return min(int(QUEUE_HEAD_BUSY_TIMEOUT_S * 1000), self.settings.writer_ms)

    def begin_unit(self, waits: Iterator[float], turn: writequeue.Turn | None) -> Connection:
        """``BEGIN IMMEDIATE`` through SQLAlchemy (a unit that uses the Connection), inside
        the writer's turn: the head retries here, keeping its place; others pause between
        attempts (``waits``)."""
        head = _Head(self, turn) if turn is not None and turn.queued else None
        while True:
            conn = self.connect()
            conn.execution_options(**{BUSY_OPTION: head.busy_ms if head is not None else None})
            try:
                conn.begin()
            except sa_exc.DBAPIError as error:
                if not is_retryable(error):
                    self.drop(invalidate=False)
                    raise
                if head is not None:
                    head.pause(error)
                else:
                    self.pause(waits, error)
                continue
            except BaseException as error:  # an interrupt midway: SQLAlchemy's state is unknown
                self.discard(conn)  # closed: rolled back, a fresh one next time
                reraise(error)
            return conn

    def begin(self, turn: writequeue.Turn | None) -> Connection:
        """``BEGIN IMMEDIATE`` on the writer's driver connection, inside the writer's turn.
        The queue's head retries here, keeping its place; a fallback turn raises the busy
        error for the caller's retry (a new turn after a jittered pause)."""
        settings = self.settings
        head = _Head(self, turn) if turn is not None and turn.queued else None
        if head is not None:
            head.first_look()
        while True:
            conn = self.connect()
            pooled = conn.connection
            try:
                begin_on_driver(
                    pooled.driver_connection,  # type: ignore[arg-type]
                    pooled.info,
                    settings,
                    write=True,
                    busy_ms=head.busy_ms if head is not None else None,
                )
            except self.dbapi_error as orig:
                error = wrap_driver_error(orig, self._dialect)
                if not is_retryable(error):
                    self.drop(invalidate=False)
                    raise error from orig
                if head is None:
                    raise error from orig
                head.pause(error)
                continue
            return conn

    def is_retryable(self, error: BaseException) -> bool:
        """Whether a failed begin is a lock that another attempt (a new turn) can cure."""
        return isinstance(error, sa_exc.DBAPIError) and is_retryable(error)

    def waits(self) -> Iterator[float]:
        """The pauses of one write's attempts (the retry policy's)."""
        return self.policy.waits()

    def pause(self, waits: Iterator[float], error: BaseException | None) -> None:
        """The pause before the next attempt, or DatabaseLockedError once ``waits`` is spent."""
        retry.pause(self.policy, waits, error, self.counters)

    # -- one unit on the driver --------------------------------------------------------------

    def run_alone(self, fn: Callable[[Connection], T], waits: Iterator[float]) -> T:
        """One attempt of a write unit begun and committed on the writer's driver connection:
        the same turn, begin function (``begin_on_driver``), error mapping and checkpoint
        cadence as every unit. ``fn`` gets the writer Connection, which stays idle in
        SQLAlchemy's eyes: it only ever uses its DB-API cursor."""
        dbapi_error = self.dbapi_error
        taking = self.turn(hot=True)
        try:
            with taking as turn, mapped_errors():
                result = self._run_once(fn, turn, dbapi_error)
        except BaseException:
            taking.release()
            raise
        self.counters.count(True)
        return result

    def _run_once(
        self, fn: Callable[[Connection], T], turn: writequeue.Turn | None, dbapi_error: Any
    ) -> T:
        """:meth:`run_alone`'s unit in its turn: begin, ``fn``, commit; rolled back whole on
        anything raised before the commit returned, an interrupt (Ctrl-C) too."""
        conn = self.begin(turn)
        committing = False
        try:
            driver: Any = conn.connection.driver_connection
            result = fn(conn)
            committing = True
            driver.commit()
        except BaseException as error:
            driver = self.driver
            if driver is None:
                raise  # nothing left to roll back
            if committing and not isinstance(error, dbapi_error) and not driver.in_transaction:
                raise  # an interrupt as the COMMIT returned: the unit landed
            self.counters.record_rollback()
            try:
                driver.rollback()
            except dbapi_error as orig:
                self.drop(invalidate=True)  # state unknown: never reuse it
                raise wrap_driver_error(orig, self._dialect) from orig
            self.drop(invalidate=False)  # a retry starts on a fresh connection
            if isinstance(error, dbapi_error):
                raise wrap_driver_error(error, self._dialect) from error
            raise
        self.acknowledge()
        return result

    # -- ending ------------------------------------------------------------------------------

    def rollback(self, conn: Connection) -> None:
        """Roll back a unit on the writer connection; the next unit starts on a fresh one
        (a connection whose rollback failed is never reused)."""
        try:
            conn.rollback()
        except sa_exc.DBAPIError:
            self.drop(invalidate=True)  # state unknown: never reuse it
            raise
        except BaseException as error:  # an interrupt midway: SQLAlchemy's state is unknown
            self.discard(conn)
            reraise(error)
        self.drop(invalidate=False)  # a retry starts on a fresh connection

    def discard(self, conn: Connection) -> None:
        """Close ``conn`` (the writer connection, if it still is) for good after a rollback or
        commit cut short: closed, it rolls back and releases SQLite's lock; the next unit
        opens a fresh one."""
        driver = None
        if conn is self.connection:
            driver = self.driver
            self.connection, self.driver, self.info, self._wal_id = None, None, {}, None
        discard(conn, driver)

    def end_group(self, conn: Connection, size: int, lost: BaseException) -> None:
        """Roll back a group whose transaction was lost (``lost``: why). Called inside the
        writer's turn by group commit, which commits a group itself."""
        driver: Any = conn.connection.driver_connection
        try:
            driver.rollback()
        except self.dbapi_error:
            self.drop(invalidate=True)  # state unknown: never reuse it
        else:
            self.drop(invalidate=False)
        log.warning("a group of %d writes lost its transaction (%s); each runs again alone",
                    size, lost)  # fmt: skip
        self.counters.record_group(size, lost=True)

    def drop(self, *, invalidate: bool) -> None:
        """Close the writer connection (the next write opens a fresh one)."""
        held = self.connection
        self.connection, self.driver, self.info, self._wal_id = None, None, {}, None
        if held is None:
            return
        if invalidate:
            held.invalidate()
        held.close()

    def release(self) -> None:
        """Close the writer connection, never while a unit is using it, and detach from the
        writer queue (the last writer on the file closes its descriptors), for good: a unit
        that looked this writer up before goes on to :func:`store_closed`, never reopening
        either."""
        with self.turn(queued=False):
            self.closed = True
            self.drop(invalidate=False)
            with self._turn_lock:
                queue, self._queue = self._queue, None
            if queue is not None:
                writequeue.detach(queue)

    # -- the WAL under the writer ------------------------------------------------------------

    def acknowledge(self) -> None:
        """After a COMMIT on the writer: the WAL it wrote into must still be the file's (one
        ``stat``). A WAL deleted or replaced meanwhile means this process lost its locks and
        another process checkpointed and deleted it: the commit is invisible to everyone else
        and lost at exit, so it is reported, not acknowledged.

        At most once per :attr:`wal_check_every` seconds (and at the writer's first commit): a
        ``stat`` of the WAL right after its fsync slowed the next commit by 70-80 µs on ext4
        (a fifth of a lone writer's whole write), so a writer going back to back checks ten
        times a second. The fork handling keeps the WAL from being deleted in the first place;
        this check bounds how long a process that lost its locks anyway goes unnoticed."""
        now = _monotonic()
        asked, self.asked_at = self.asked_at, 0.0
        if (asked or now) - self.committed_at < BACK_TO_BACK_S:
            self.streak += 1
        else:
            self.streak >>= 1  # one slow gap (a busy machine) halves it, a pause ends it
        self.committed_at = now
        path = self.wal_path
        if path is None:
            return
        if self._wal_id is not None and now < self._wal_check_due:
            return
        self._wal_check_due = now + self.wal_check_every
        try:
            st = os.stat(path)
        except FileNotFoundError:
            seen = None
        else:
            seen = (st.st_dev, st.st_ino)
        known = self._wal_id
        if known is None:
            # The writer's first commit: note the WAL it uses (none: not in WAL mode).
            self._wal_id = seen if seen is not None else _NO_WAL
        elif seen != known and known != _NO_WAL:
            raise self._lose_wal()

    def _wal_replaced(self) -> bool:
        """The WAL the writer committed into is no longer the file's (one ``stat``)."""
        known, path = self._wal_id, self.wal_path
        if known is None or known == _NO_WAL or path is None:
            return False
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != known

    def _lose_wal(self) -> WalDeletedError:
        """Refuse further writes to the file in this process; the writer connection is kept
        open, never closed (closing it could checkpoint the deleted WAL over newer pages)."""
        error = WalDeletedError(
            f"the WAL of {self.where} was deleted while this "
            f"process (pid {os.getpid()}) was writing into it: this process had lost its "
            "locks on the database (a fork that inherited an open connection, or a file "
            "handle on the database closed), and another process checkpointed and deleted the "
            "WAL. This write and any since the deletion are NOT in the database; this process "
            "refuses further writes to the file (`hermes-store doctor` names such processes)"
        )
        self.refused = error
        if self.file_key is not None:
            fork.REFUSED.setdefault(self.file_key, error)
        held = self.connection
        self.connection, self.driver, self.info = None, None, {}
        if held is not None:
            fork.keep_forever(held)
        log.error("%s", error)
        return error

    def checkpoint(self) -> bool:
        """A PASSIVE WAL checkpoint: merges what no reader still needs, never waits. Never
        in a process refused the file, nor once the WAL was deleted under its writer."""
        if self.refused is not None:
            log.debug("no WAL checkpoint: %s", self.refused)
            return False
        if self.closed:
            return False  # its connections are let go of: none is opened for it
        if self._wal_replaced():
            log.error("WAL checkpoint skipped: %s", self._lose_wal())
            return False
        held: list[threading.Lock] = []
        try:
            if acquire_now(self.lock, held):  # the writer connection is idle: on it, as the
                driver = self.driver  # original store does (a pool checkout and return
                if driver is not None and not driver.in_transaction:  # cost ~100 µs of CPU)
                    return self.checkpoint_on(driver)
        finally:
            if held:
                held[0].release()
        try:
            # On a pooled connection's driver, outside any transaction: a PASSIVE checkpoint
            # never waits, and a SQLAlchemy Connection around it cost ten times the PRAGMA.
            pooled = self.engine.raw_connection()
            try:
                return self.checkpoint_on(pooled.driver_connection)
            finally:
                pooled.close()
        except (sa_exc.DBAPIError, self.dbapi_error) as error:  # the pool's checkout, return
            return self._checkpoint_failed(getattr(error, "orig", error))

    def checkpoint_held(self, driver: Any) -> bool:
        """:meth:`checkpoint` by the thread holding the writer lock, on its idle connection
        ``driver``: never once the WAL was deleted under the writer (a checkpoint of the
        deleted WAL would copy its pages over newer ones of the file's new WAL)."""
        if self._wal_replaced():
            log.error("WAL checkpoint skipped: %s", self._lose_wal())
            return False
        return self.checkpoint_on(driver)

    def checkpoint_on(self, driver: Any) -> bool:
        """The PASSIVE checkpoint on ``driver``, outside any transaction: the writer's own
        connection while its holder has it idle (the writer lock held), else a pooled one."""
        try:
            driver.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except self.dbapi_error as error:
            return self._checkpoint_failed(error)
        self.counters.record_checkpoint()
        return True

    def _checkpoint_failed(self, why: BaseException | None) -> bool:
        """A checkpoint that failed: harmless unless the WAL went away under the writer."""
        if self._wal_replaced() or _holds_deleted_wal(self.wal_path):
            log.error("WAL checkpoint failed (%s): %s", why, self._lose_wal())
        else:
            log.warning("WAL checkpoint failed (harmless, retried later): %s", why)
        return False


class _Head:
    """The head of the writer queue asking SQLite for the lock, while writers outside the line
    (newcomers trying it first, foreign writers) hold it.

    It polls without waiting (:data:`HEAD_POLL_S`), and once it has waited
    :data:`STARVE_AFTER_S` it marks the line starving, so newcomers queue behind it, and polls
    faster (:data:`HEAD_POLL_STARVING_S`): the lock is its own at the holder's next commit. Past
    :data:`HEAD_FAST_S` (a foreign writer holds the lock long) it asks with
    :data:`QUEUE_HEAD_BUSY_TIMEOUT_S` and jittered pauses, within the fallback path's budget:
    ``attempts`` x (writer's busy timeout / head's), so a foreign writer costs it no more
    waiting than before. All along it beats, keeping its place.

    A *patient* head lets the holder keep the lock for a share: it writes back to back itself
    (:attr:`SqliteWriter.back_to_back`), and the writer it followed in line said it goes on
    writing straight in (:meth:`~hermes_store.uow.writequeue.Turn.holder_goes_on`). Until
    :data:`PATIENT_SHARE_S` has passed (and within :data:`PATIENT_WAIT_S` of asking) it asks
    SQLite nothing while commits keep landing (``PRAGMA data_version`` moves between its looks,
    every :data:`PATIENT_LOOK_S`); it asks as soon as a look saw none (the holder stopped), and
    marks the line starving when the share is over. Why: a head that polls from the start
    often finds the lock free between two of the holder's writes, so the lock changes process
    every few writes, each change a wake-up; with processes that all write back to back,
    fewer and longer shares keep the original store's throughput, and a share bounded from
    each writer's asking keeps every wait within the budget."""

    __slots__ = (
        "_beat_due",
        "_fast_until",
        "_left",
        "_patient",
        "_polling",
        "_starve_at",
        "_turn",
        "_writer",
    )

    def __init__(self, writer: SqliteWriter, turn: writequeue.Turn) -> None:
        self._writer = writer
        self._turn = turn
        self._polling = True  #: asks without waiting (in WAL mode, within HEAD_FAST_S)
        now = time.monotonic()
        writer.asked_at = turn.since
        self._patient = writer.hot and writer.back_to_back and turn.holder_goes_on()
        if self._patient:
            with writer.counters.lock:
                writer.counters.stats.patient_heads += 1
            self._starve_at = min(now + PATIENT_SHARE_S, turn.since + PATIENT_WAIT_S)
        else:
            self._starve_at = min(now + STARVE_AFTER_S, turn.since + STARVE_IN_LINE_S)
        self._fast_until = max(now, self._starve_at) + HEAD_FAST_S
        self._beat_due = now + HEAD_BEAT_EVERY_S
        self._left = float(
            writer.policy.attempts * -(-writer.settings.writer_ms // max(1, writer.head_busy_ms))
        )

    @property
    def busy_ms(self) -> int:
        """The busy timeout of the next attempt (the writer connection is open)."""
        if self._polling and self._writer.in_wal:
            return 0
        self._polling = False
        return self._writer.head_busy_ms

    def pause(self, error: BaseException) -> None:
        """The attempt met the lock taken: wait before the next one, keeping the place."""
        turn = self._turn
        now = time.monotonic()
        if self._polling and now < self._fast_until:
            if self._patient and now < self._starve_at:
                self._wait_patiently()
                return
            starving = now >= self._starve_at
            if starving:
                turn.mark_starving()
            if now >= self._beat_due:
                self._beat_due = now + HEAD_BEAT_EVERY_S
                turn.still_trying()
            time.sleep(HEAD_POLL_STARVING_S if starving else HEAD_POLL_S)
            return
        writer = self._writer
        policy = writer.policy
        self._polling = False
        self._left -= 1
        if self._left <= 0:
            raise DatabaseLockedError(
                f"the database stayed locked through {policy.attempts} attempts' worth of "
                f"waiting at the head of the writer queue: {error}"
            ) from error
        turn.still_trying()
        delay = random.uniform(policy.min_wait, policy.max_wait)
        writer.counters.record_retry()
        log.debug("database busy at the queue's head (%s); retrying in %.0f ms", error,
                  delay * 1000)  # fmt: skip
        retry.sleep(delay)
        turn.still_trying()

    def first_look(self) -> None:
        """Before the first attempt: a patient head waits out the holder's share first (the
        writer before it in line has just committed and is about to write again: asked at
        once, the lock would often be free between its two writes, ending its share after
        one write)."""
        if self._patient:
            self._wait_patiently()

    def _wait_patiently(self) -> None:
        """Until the holder's share is over: look every PATIENT_LOOK_S, and return (to ask
        SQLite for the lock) once PATIENT_STILL_LOOKS looks in a row saw no commit land: the
        holder has stopped or paused. A look that cannot tell ends the patience."""
        writer, turn = self._writer, self._turn
        seen = writer.data_version()
        now = time.monotonic()
        still = 0
        while seen is not None and now < self._starve_at:
            if now >= self._beat_due:
                self._beat_due = now + HEAD_BEAT_EVERY_S
                turn.beat()
            time.sleep(PATIENT_LOOK_S)
            now = time.monotonic()
            version = writer.data_version()
            if version is None:
                seen = None
            elif version != seen:
                seen, still = version, 0
            else:
                still += 1
                if still >= PATIENT_STILL_LOOKS:
                    return
        self._patient = False  # its share is over (or it cannot tell): the ordinary head
        if seen is None:
            self._starve_at = min(self._starve_at, now + STARVE_AFTER_S)


def _never() -> bool:
    return False


def _holds_deleted_wal(wal_path: str | None) -> bool:
    """This process has the WAL open although it was deleted (Linux: ``/proc/self/fd``)."""
    if wal_path is None:
        return False
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return False
    target = f"{wal_path} (deleted)"
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                return True
        except OSError:
            continue
    return False
