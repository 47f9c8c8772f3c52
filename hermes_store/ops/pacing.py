"""Long jobs as many short write units, each holding the write lock for at most a bound.

A prune, an index merge or a vacuum of a multi-GB file is far more work than a writer can wait
for, so it runs as steps: one write unit each, sized so that it ends within
:data:`STEP_SECONDS`. What fits in that time depends on the machine, the disk and the data
(a 50 KB tool output costs a hundred chat turns to delete), so the size is learnt as the job
goes (:class:`Pace`): each step's duration, measured from its first statement to its commit,
sets the next step's size. Between steps the job checkpoints the WAL (PASSIVE: it copies what
no reader still needs and never waits, so the WAL stays as small as one step) and pauses, so
writers waiting for SQLite's one write lock get it first: the fair writer queue puts them ahead
of the job's next step; writers outside it (the original store, a ``sqlite3`` shell) poll from
SQLite's busy handler and find the lock free during the pause. A writer that joins the fair
queue while a step runs ends the step early: the step commits after the piece of work in
progress (:meth:`Budget.left`, :func:`waiters`), so the writer waits for that piece only.

Every step is recorded (:class:`StepLog`): how long it held the lock, what it did. Tests and
benchmarks assert on those records, not on wall-clock thresholds of a noisy machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from sqlalchemy.engine import Connection

from hermes_store.echo import echoed
from hermes_store.errors import InvalidInputError
from hermes_store.uow.unit import UnitOfWork

T = TypeVar("T")

#: The most one step should hold the write lock (seconds): writers beside a job wait for one
#: step at most, and a writer's retry budget is far longer.
STEP_SECONDS = 0.1
#: A step aims at this share of the bound: what the last steps measured is a forecast.
AIM = 0.6
#: A step grows by at most this factor over the last one (it shrinks at once).
GROWTH = 1.5
#: The pause after a step, as a share of how long it held the lock, within these limits: long
#: enough for a writer outside the fair queue (polling every 100 ms at most) to find the lock
#: free, short enough that the job keeps most of its pace.
PAUSE_SHARE = 0.5
MIN_PAUSE_S = 0.005
MAX_PAUSE_S = 0.16


def check_bound(seconds: float) -> float:
    """A step bound from a caller: seconds, more than 1 ms and at most 10 s."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds != seconds:
        raise InvalidInputError(f"step_seconds must be a number of seconds, not {echoed(seconds)}")
    if not 0.001 <= seconds <= 10:
        raise InvalidInputError("step_seconds must be from 0.001 to 10")
    return float(seconds)


@dataclass(frozen=True)
class Step:
    """One write unit of a job: what it did (``kind``), how much (``work``: the pace's units)
    and how long it held the write lock (``seconds``, from its first statement, at
    ``started`` on ``time.monotonic()``'s clock, to its commit)."""

    kind: str
    work: int
    seconds: float
    started: float = 0.0


@dataclass(kw_only=True)
class StepTally:
    """How a job's steps held the write lock, as its report says it: every step, those past
    ``bound_s`` (the wait a writer beside the job was promised), the longest hold and what
    it did, and by kind of step [steps, over the bound, longest hold in seconds]."""

    bound_s: float = STEP_SECONDS
    steps: int = 0
    steps_over_bound: int = 0
    longest_step_s: float = 0.0
    #: What the longest step did ("prune", "merge", "vacuum", ...; empty before any step).
    longest_step_kind: str = ""
    by_kind: dict[str, list[float]] = field(default_factory=dict)

    def record(self, step: Step) -> None:
        """Count one step."""
        self._count(step.kind, 1, int(step.seconds > self.bound_s), step.seconds)

    def add(self, other: StepTally) -> None:
        """Count the steps another job's tally holds (a prune's index merge)."""
        for kind, (count, over, longest) in other.by_kind.items():
            self._count(kind, int(count), int(over), longest)

    def _count(self, kind: str, count: int, over: int, longest: float) -> None:
        self.steps += count
        self.steps_over_bound += over
        if longest >= self.longest_step_s:
            self.longest_step_s = longest
            self.longest_step_kind = kind
        mine = self.by_kind.setdefault(kind, [0, 0, 0.0])
        mine[0] += count
        mine[1] += over
        mine[2] = max(mine[2], longest)


@dataclass
class StepLog:
    """Every step a job ran, in order."""

    steps: list[Step] = field(default_factory=list)

    def add(self, step: Step) -> None:
        self.steps.append(step)

    def longest(self, kind: str | None = None) -> float:
        """The longest hold of the write lock (of one kind of step), 0.0 with none."""
        return max((s.seconds for s in self.steps if kind in (None, s.kind)), default=0.0)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for s in self.steps if kind in (None, s.kind))


#: How often (seconds) a step asks whether a writer waits for it (a lock-file read).
WAITERS_EVERY_S = 0.002
#: The share of the bound a step works before it yields to a waiting writer: writers that
#: append back to back would otherwise cut every step to one piece, and a merge whose steps
#: are one statement each spends them on the writers' new segments and never ends.
YIELD_AFTER = 0.15


@dataclass
class Budget:
    """What one step may do: at most ``size`` units of work, and nothing new once the clock
    passes ``deadline`` (``time.monotonic()``), which leaves room for the commit, or once a
    writer waits for the write lock (``waiting``, asked every :data:`WAITERS_EVERY_S`): the
    step then commits after the piece in progress, so the writer waits for that piece, not
    for the rest of the step."""

    size: int
    deadline: float
    waiting: Callable[[], bool] | None = None
    #: Before this (``time.monotonic()``) the step works on even when a writer waits.
    next_look: float = 0.0

    def left(self) -> bool:
        """Whether the step may start another piece of work."""
        now = time.monotonic()
        if now >= self.deadline:
            return False
        if self.waiting is None or now < self.next_look:
            return True
        self.next_look = now + WAITERS_EVERY_S
        if self.waiting():
            self.deadline = now  # once a writer waits, the step ends
            return False
        return True


def waiters(uow: UnitOfWork) -> Callable[[], bool] | None:
    """Inside a step's unit: a question "does a writer wait for the lock now?", from the fair
    writer queue's lock file: a ticket issued since the question was made (a writer joined
    the line behind the step), or a head marking the line starving. None without a queue
    (PostgreSQL, the queue off): the steps then end by their clock only."""
    queue = uow.write_queue if uow.is_sqlite else None
    if queue is None or not queue.enabled:
        return None
    try:
        issued = queue.tickets()[0]
    except OSError:
        return None

    def waiting() -> bool:
        try:
            return queue.tickets()[0] != issued or queue.starving()
        except OSError:  # the lock file went away: the clock alone ends the step
            return False

    return waiting


class Pace:
    """How much work of one kind fits in a step: starts at ``first`` units and follows what
    the steps measure (units per second), aiming at :data:`AIM` of ``bound`` for the whole
    step; the body's own share is what is left once the commit (measured too) is taken out.
    A body checks its :class:`Budget` between pieces of work, so a step that meets slower
    work than forecast (a burst of 50 KB messages, a busy disk) ends early instead of late."""

    def __init__(
        self, kind: str, first: int, least: int, most: int, bound: float = STEP_SECONDS
    ) -> None:
        self.kind = kind
        self.size = max(least, min(most, first))
        self.least, self.most = least, most
        self.bound = bound
        #: Seconds a step spends after its body (the commit, its fsync): a running average.
        self.overhead = 0.0

    def budget(self, began: float) -> Budget:
        """The budget of a step whose body starts at ``began``."""
        body = max(self.bound * AIM - self.overhead, self.bound * 0.1)
        return Budget(self.size, began + body)

    def learn(self, work: int, body_seconds: float, overhead_seconds: float) -> None:
        """Size the next step from this one: ``work`` units done in ``body_seconds``, then
        ``overhead_seconds`` to commit."""
        self.overhead = (
            overhead_seconds
            if self.overhead == 0.0
            else 0.7 * self.overhead + 0.3 * overhead_seconds
        )
        if work <= 0:
            return
        rate = work / max(body_seconds, 1e-4)
        wanted = rate * max(self.bound * AIM - self.overhead, self.bound * 0.1)
        self.size = int(max(self.least, min(self.most, wanted, self.size * GROWTH)))


def run_step(
    uow: UnitOfWork,
    pace: Pace,
    log: StepLog,
    body: Callable[[Connection, Budget], tuple[T, int]],
) -> tuple[T, Step]:
    """One step: ``body(connection, budget)`` in one write unit (re-run whole on a lock met
    midway), returning (its result, the work it did). Records the step and teaches ``pace``."""
    marks = [0.0, 0.0]

    def unit(conn: Connection) -> tuple[T, int]:
        marks[0] = time.monotonic()
        budget = pace.budget(marks[0])
        budget.waiting = waiters(uow)
        budget.next_look = marks[0] + pace.bound * YIELD_AFTER
        result, work = body(conn, budget)
        marks[1] = time.monotonic()
        return result, work

    result, work = uow.run(unit)
    ended = time.monotonic()
    step = Step(pace.kind, work, ended - marks[0], marks[0])
    log.add(step)
    pace.learn(work, marks[1] - marks[0], ended - marks[1])
    return result, step


def between_steps(uow: UnitOfWork, step: Step, pause: float | None) -> None:
    """After a step: checkpoint the WAL (PASSIVE) and leave the write lock to writers.

    ``pause``: seconds to sleep; None: :data:`PAUSE_SHARE` of the step's hold on SQLite
    (within :data:`MIN_PAUSE_S`..:data:`MAX_PAUSE_S`), none on PostgreSQL (row locks queue
    nobody behind the whole table)."""
    if not uow.is_sqlite:
        if pause:
            time.sleep(pause)
        return
    uow.checkpoint()
    if pause is None:
        pause = min(MAX_PAUSE_S, max(MIN_PAUSE_S, step.seconds * PAUSE_SHARE))
    if pause > 0:
        time.sleep(pause)  # not synchronisation: the write lock is free for other writers
