"""One writer per process and SQLite file: the registry of shared Units of Work.

``SessionDB`` instances opened on the same file in one process share one engine, one writer
connection and one in-process write lock (one :class:`UnitOfWork`): two writers of one
process never meet as strangers inside SQLite's busy handler, and a ``transaction()`` opened
through one instance is joined by calls through another. Entries are keyed by the process id
and the file's identity (device, inode), reference-counted, and re-keyed in a forked child,
whose Units of Work have by then dropped every connection and lock of the parent.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

from hermes_store.engine.files import FileKey
from hermes_store.errors import HermesStoreError, SharedStoreMismatchError
from hermes_store.uow.unit import RetryPolicy, UnitOfWork

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreOptions:
    """What stores sharing one writer must agree on."""

    retry: RetryPolicy
    checkpoint_every: int
    writer_busy_timeout: float
    reader_busy_timeout: float
    synchronous: str
    #: ``id()`` of an Engine the caller passed in (None: the store made its own).
    engine: int | None


@dataclass
class _Entry:
    uow: UnitOfWork
    options: StoreOptions
    owns_engine: bool
    refs: int = 1


_lock = threading.Lock()
_entries: dict[tuple[int, int, int], _Entry] = {}
#: References of stores dropped without ``close()``, given back at the next look at the
#: registry: a finalizer may run anywhere (inside ``acquire`` under ``_lock``, or in a thread
#: holding the file's writer), so it only appends here (atomic, takes no lock).
_dropped: list[FileKey] = []


def forget(key: FileKey) -> None:
    """A store on ``key`` was dropped without ``close()`` (its finalizer): its reference is
    given back at the next :func:`acquire`, :func:`release` or :func:`open_files`."""
    _dropped.append(key)


def _drain() -> list[_Entry]:
    """Under ``_lock``: give back the references of dropped stores; the entries whose last
    reference that was (their Units of Work to let go of, outside the lock)."""
    ended: list[_Entry] = []
    pid = os.getpid()
    while _dropped:
        full = (pid, *_dropped.pop())
        entry = _entries.get(full)
        if entry is None:
            continue
        entry.refs -= 1
        # A block still open (``with SessionDB(path).transaction():``, its store dropped at
        # once) keeps the entry, at no reference: a store opened meanwhile joins that block.
        if entry.refs <= 0 and not entry.uow.in_block():
            del _entries[full]
            ended.append(entry)
    return ended


def _let_go(ended: list[_Entry]) -> None:
    """Outside ``_lock``: close the Units of Work no store holds any more (every store on the
    file was dropped without ``close()``), as the last ``close()`` would have."""
    for entry in ended:
        uow = entry.uow
        try:
            uow.checkpoint()
            uow.release()
        except HermesStoreError as error:  # a unit of it still open in this thread
            log.warning("a dropped store's writer stays open: %s", error)
            continue
        if entry.owns_engine:
            uow.engine.dispose()


@contextmanager
def _registry() -> Iterator[None]:
    """The registry under ``_lock``, the dropped stores' references given back first; the
    Units of Work that this ended are let go of after the lock, however the block ends."""
    ended: list[_Entry] = []
    try:
        with _lock:
            ended = _drain()
            yield
    finally:
        _let_go(ended)


def acquire(
    key: FileKey,
    options: StoreOptions,
    make: Callable[[], tuple[UnitOfWork, bool]],
    where: str,
) -> UnitOfWork:
    """The file's shared Unit of Work (made by ``make`` for the first opener: the Unit of Work
    and whether the store owns its engine); refuses options that differ from the first's."""
    with _registry():
        return _acquire(key, options, make, where)


def _acquire(
    key: FileKey,
    options: StoreOptions,
    make: Callable[[], tuple[UnitOfWork, bool]],
    where: str,
) -> UnitOfWork:
    """:func:`acquire` under ``_lock``."""
    entry = _entries.get((os.getpid(), *key))
    if entry is not None:
        if entry.options != options:
            diff = ", ".join(
                f"{f.name}={getattr(options, f.name)!r}, "
                f"open with {getattr(entry.options, f.name)!r}"
                for f in fields(options)
                if f.name != "engine" and getattr(options, f.name) != getattr(entry.options, f.name)
            )
            if options.engine != entry.options.engine:
                diff = "; ".join(filter(None, [diff, "through a different Engine"]))
            raise SharedStoreMismatchError(
                f"{where} is already open in this process with other options ({diff}); "
                "stores on one file share one writer, so open them with the same options"
            )
        entry.refs += 1
        return entry.uow
    uow, owns_engine = make()
    _entries[(os.getpid(), *key)] = _Entry(uow, options, owns_engine)
    return uow


def release(key: FileKey) -> tuple[bool, bool]:
    """Drop one reference: (was it the last, does the store own the engine)."""
    with _registry():
        full = (os.getpid(), *key)
        entry = _entries.get(full)
        if entry is None:
            return True, False
        entry.refs -= 1
        if entry.refs > 0:
            return False, entry.owns_engine
        del _entries[full]
        return True, entry.owns_engine


def open_files() -> int:
    """How many files this process has open through shared writers (for tests and stats)."""
    with _registry():
        return sum(1 for pid, *_ in _entries if pid == os.getpid())


def _after_fork_in_child() -> None:
    """The child keeps its copies of the parent's stores: their entries move to its pid (the
    Units of Work have already forgotten the parent's connections and locks)."""
    global _lock, _entries
    _lock = threading.Lock()
    child = os.getpid()
    _entries = {(child, dev, ino): entry for (_pid, dev, ino), entry in _entries.items()}


os.register_at_fork(after_in_child=_after_fork_in_child)
