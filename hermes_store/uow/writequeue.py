"""A fair writer queue for one SQLite file, across processes and threads.

Why: SQLite's busy handler sleeps 1, 2, 5 ... 50, 100 ms between polls, so a writer that has
waited long polls rarely and newcomers overtake it; past the busy timeout it gets BUSY and
retries from scratch. Here writers line up in FIFO order instead, each one blocked in the
kernel until its predecessor is done, and only the head of the line asks SQLite for the lock.

How: a ticket queue of byte-range locks on a sidecar file ``<db>-writer.lock`` (0600, never the
database or its ``-wal``/``-shm``: opening those with a plain handle would drop this process's
SQLite locks). Bytes 0..7 hold the next ticket, bytes 8..15 the last ticket served, bytes
16..23 the last byte released, bytes 24..31 the head's heartbeat (the last three only mark
progress), bytes 32..39 the word of a writer whose turn ends (:meth:`Turn.say_goes_on`); byte
range [0, 8) is the ticket mutex, byte 64 the starving head's mark (a lock only, nothing is
written there). Ticket ``t`` owns byte ``SLOTS_AT + t % SLOTS``:

1. under the mutex: read ``t``, write-lock my own byte, write ``t + 1``, drop the mutex;
2. wait for a lock on my predecessor's byte (``t - 1``): it is free once that writer is done
   (or dead: the kernel releases the locks of a process that dies), then drop it at once. A
   read lock: a write lock there would merge with my own byte beside it, and the kernel wakes
   the writer waiting on my byte at that merge and again at the split, for nothing;
3. I hold the turn until my unit commits or rolls back, then unlock my byte.

The locks are open-file-description locks (``F_OFD_SETLK``/``F_OFD_SETLKW``): they belong to
a descriptor, not to the process, so two threads on two descriptors queue against each other
like two processes do, and closing some other descriptor on the file drops nothing. Threads:
each waiter borrows a descriptor of its own from a small per-process pool (opened once, reused,
never closed per unit), so every thread of every process stands in the one kernel FIFO.

Descriptors live as long as a writer uses the file: a :class:`SqliteWriter` attaches to its
file's queue (:meth:`WriteQueue.attach`) and detaches when it releases its connections (the
last store on the file closed), and the last to detach closes the idle descriptors and stops
their helper threads (one still blocked for an abandoned wait closes when that wait ends). A
process that opens many databases in turn (a notebook over many ``state.db`` files) so keeps
no descriptor of a file it closed, and no queue object: the last to detach unregisters it
(unless it warned about the file: a broken lock file is said once per process).

Bounded wait: ``fcntl`` cannot time out, so a waiter that must block hands the blocking call to
its descriptor's helper thread and waits on a condition. It gives up once the line has not
moved for ``wait_timeout`` (default 1.0 s, ``HERMES_STORE_WRITE_QUEUE_WAIT``): "moved" means a
new head wrote its ticket to bytes 8..15 or a writer that leaves wrote its byte to 16..23
(fallbacks included), checked every 0.1 s (the hand-off itself is a kernel
wake-up, not a poll). Counting from the last movement, not from joining, lets a long line on a
slow disk (a commit's fsync here takes 4 ms typically, up to 0.5 s) drain without false alarms,
while the ticket mutex, held for microseconds, gets ``wait_timeout`` in all. Past it the waiter
gives up its place in line (the helper drops the lock when it eventually gets it)
and falls back to today's path: ``BEGIN IMMEDIATE`` with SQLite's busy timeout and the jittered
retry. It keeps its own byte while it writes, so the writers behind it stay in order. A member
that is stopped (SIGSTOP) or hung while queued or holding the turn therefore costs the writers
behind it one bounded wait, not forever. A writer stopped while it holds SQLite's own write
lock still blocks everyone, as it does today: the queue cannot take SQLite's lock away.

A single-call write first tries SQLite's lock without queueing
(:mod:`hermes_store.uow.uncontended`), unless the head of the line is starving: a head that
has waited a few milliseconds at the head (or long in the line) locks byte
:data:`STARVING_AT` (:meth:`Turn.mark_starving`), and :meth:`WriteQueue.starving` asks, with
one ``F_OFD_GETLK`` on a descriptor kept for it, whether anyone holds it. While one does,
newcomers queue behind it, so the head takes SQLite's lock at the next commit and no member of
the line waits more than its share per writer ahead. The mark is a lock, so a head that dies
drops it with its other locks; it goes with the head's turn.

A writer that ends its turn tells the next head whether it goes on writing straight in, back
to back (its word, :meth:`Turn.say_goes_on`, read with :meth:`Turn.holder_goes_on`): a head
that writes back to back itself then lets it keep SQLite's lock for a share
(the patient head of :mod:`~hermes_store.uow.writer`) instead of catching the lock
between two of its writes.

Writers outside the line (those going straight in, the original store, a ``sqlite3`` shell)
meet the head in SQLite's lock, and it keeps its place: it polls ``BEGIN IMMEDIATE`` with a
busy timeout of 0 every 0.5 ms (0.1 ms once it marked the line starving: the lock is free at
the holder's next commit), for 0.1 s; a foreign writer that holds the lock longer is then asked
for with a short busy timeout (0.2 s) and the jittered retry. Every 50 ms of polling, and after
every slow attempt, it writes a heartbeat to bytes 24..31 (:meth:`Turn.still_trying`). The
writers behind see the line as moving and stay blocked in the kernel: no one spins, no one
falls back, and the order of the line is kept. A head that stops (SIGSTOP) stops beating too,
so the writers behind fall back after the bounded wait as before; newcomers go straight past it
while it has not marked the line, and queue behind it (one bounded wait) once it has.

The lock file is only trusted as far as it needs to be. It is opened with ``O_NOFOLLOW`` and
checked once per descriptor: a symbolic link, a second hard link, anything but a regular file,
or a file of another user is refused (the queue would write its counters into whatever that
names, the database itself included), and the queue turns itself off for that file, logged
once. What it reads is validated: a header out of range (a ticket counter at or past
:data:`TICKET_LIMIT`, a last-served ticket not within :data:`SLOTS` behind it) is repaired
under the ticket mutex. A new ticket skips at most :data:`SKIP_LIMIT` slots that are still
locked (a foreign lock on them), then the writer falls back at once. The queue only orders
writers: no state of its file fails a write SQLite would take.

Where OFD locks are unavailable (not Linux; ``EINVAL``/``ENOSYS``/``ENOLCK``/``EOPNOTSUPP`` from
``fcntl``, e.g. some network file systems; a lock file that cannot be created) the queue turns
itself off for that file, logs it once, and every turn is a fallback: today's behaviour.

Fork: OFD locks are shared with a child through the inherited open file description, so a
child must never use its parent's descriptors. Queues are registered per process
(keyed by pid) and ``os.register_at_fork`` resets every queue in the child, which then opens
descriptors of its own (the inherited copies are closed; the parent's locks are unaffected).

Set ``HERMES_STORE_WRITE_QUEUE=0`` to switch the queue off (benchmarks' "before" runs).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from hermes_store.engine import files
from hermes_store.uow.interrupts import acquire_now, acquire_within, holding

log = logging.getLogger(__name__)

#: Linux values, for a fcntl module that does not name them.
F_OFD_SETLK: int = getattr(fcntl, "F_OFD_SETLK", 37)
F_OFD_SETLKW: int = getattr(fcntl, "F_OFD_SETLKW", 38)
F_OFD_GETLK: int = getattr(fcntl, "F_OFD_GETLK", 36)
#: How long a waiter stands in line while the line does not move (no new head) before it
#: falls back to SQLite's busy handler. Above a slow commit: fsync alone can take 0.5 s.
DEFAULT_WAIT_TIMEOUT_S = 1.0
#: How often a waiter checks whether the line moved (not the hand-off: the kernel wakes it).
PROGRESS_TICK_S = 0.1
#: Ticket slots: a byte per ticket from SLOTS_AT, reused modulo SLOTS.
SLOTS_AT = 4096
SLOTS = 1 << 20
#: Tickets stay below this (at 10,000 commits/s, 14 million years): a counter at or past it was
#: written by something else and is wrapped back into range, keeping its slot.
TICKET_LIMIT = 1 << 62
#: Locked slots a new ticket may skip (a writer stuck since SLOTS tickets ago, or a foreign lock
#: on the slot bytes); past them the writer falls back at once instead of searching on.
SKIP_LIMIT = 16
#: Descriptors per process and file; waiters beyond this fall back.
MAX_DESCRIPTORS = 64
#: The byte a starving head locks (see :meth:`Turn.mark_starving`): outside the header and the
#: slots, so no ticket ever owns it.
STARVING_AT = 64
#: The word of the writer whose turn ends (bytes 32..39, see :meth:`Turn.say_goes_on`): its
#: byte, with GOES_ON when it goes on writing straight in.
WORD_AT = 32
GOES_ON = 1 << 62
ENV_SWITCH = "HERMES_STORE_WRITE_QUEUE"
ENV_WAIT = "HERMES_STORE_WRITE_QUEUE_WAIT"

_HEADER = struct.Struct("<QQ")  # next ticket, last ticket served
_FLOCK = "hhqqi4x"  # struct flock on Linux (64-bit off_t): type, whence, start, len, pid
#: The lock file: never through a symbolic link, never blocking on a FIFO, never a terminal.
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
_UNAVAILABLE = {errno.EINVAL, errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP}
_BUSY = {errno.EAGAIN, errno.EACCES}


class QueueUnavailable(OSError):
    """OFD locks do not work on this file (or system): the queue turns itself off."""


class LockFileRefused(Exception):
    """The lock file is not one the queue may write (a link, not a regular file, another user's,
    or it cannot be opened): the queue turns itself off for that database. Says why."""


def _open_lock_file(path: Path) -> int:
    """A read-write descriptor on the lock file (created 0600), or :class:`LockFileRefused`.

    Checked on the descriptor, so nothing can be swapped in between: a symbolic link or a second
    hard link planted at the path would have the queue's counters written into the file it names
    (another file of the user, or the database, which that would destroy)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            why = f"{path} is a symbolic link: refused, it could name any file"
        else:
            why = f"cannot open {path}: {error.strerror}"
        raise LockFileRefused(why) from error
    try:
        info = os.fstat(fd)
    except OSError as error:
        os.close(fd)
        raise LockFileRefused(f"cannot examine {path}: {error.strerror}") from error
    why = ""
    if not stat.S_ISREG(info.st_mode):
        why = f"{path} is not a regular file ({stat.filemode(info.st_mode)})"
    elif info.st_uid != os.geteuid():
        why = f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    elif info.st_nlink > 1:
        why = f"{path} has {info.st_nlink} hard links: it may be another file's second name"
    if why:
        os.close(fd)
        raise LockFileRefused(why)
    return fd


def _mark(fd: int, value: int, at: int) -> None:
    """Write one of the line's marks (the last byte released, the head's heartbeat, the word
    of a writer whose turn ends). Only marks: one that cannot be written (a full disk on a
    copy-on-write file system, an I/O error) is logged and the write goes on; the writers
    behind then see the line still and fall back after their bounded wait, and a next head
    without the word takes the ordinary share. Raised, it failed a write that had committed
    (the turn ends after the commit) and left the descriptor out of the pool."""
    try:
        os.pwrite(fd, struct.pack("<Q", value), at)
    except OSError as error:
        log.warning("write queue: could not write a mark of progress to the lock file: %s", error)


def _in_range(issued: int, served: int) -> bool:
    """Whether a header can be the queue's own: below the limit, served within SLOTS behind."""
    return issued < TICKET_LIMIT and 0 <= issued - served <= SLOTS


def _flock(kind: int, start: int, length: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0)  # l_pid must be 0


def _lock(fd: int, start: int, length: int, *, wait: bool, shared: bool = False) -> bool:
    """Write-lock ``[start, start + length)`` (read-lock it with ``shared``); False when
    ``wait`` is off and it is taken."""
    kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
    try:
        fcntl.fcntl(fd, F_OFD_SETLKW if wait else F_OFD_SETLK, _flock(kind, start, length))
    except OSError as error:
        if not wait and error.errno in _BUSY:
            return False
        if error.errno in _UNAVAILABLE:
            raise QueueUnavailable(
                error.errno, f"OFD locks unavailable: {error.strerror}"
            ) from error
        raise
    return True


def _unlock(fd: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, F_OFD_SETLK, _flock(fcntl.F_UNLCK, start, length))


#: The question "is any ticket's byte locked?": a write lock over every slot, asked, not taken.
_ANY_SLOT = _flock(fcntl.F_WRLCK, SLOTS_AT, SLOTS)
#: The question "does a head starve?" (see :meth:`Turn.mark_starving`).
_STARVING = _flock(fcntl.F_WRLCK, STARVING_AT, 1)
#: The question "is anyone in line, holding a turn or starving?": the mark and every slot.
_QUIET = _flock(fcntl.F_WRLCK, STARVING_AT, SLOTS_AT + SLOTS - STARVING_AT)
#: A turn's whole hold on the line let go in one ``fcntl`` (the starving mark, its ticket's
#: byte, a predecessor's byte a helper got): a cleanup of one C call, which no interrupt
#: (Ctrl-C) can cut in two. OFD locks: it lets go of this description's locks only.
_LET_GO_OF_THE_LINE = _flock(fcntl.F_UNLCK, STARVING_AT, SLOTS_AT + SLOTS - STARVING_AT)
#: The ticket mutex let go in one ``fcntl`` (see above).
_LET_GO_OF_THE_MUTEX = _flock(fcntl.F_UNLCK, 0, 8)
#: The answer "none": ``l_type`` F_UNLCK in the returned struct.
_NONE_LOCKED = struct.pack("h", fcntl.F_UNLCK)


@dataclass
class QueueStats:
    """What a queue saw in this process (a snapshot; see :meth:`WriteQueue.stats`)."""

    turns: int = 0  #: turns taken through the queue
    waits: int = 0  #: turns that had to block for a predecessor or the mutex
    wait_seconds: float = 0.0  #: time spent blocked, over all turns (fallbacks included)
    max_wait_seconds: float = 0.0
    fallbacks: int = 0  #: turns that ran on SQLite's busy handler instead
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    max_depth: int = 0  #: most writers seen ahead in line when taking a ticket
    hold_seconds: float = 0.0  #: time queued turns were held (the unit, commit included)
    starved: int = 0  #: turns whose head marked the line starving (newcomers queued behind it)
    enabled: bool = True


@dataclass
class Turn:
    """One writer's turn. ``queued`` is False for a fallback (SQLite's busy handler decides)."""

    queued: bool
    reason: str = ""  #: why it fell back
    depth: int = 0  #: writers ahead when the ticket was taken
    waited: float = 0.0
    fd: int = -1  #: the descriptor holding this turn's byte (queued turns)
    beats: int = 0
    starving: bool = False  #: this head holds the starving mark (released with the turn)
    since: float = 0.0  #: when the writer asked for its turn (``time.monotonic()``)
    slot: int = -1  #: this turn's byte (queued turns)
    #: The byte of the writer before it in line, when it had to wait for that writer to let
    #: go (-1: it found no one ahead): whose word :meth:`holder_goes_on` reads.
    followed: int = -1

    def still_trying(self) -> None:
        """Tell the writers behind that the head is alive and retrying (it met another
        writer in SQLite's lock): the line counts as moving, so they stay blocked in the
        kernel instead of falling back to SQLite's busy handler after the bounded wait. A
        head that says so has waited: it marks the line starving too."""
        self.beat()
        self.mark_starving()

    def beat(self) -> None:
        """Tell the writers behind that the head is alive (the line counts as moving), without
        asking newcomers to queue: a patient head waiting out a holder's share."""
        if self.queued and self.fd >= 0:
            self.beats += 1
            _mark(self.fd, (os.getpid() << 24) ^ self.beats, 24)

    def say_goes_on(self) -> None:
        """Tell the next head, before this turn ends, that this writer goes on writing
        straight in, back to back: its byte with :data:`GOES_ON` in bytes 32..39 (the word).
        Written while the turn is held, so the next head finds it once it may go; a word
        that cannot be written is logged, and the next head takes the ordinary share."""
        if self.queued and self.fd >= 0 and self.slot >= 0:
            _mark(self.fd, self.slot | GOES_ON, WORD_AT)

    def holder_goes_on(self) -> bool:
        """The writer this head waited for said it goes on writing back to back (its word,
        see :meth:`say_goes_on`, names its byte): False when the head found no one ahead, or
        that writer said nothing."""
        if not self.queued or self.fd < 0 or self.followed < 0:
            return False
        try:
            raw = os.pread(self.fd, 8, WORD_AT)
        except OSError:
            return False
        return len(raw) == 8 and struct.unpack("<Q", raw)[0] == self.followed | GOES_ON

    def mark_starving(self) -> None:
        """Ask newcomers to stop trying SQLite's lock before the line (see
        :meth:`WriteQueue.starving`): they queue behind this head until its turn ends. A lock
        on :data:`STARVING_AT`, so a head that dies drops it with its other locks."""
        if self.queued and self.fd >= 0 and not self.starving:
            self.starving = _lock(self.fd, STARVING_AT, 1, wait=False)


class _Descriptor:
    """One open file description on the lock file, with a helper thread for timed waits.

    Plain locks used as binary semaphores hand requests to the helper and grants back (a
    Condition costs twice the CPU per hand-off, and every waited turn makes two of them)."""

    def __init__(self, fd: int, forget: Callable[[int], None]) -> None:
        self.fd = fd
        #: Closes ``fd`` for the queue (removing it from the queue's list under its lock).
        self._forget = forget
        self._retired = False  # closed, or to be closed by the helper once its wait ends
        self._state = threading.Lock()  # guards the fields below
        self._go = threading.Lock()  # released: the helper has a request
        self._go.acquire()
        self._done = threading.Lock()  # released: the helper got the lock (or failed)
        self._done.acquire()
        self._request: tuple[int, int, bool] | None = None  # start, length, shared
        self._abandoned = False
        self._error: BaseException | None = None
        self._helper: threading.Thread | None = None
        self.blocked = False  #: the last lock_within could not be had at once

    @property
    def pending(self) -> bool:
        """A helper still blocked for an abandoned waiter: not reusable yet."""
        with self._state:
            return self._request is not None

    def lock_within(
        self,
        start: int,
        length: int,
        timeout: float,
        progress: Callable[[], object] | None = None,
        *,
        shared: bool = False,
    ) -> bool:
        """Lock the range (a read lock with ``shared``); False once ``timeout`` s pass without
        it. With ``progress``, the clock restarts whenever ``progress()`` changes (checked every
        :data:`PROGRESS_TICK_S`)."""
        if _lock(self.fd, start, length, wait=False, shared=shared):
            return True
        self.blocked = True
        if self._helper is None:
            self._helper = threading.Thread(
                target=self._serve, name=f"hermes-writequeue-{self.fd}", daemon=True
            )
            self._helper.start()
        granted: list[threading.Lock] = []  # the helper's grant, once taken (never lost)
        try:
            with self._state:  # no call before the last: the request is made whole or not
                self._request = (start, length, shared)
                self._abandoned = False
                self._error = None
                self._go.release()
            seen = progress() if progress is not None else None
            since = time.monotonic()
            while True:
                left = since + timeout - time.monotonic()
                if left <= 0:
                    with self._state:
                        if not acquire_now(self._done, granted):
                            self._abandoned = True  # the helper drops the lock when it gets it
                            return False
                    return self._granted()
                wait = min(left, PROGRESS_TICK_S) if progress else left
                if acquire_within(self._done, wait, granted):
                    return self._granted()
                if progress is not None and (now := progress()) != seen:
                    seen, since = now, time.monotonic()
        except BaseException:
            # An interrupt (Ctrl-C): a grant that came is taken (the caller's cleanup lets
            # go of the range); a request still waited for is dropped by the helper when
            # it gets the range.
            if not granted:
                with self._state:
                    if not acquire_now(self._done, granted) and self._request is not None:
                        self._abandoned = True
            raise

    def _granted(self) -> bool:
        error, self._error = self._error, None
        if error is not None:
            raise error
        return True

    def retire(self) -> bool:
        """No more turns on this descriptor: its helper (if any) leaves, and True says the
        caller may close it now. False when a helper still waits for an abandoned turn: it
        closes the descriptor itself once that wait ends."""
        with self._state:
            self._retired = True
            if self._request is not None:
                return False
            if self._helper is not None:
                self._go.release()  # no request: the helper leaves
        return True

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            with self._state:
                request = self._request
            if request is None:  # retired
                return
            start, length, shared = request
            error: BaseException | None = None
            try:
                _lock(self.fd, start, length, wait=True, shared=shared)
            except BaseException as exc:
                error = exc
            with self._state:
                self._request = None
                if not self._abandoned:
                    self._error = error
                    self._done.release()
                    continue
                self._abandoned = False
                if error is None:
                    try:
                        _unlock(self.fd, start, length)
                    except OSError as exc:  # the writer behind would wait out its bound
                        log.warning("write queue: could not drop an abandoned place: %s", exc)
                retired = self._retired
            if retired:
                self._forget(self.fd)
                return


class WriteQueue:
    """The FIFO of writers for one SQLite file in this process (a writer takes it with
    :func:`attach`).

    ``with queue.turn() as turn:`` waits for this writer's turn (``turn.queued``) or, past the
    bounded wait or when the queue is off, yields a fallback turn at once (``not turn.queued``).
    """

    def __init__(
        self,
        db_path: str | os.PathLike[str],
        *,
        wait_timeout: float | None = None,
        lock_path: str | os.PathLike[str] | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.db_path = Path(db_path)
        self.lock_path = (
            Path(lock_path)
            if lock_path is not None
            else Path(f"{db_path}{files.WRITER_LOCK_SUFFIX}")
        )
        if wait_timeout is None:
            wait_timeout = float(os.environ.get(ENV_WAIT, DEFAULT_WAIT_TIMEOUT_S))
        self.wait_timeout = wait_timeout
        if enabled is None:
            enabled = os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "off", "false", "no")
        self._wanted = enabled
        self._said: set[str] = set()  # what this queue warned about already
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._pool_lock = threading.Lock()
        self._free: list[_Descriptor] = []  # idle, ready for the next waiter
        self._parked: list[_Descriptor] = []  # a helper still waits for an abandoned turn
        self._opened: list[int] = []  # every descriptor this process opened on the lock file
        self._probe = -1  # a descriptor that only asks whether anyone is in line (see empty())
        #: Writers attached (:meth:`attach`): a forked child remakes its writers, which
        #: attach again.
        self._users = 0
        #: The last writer detached: descriptors given back are closed, not kept.
        self._idle = False
        self._stats_lock = threading.Lock()
        self._stats = QueueStats(enabled=self._wanted)
        self._enabled = self._wanted and sys.platform.startswith("linux")
        if self._wanted and not self._enabled:
            self._disable(f"{sys.platform} has no open-file-description locks")

    def _after_fork(self) -> None:
        """In a child: forget the parent's descriptors; the parent keeps its locks. Each is
        pointed at ``/dev/null`` rather than closed, so its number is never reused: a turn the
        parent held at the fork still releases it (a write and an unlock) when the child leaves
        it, and that must never reach a file the child opened meanwhile (its database)."""
        null = -1
        with suppress(OSError):
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        for fd in self._opened:
            with suppress(OSError):
                if null >= 0:
                    os.dup2(null, fd, inheritable=False)
                else:
                    os.close(fd)
        if null >= 0:
            os.close(null)
        self._reset()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def attach(self) -> None:
        """A writer uses this queue until it calls :meth:`detach` (a registered queue: the
        module's :func:`attach` and :func:`detach`)."""
        with self._pool_lock:
            self._users += 1
            self._idle = False

    def detach(self) -> bool:
        """A writer is done with the file; the last one closes every idle descriptor (and stops
        its helper thread) and is told so (True). Reopened as needed if used again."""
        with self._pool_lock:
            self._users = max(0, self._users - 1)
            if self._users:
                return False
            self._idle = True
            idle, self._free = self._free, []
            parked, self._parked = self._parked, []
            probe, self._probe = self._probe, -1
            for descriptor in idle + parked:
                if descriptor.retire():
                    self._close_locked(descriptor.fd)
            if probe >= 0:
                self._close_locked(probe)
            return True

    @property
    def warned(self) -> bool:
        """It warned about its file (it turned itself off, a header it repaired, slots locked
        by others): kept registered, so the process says each once, not once per opening."""
        return bool(self._said)

    @property
    def descriptors(self) -> int:
        """Descriptors this process has open on the lock file (for tests and diagnostics)."""
        with self._pool_lock:
            return len(self._opened)

    def _forget(self, fd: int) -> None:
        with self._pool_lock:
            self._close_locked(fd)

    def _close_locked(self, fd: int) -> None:
        """Close ``fd`` if this process's queue still owns it (a parent's, after a fork, is
        left alone): removed from the list first, so a fork never points a reused number at
        ``/dev/null``."""
        if fd in self._opened:
            self._opened.remove(fd)
            with suppress(OSError):
                os.close(fd)

    def stats(self) -> QueueStats:
        """A copy of this process's counters for this file."""
        with self._stats_lock:
            snapshot = QueueStats(**{**self._stats.__dict__})
            snapshot.fallback_reasons = dict(self._stats.fallback_reasons)
            snapshot.enabled = self._enabled
            return snapshot

    def tickets(self) -> tuple[int, int]:
        """``(issued, served)`` as recorded in the lock file (for tests and diagnostics)."""
        return self._unpack_header(self._peek(0, _HEADER.size))

    def progress(self) -> bytes:
        """The line's movement marks (bytes 8..31: the last head's ticket, the last byte
        released, the head's heartbeat); they change while the line moves or its head works.

        For a writer that waits outside the line (a fallback) and must tell a head that is
        alive and working from one that stopped. A lock file that cannot be read (removed
        meanwhile) gives ``b""``: no movement, so the waiter keeps to its fixed budget; the
        queue only orders writers, it never fails one.
        """
        try:
            return self._peek(8, 24)
        except OSError as error:
            log.debug("%s: cannot read the line's progress: %s", self.lock_path, error)
            return b""

    def _peek(self, offset: int, size: int) -> bytes:
        """Bytes of the lock file, read on a short-lived descriptor of its own: the queue's
        locks are OFD locks, which closing another descriptor keeps."""
        fd = os.open(self.lock_path, os.O_RDONLY | _OPEN_FLAGS)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def empty(self) -> bool:
        """No writer of any process or thread is in line or holds a turn: no ticket's byte is
        locked (one ``F_OFD_GETLK`` over the slots). True when the queue is off."""
        return not self._locked(_ANY_SLOT)

    def quiet(self) -> bool:
        """No writer of any process or thread is in line, holds a turn or starves: nothing is
        locked from the starving mark to the last ticket slot (one ``F_OFD_GETLK``). A head
        forming after this answer needs its share at the head before it marks the line, so
        :mod:`~hermes_store.uow.uncontended` asks :meth:`starving` again only after half of
        it. True when the queue is off."""
        return not self._locked(_QUIET)

    def starving(self) -> bool:
        """The head of the line has waited past its share and asks newcomers to queue
        behind it instead of trying SQLite's lock first (:meth:`Turn.mark_starving`). One
        ``F_OFD_GETLK`` on a descriptor of its own (opened once): a writer that finds no one
        starving asks the lock file this one question per write and takes no ticket.

        False when the queue is off; a probe that fails turns the queue off as a turn would
        (the queue only orders writers, it never fails one)."""
        return self._locked(_STARVING)

    def _locked(self, question: bytes) -> bool:
        if not self._enabled:
            return False
        fd = self._probe
        try:
            if fd < 0:
                fd = self._open_probe()
                if fd < 0:
                    return False
            return fcntl.fcntl(fd, F_OFD_GETLK, question)[:2] != _NONE_LOCKED
        except OSError as error:
            if error.errno in _UNAVAILABLE:
                self._disable(f"OFD locks unavailable: {error.strerror}")
                return False
            log.warning("%s: cannot look at the writer line, queueing: %s", self.db_path, error)
            return True

    def _open_probe(self) -> int:
        """The probe's descriptor (checked as every descriptor on the lock file is), or -1 with
        the queue turned off."""
        with self._pool_lock:
            if self._probe < 0:
                try:
                    fd = _open_lock_file(self.lock_path)
                except LockFileRefused as refused:
                    self._disable(str(refused))
                    return -1
                self._opened.append(fd)
                self._probe = fd
            return self._probe

    # -- the turn ----------------------------------------------------------------------------

    @holding
    def turn(self) -> Iterator[Turn]:
        """This writer's turn: FIFO across processes and threads, bounded wait, then fallback.
        A caller that catches an interrupt (Ctrl-C) lets it go with ``release()``."""
        if os.getpid() != self._pid:  # a fork the hook did not see (should not happen)
            self._after_fork()
        if not self._enabled:
            yield Turn(queued=False, reason="disabled")
            return
        began = time.monotonic()
        descriptor = self._borrow()
        if descriptor is None:
            fallback = Turn(queued=False, reason="no lock file descriptor")
            self._account(fallback)
            yield fallback
            return
        own: list[int] = []  # my ticket's byte, once locked
        turn: Turn | None = None
        try:
            try:
                turn = self._enter(descriptor, began, own)
            except QueueUnavailable as error:
                self._disable(str(error))
                turn = Turn(queued=False, reason="unavailable")
            except (OSError, struct.error) as error:  # it only orders writers: never fail one
                log.warning(
                    "%s: write queue error, this writer falls back: %s", self.db_path, error
                )
                turn = Turn(queued=False, reason=f"error {getattr(error, 'errno', None)}")
            turn.waited = time.monotonic() - began if descriptor.blocked else 0.0
            turn.since = began
            if turn.queued:
                turn.fd = descriptor.fd
            self._account(turn)
            granted = time.monotonic()
            yield turn
        finally:
            # First, in one C call (an interrupt lands only as a call returns): whatever
            # else this cleanup misses, the line is never left blocked.
            fcntl.fcntl(descriptor.fd, F_OFD_SETLK, _LET_GO_OF_THE_LINE)
            starved = turn is not None and turn.starving
            if starved:
                assert turn is not None
                turn.starving = False
            for byte in own:
                _mark(descriptor.fd, byte, 16)  # the line moved
            self._give_back(descriptor)
        if turn is not None and turn.queued:
            held = time.monotonic() - granted
            with self._stats_lock:
                self._stats.hold_seconds += held
                self._stats.starved += starved

    def _enter(self, descriptor: _Descriptor, began: float, own: list[int]) -> Turn:
        fd = descriptor.fd
        descriptor.blocked = False
        # Every range is let go in a finally that also runs when it was never taken (an
        # unlock of a range this description does not hold does nothing), by one C call: an
        # interrupt (Ctrl-C) as a lock call returns, or as a cleanup calls a function, never
        # leaves one held.
        try:
            if not descriptor.lock_within(0, 8, self.wait_timeout - (time.monotonic() - began)):
                return Turn(queued=False, reason="ticket mutex wait timed out")
            issued, served = self._read_header(fd)
            if not _in_range(issued, served):
                issued, served = self._repair(fd, issued, served)
            ticket = issued
            own.append(self._slot(ticket))  # before the lock: see above
            while not _lock(fd, own[-1], 1, wait=False):
                own.pop()
                ticket += 1  # a writer stuck since SLOTS tickets ago still holds it: skip
                own.append(self._slot(ticket))
                if ticket - issued >= SKIP_LIMIT:
                    own.pop()
                    self._say_once("slots", "%s: %d ticket slots in a row are locked by "
                                   "another process; writers fall back", self.lock_path,
                                   SKIP_LIMIT)  # fmt: skip
                    return Turn(queued=False, reason="ticket slots locked")
            os.pwrite(fd, struct.pack("<Q", ticket + 1), 0)
        finally:
            fcntl.fcntl(fd, F_OFD_SETLK, _LET_GO_OF_THE_MUTEX)
        turn = Turn(queued=True, depth=max(0, issued - served - 1) if issued else 0, slot=own[-1])
        if issued:
            predecessor = self._slot(issued - 1)

            def moved() -> bytes:  # the last head's ticket, last byte released, heartbeat
                return os.pread(fd, 24, 8)

            let_go = _flock(fcntl.F_UNLCK, predecessor, 1)
            blocked, descriptor.blocked = descriptor.blocked, False
            # The predecessor's byte, once had, only says it has gone: let go at once. A read
            # lock waits for it as a write lock would, but never merges with this writer's own
            # byte beside it (same-type neighbours merge, and the merge and the split that
            # follows each wake the writer waiting on my byte for nothing: two spurious
            # wake-ups per hand-over).
            try:
                if not descriptor.lock_within(
                    predecessor, 1, self.wait_timeout, moved, shared=True
                ):
                    turn.queued, turn.reason = False, "wait timed out"
                    return turn  # still holding my byte: the writers behind me stay in order
            finally:
                fcntl.fcntl(fd, F_OFD_SETLK, let_go)
                turn.followed = predecessor if descriptor.blocked else -1
                descriptor.blocked = descriptor.blocked or blocked
        os.pwrite(fd, struct.pack("<Q", ticket), 8)
        return turn

    def _repair(self, fd: int, issued: int, served: int) -> tuple[int, int]:
        """Bring a damaged header back in range (under the ticket mutex). The next ticket keeps
        its slot, so a writer queued just before still goes first; ``served`` only marks
        progress."""
        fixed = issued if issued < TICKET_LIMIT else SLOTS + issued % SLOTS
        behind = issued - served
        if not 0 <= behind <= SLOTS:
            behind = min(fixed, 1)
        os.pwrite(fd, _HEADER.pack(fixed, fixed - behind), 0)
        self._say_once("header", "%s: damaged header (next ticket %d, last served %d) repaired",
                       self.lock_path, issued, served)  # fmt: skip
        return fixed, fixed - behind

    def _say_once(self, topic: str, message: str, *args: object) -> None:
        if topic in self._said:
            log.debug(message, *args)
        else:
            self._said.add(topic)
            log.warning(message, *args)

    @staticmethod
    def _slot(ticket: int) -> int:
        return SLOTS_AT + ticket % SLOTS

    @classmethod
    def _read_header(cls, fd: int) -> tuple[int, int]:
        return cls._unpack_header(os.pread(fd, _HEADER.size, 0))

    @staticmethod
    def _unpack_header(raw: bytes) -> tuple[int, int]:
        """``(issued, served)``; a new, still empty lock file reads as zeros."""
        issued, served = _HEADER.unpack(raw.ljust(_HEADER.size, b"\0"))
        return issued, served

    # -- descriptors ---------------------------------------------------------------------------

    def _borrow(self) -> _Descriptor | None:
        with self._pool_lock:
            if self._free:
                return self._free.pop()
            for descriptor in self._parked:
                if not descriptor.pending:  # its abandoned wait has ended
                    self._parked.remove(descriptor)
                    return descriptor
            if len(self._opened) >= MAX_DESCRIPTORS:
                return None
            try:
                fd = _open_lock_file(self.lock_path)
            except LockFileRefused as refused:
                self._disable(str(refused))
                return None
            self._opened.append(fd)
            return _Descriptor(fd, self._forget)

    def _give_back(self, descriptor: _Descriptor) -> None:
        with self._pool_lock:
            if descriptor.fd not in self._opened:
                return  # from before a fork: never reuse a parent's descriptor
            if self._idle:  # no writer attached any more
                if descriptor.retire():
                    self._close_locked(descriptor.fd)
            elif descriptor.pending:
                self._parked.append(descriptor)
            else:
                self._free.append(descriptor)

    # -- bookkeeping -------------------------------------------------------------------------

    def _account(self, turn: Turn) -> None:
        with self._stats_lock:
            stats = self._stats
            if turn.queued:
                stats.turns += 1
            else:
                stats.fallbacks += 1
                stats.fallback_reasons[turn.reason] = stats.fallback_reasons.get(turn.reason, 0) + 1
            if turn.waited > 0:
                stats.waits += 1
                stats.wait_seconds += turn.waited
                stats.max_wait_seconds = max(stats.max_wait_seconds, turn.waited)
            stats.max_depth = max(stats.max_depth, turn.depth)
        if not turn.queued and turn.reason != "disabled":
            log.debug("%s: write queue fallback (%s) after %.0f ms; %s", self.db_path,
                      turn.reason, turn.waited * 1000, self._stats)  # fmt: skip

    def _disable(self, why: str) -> None:
        if self._enabled or self._wanted:
            log.warning("%s: fair writer queue off (%s); writers wait in SQLite's busy handler",
                        self.db_path, why)  # fmt: skip
            self._said.add("off")
        self._enabled = False
        self._wanted = False


_LIVE: weakref.WeakSet[WriteQueue] = weakref.WeakSet()
_REGISTRY: dict[tuple[int, str], WriteQueue] = {}
_REGISTRY_LOCK = threading.Lock()


def _key(db_path: str | os.PathLike[str]) -> tuple[int, str]:
    return os.getpid(), os.fspath(Path(db_path))


def _registered(db_path: str | os.PathLike[str]) -> WriteQueue:
    """The registered queue for ``db_path``, made if there is none (under the registry's lock)."""
    key = _key(db_path)
    queue = _REGISTRY.get(key)
    if queue is None:
        queue = _REGISTRY[key] = WriteQueue(db_path)
    return queue


def for_database(db_path: str | os.PathLike[str]) -> WriteQueue:
    """This process's queue for the SQLite file ``db_path`` (one per file per process, while
    it is registered), for a look at it. A writer that keeps using it takes it with
    :func:`attach` instead."""
    with _REGISTRY_LOCK:
        return _registered(db_path)


def attach(db_path: str | os.PathLike[str]) -> WriteQueue:
    """This process's queue for ``db_path``, attached (see :meth:`WriteQueue.attach`): it stays
    registered, with its descriptors, until the last user calls :func:`detach`."""
    with _REGISTRY_LOCK:
        queue = _registered(db_path)
        queue.attach()
    return queue


def detach(queue: WriteQueue) -> None:
    """A user of :func:`attach` is done; the last one closes the queue's descriptors and
    unregisters it (a process that opens thousands of files keeps no object per file), unless
    it :attr:`~WriteQueue.warned` about its file."""
    key = _key(queue.db_path)
    with _REGISTRY_LOCK:
        if queue.detach() and not queue.warned and _REGISTRY.get(key) is queue:
            del _REGISTRY[key]


def _after_fork_in_child() -> None:
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    _REGISTRY.clear()
    for queue in list(_LIVE):
        queue._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
