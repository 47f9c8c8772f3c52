"""Units of work and concurrency: one transaction per unit, and how writers take turns.

``unit`` holds the Unit of Work (units that compose: run, read, transaction, session), which
picks its backend once (``backends``: SQLite or PostgreSQL). Below it: ``groupcommit`` and
``pggroup`` (group commit on SQLite and PostgreSQL, over ``leaders``), ``writer`` (the SQLite
file's one writer: its turn, connection, WAL check and checkpoints), ``readers`` (held
per-thread read connections), ``autocommit`` (PostgreSQL's one-statement path), ``writequeue``
(the fair cross-process writer queue of a SQLite file), ``retry`` (the retry policy and the
patience for an unreachable server), ``fork`` (the reset in a forked child) and ``counters``
(``StoreStats``). ``shared`` keeps one Unit of Work per process and file. The layers inside are
the second contract in ``pyproject.toml``. May import: ``hermes_store.engine``,
``hermes_store.errors`` and the leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_store.faces import lazy_names

if TYPE_CHECKING:
    from hermes_store.uow.counters import StoreStats
    from hermes_store.uow.retry import RetryPolicy
    from hermes_store.uow.unit import UnitOfWork

__all__ = ["RetryPolicy", "StoreStats", "UnitOfWork"]

__getattr__, __dir__ = lazy_names(
    __name__, {"RetryPolicy": "retry", "StoreStats": "counters", "UnitOfWork": "unit"}
)
