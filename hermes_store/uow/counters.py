"""What a Unit of Work did: its counters (:class:`StoreStats`) and the checkpoint cadence.

One :class:`Counters` per Unit of Work (so per process and SQLite file: every store on the
file shares it); its lock guards the numbers that several threads bump at once. Group commit
(SQLite's and PostgreSQL's) records its groups here; every committed write unit is counted
here, and every ``checkpoint_every``-th calls the checkpoint the Unit of Work hands in.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StoreStats:
    """Counters of one Unit of Work (shared by every store on a file in this process)."""

    write_units: int = 0  #: committed write units (joined calls are not counted twice)
    read_units: int = 0  #: read units and single-statement reads
    transactions: int = 0  #: committed ``transaction()`` blocks
    rollbacks: int = 0  #: units rolled back by an exception
    lock_waits: int = 0  #: write units that found another thread of this process writing
    lock_wait_seconds: float = 0.0  #: time spent in those waits
    retries: int = 0  #: pauses after a busy/locked database (before a retry)
    checkpoints: int = 0  #: successful PASSIVE WAL checkpoints
    groups: int = 0  #: committed group-commit transactions (see hermes_store.uow.groupcommit)
    grouped_units: int = 0  #: units in those groups (grouped_units / groups: mean group size)
    max_group: int = 0  #: most units in one group
    lost_groups: int = 0  #: groups whose transaction was lost (their units re-ran alone)
    group_reruns: int = 0  #: units re-run alone after their group was lost
    uncontended_writes: int = 0  #: single-call writes that found no one writing: straight in
    queue_turns: int = 0  #: write turns taken in the fair writer queue (see writequeue)
    #: queued turns whose head let a back-to-back holder finish its share first (see writer)
    patient_heads: int = 0


def _no_checkpoint() -> bool:
    return False


class Counters:
    """The counters of one Unit of Work and the lock that guards them.

    ``checkpoint``: called (outside the lock) when a commit makes ``write_units`` cross a
    multiple of ``checkpoint_every``; the Unit of Work sets it to its backend's checkpoint.
    """

    def __init__(self, checkpoint_every: int) -> None:
        self.lock = threading.Lock()
        self.stats = StoreStats()
        self.checkpoint_every = checkpoint_every
        self.checkpoint: Callable[[], object] = _no_checkpoint
        #: Writes committed straight in (:mod:`~hermes_store.uow.uncontended`), counted apart
        #: from ``stats`` without this lock: only the thread holding the writer lock bumps it
        #: (and checks the checkpoint cadence with ``write_units``), so a lone write pays no
        #: second lock. :meth:`snapshot` adds them in.
        self.straight = 0

    def snapshot(self) -> StoreStats:
        """A copy of the counters, the writes that went straight in added in."""
        with self.lock:
            straight = self.straight
            return dataclasses.replace(
                self.stats,
                write_units=self.stats.write_units + straight,
                uncontended_writes=self.stats.uncontended_writes + straight,
            )

    def count(self, write: bool) -> None:
        """One unit ended well: a committed write (checkpoint when due) or a read."""
        due = False
        with self.lock:
            if write:
                self.stats.write_units = writes = self.stats.write_units + 1
                writes += self.straight
                due = self.checkpoint_every > 0 and writes % self.checkpoint_every == 0
            else:
                self.stats.read_units += 1
        if due:
            self.checkpoint()

    def count_writes(self, units: int) -> None:
        """Count ``units`` committed write units at once (a group); checkpoint when due."""
        if units <= 0:
            return
        with self.lock:
            before = self.stats.write_units + self.straight
            self.stats.write_units += units
            after = before + units
            every = self.checkpoint_every
            due = every > 0 and after // every > before // every
        if due:
            self.checkpoint()

    def record_group(self, size: int, *, lost: bool) -> None:
        """A group of ``size`` units committed, or was lost (both group commits)."""
        with self.lock:
            if lost:
                self.stats.lost_groups += 1
            else:
                self.stats.groups += 1
                self.stats.grouped_units += size
                self.stats.max_group = max(self.stats.max_group, size)

    def record_rerun(self) -> None:
        """A unit runs again alone because its group did not commit (both group commits)."""
        with self.lock:
            self.stats.group_reruns += 1

    def record_retry(self) -> None:
        """A pause before another attempt (a lock met, a server not reached)."""
        with self.lock:
            self.stats.retries += 1

    def record_rollback(self) -> None:
        with self.lock:
            self.stats.rollbacks += 1

    def record_transaction(self) -> None:
        with self.lock:
            self.stats.transactions += 1

    def record_checkpoint(self) -> None:
        with self.lock:
            self.stats.checkpoints += 1

    def record_read(self) -> None:
        """A single-statement read on a held connection: a diagnostic count, not worth a lock
        on the hottest reads (a lost increment under a race is harmless)."""
        self.stats.read_units += 1
