"""Units of work and concurrency: one transaction per unit, and how writers take turns.

``unit`` holds the Unit of Work (units that compose, retries, the writer and held readers),
``writequeue`` the fair cross-process writer queue of a SQLite file, ``groupcommit`` and
``pggroup`` group commit on SQLite and PostgreSQL, ``shared`` the one writer per process and
file. May import: ``hermes_store.engine``, ``hermes_store.errors`` and the leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_store.faces import lazy_names

if TYPE_CHECKING:
    from hermes_store.uow.unit import RetryPolicy, StoreStats, UnitOfWork

__all__ = ["RetryPolicy", "StoreStats", "UnitOfWork"]

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "unit"))
