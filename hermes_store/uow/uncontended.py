"""The uncontended write: a single-call write that finds SQLite's lock free goes straight in.

Why: the fair writer queue (:mod:`~hermes_store.uow.writequeue`: a ticket, byte-range locks,
a hand-off) and group commit (:mod:`~hermes_store.uow.groupcommit`: a leader, a queue, a
group of one) order writers that meet; a writer alone pays for them all the same, 15-25% of
the original store's write. And when writers of several processes meet, a line that hands the
lock to the next process after every write costs a wake-up per write (0.44-0.58x the original
store's throughput with 4 to 16 single-thread processes), where the original store lets the
writer that just committed take the lock again. Here a write costs what the original store's
costs: ``BEGIN IMMEDIATE``, its statements, ``COMMIT``, unless someone has waited its share.

How: a write goes straight in when, in this order,

1. no other thread of this process is writing or waiting to (the writer's ``in_line`` count,
   the group-commit queue idle, the in-process write lock free: reads of memory, no syscall);
2. the head of the fair line is not starving (:meth:`WriteQueue.starving`: one
   ``F_OFD_GETLK`` on the lock file). A head marks
   the line starving once it has waited a few milliseconds at the head (or long in the line):
   from then on newcomers queue behind it, so its wait is bounded. A writer that finds the
   line empty (:meth:`WriteQueue.quiet`: nobody holds a ticket's byte or the mark, one
   ``F_OFD_GETLK``) asks nothing for the next :data:`QUIET_S`: a head that forms meanwhile
   has waited no share yet, so it cannot have marked the line. A writer alone going back to
   back asks once per :data:`QUIET_S` instead of at every write (~0.5-1.3 µs of a lone
   write's CPU); while anyone is in line it asks at every write, as before;
3. when threads of this process meet (a group of its took more than one unit once), no writer
   of any process is in line (:meth:`WriteQueue.empty`, a second ``F_OFD_GETLK``): while one
   is, the write waits for its process's next group instead, one commit for all of them rather
   than one for it and one for the threads that pile up behind it (measured: 8 processes of 4
   threads lost a quarter of the strict line's throughput when a group of one let the next
   write go straight in again);
4. SQLite's write lock is free: ``BEGIN IMMEDIATE`` with a busy timeout of 0 returns at once.

Otherwise it returns :data:`MISSED` and the write joins the line as any other, where the head
polls SQLite's lock (:class:`~hermes_store.uow.writer.SqliteWriter`), so the exactly-once
guarantees and bounded waits of the queue hold as before. A writer that just had its turn goes
on writing straight in while the next head waits its share: the lock changes process every few
milliseconds instead of after every write. A foreign writer (the original store) holding
SQLite's lock sends the write to the line at the first attempt. A lock met midway
(``SQLITE_BUSY`` after the begin, which a busy timeout of 0 cannot wait out) rolls the unit
back whole and sends it to the line too.

Chosen once, by the SQLite backend (off with ``HERMES_STORE_UNCONTENDED=0``: every write then
takes its turn in the line, in strict FIFO order).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

from sqlalchemy import exc as sa_exc

from hermes_store.engine.factory import begin_on_driver
from hermes_store.errors import is_retryable, mapped_errors, wrap_driver_error
from hermes_store.uow.counters import Counters
from hermes_store.uow.leaders import LeaderQueue
from hermes_store.uow.writer import STARVE_AFTER_S, SqliteWriter

T = TypeVar("T")

ENV_SWITCH = "HERMES_STORE_UNCONTENDED"

#: How long a writer that found the line empty (:meth:`WriteQueue.quiet`) skips the question
#: "is a head starving?": a head that forms after that answer marks the line only once it has
#: waited STARVE_AFTER_S at the head, so within half of it none can have marked (one that had
#: waited 0.1 s before its ticket marks at once: seen at most QUIET_S late). A writer going
#: back to back asks the lock file once per QUIET_S instead of once per write.
QUIET_S = STARVE_AFTER_S / 2

_monotonic = time.monotonic


class Missed:
    """The write met someone: it was not run (nothing was written); it joins the line."""

    def __repr__(self) -> str:
        return "MISSED"


MISSED: Final = Missed()


class Uncontended:
    """The straight-in path of one SQLite file's writer (one per Unit of Work)."""

    def __init__(
        self, writer: SqliteWriter, group: LeaderQueue[Any] | None, counters: Counters
    ) -> None:
        self._writer = writer
        self._group = group
        #: Until then no head can be starving: the line was found empty less than QUIET_S ago.
        self._quiet_until = 0.0
        #: When to ask whether the line is empty again (a line was there: until then, one
        #: question per write, :meth:`WriteQueue.starving`, as before the look).
        self._look_at = 0.0
        self._counters = counters
        self._settings = writer.settings
        self._dbapi_error = writer.dbapi_error
        self._dialect = writer.engine.dialect
        writer.goes_straight_in = self.goes_straight_in

    def goes_straight_in(self) -> bool:
        """A write of this process may go straight in past a line (its threads never met:
        once they did, its writes wait for the next group while anyone is in line)."""
        group = self._group
        return group is None or not group.met

    def run(self, fn: Callable[[Any], T], on_driver: bool = False) -> T | Missed:
        """``fn(writer_connection)`` committed as its own transaction, or :data:`MISSED` when
        someone else writes or waits to. ``fn`` uses only the connection's DB-API cursor;
        ``on_driver``: ``fn`` is given the DB-API connection itself (no Connection to look it
        up from: the hottest units)."""
        writer = self._writer
        group = self._group
        lock = writer.lock
        if writer.in_line or (group is not None and not group.idle) or lock.locked():
            return MISSED
        with lock:  # entered in C: an interrupt (Ctrl-C) never leaves it held
            queue = writer.write_queue  # attached by the writer (released with it)
            if queue is not None:
                now = _monotonic()
                if now < self._quiet_until:  # the line was empty a moment ago: none starves
                    if group is not None and group.met and not queue.empty():
                        return MISSED
                elif now >= self._look_at and queue.quiet():
                    self._quiet_until = now + QUIET_S  # nobody in line, nobody starving
                else:
                    if now >= self._look_at:  # someone is in line: ask every write meanwhile
                        self._look_at = now + QUIET_S
                    if queue.starving() or (group is not None and group.met and not queue.empty()):
                        return MISSED
            try:
                conn = writer.connect()
            except (sa_exc.DBAPIError, sa_exc.TimeoutError):  # the connect hook, the pool
                with mapped_errors():
                    raise
            driver: Any = writer.driver
            dbapi_error = self._dbapi_error
            try:
                begin_on_driver(driver, writer.info, self._settings, write=True, busy_ms=0)
            except dbapi_error as orig:
                error = wrap_driver_error(orig, self._dialect)
                if is_retryable(error):
                    return MISSED  # SQLite's write lock is taken: to the line
                writer.drop(invalidate=False)
                with mapped_errors():
                    raise error from orig
            try:
                result = fn(driver) if on_driver else fn(conn)
                driver.commit()
            except BaseException as error:
                self._counters.record_rollback()
                try:
                    driver.rollback()
                except dbapi_error as orig:
                    writer.drop(invalidate=True)  # state unknown: never reuse it
                    with mapped_errors():
                        raise wrap_driver_error(orig, self._dialect) from orig
                writer.drop(invalidate=False)  # the next unit starts on a fresh connection
                if isinstance(error, dbapi_error):
                    wrapped = wrap_driver_error(error, self._dialect)
                    if is_retryable(wrapped):
                        return MISSED  # rolled back whole: it runs again in the line
                    with mapped_errors():
                        raise wrapped from error
                if isinstance(error, sa_exc.DBAPIError) and is_retryable(error):
                    return MISSED
                with mapped_errors():
                    raise
            writer.acknowledge()
            # Counted under the writer lock (Counters.straight: no second lock); the file's
            # writes, all paths together, reached the next checkpoint: on the idle writer.
            counters = self._counters
            counters.straight = straight = counters.straight + 1
            every = counters.checkpoint_every
            if every > 0 and (straight + counters.stats.write_units) % every == 0:
                writer.checkpoint_held(driver)
        return result
