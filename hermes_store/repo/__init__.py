"""Statements per backend: what a unit runs, on the connection it is given.

``statements`` (the base), ``sqlite`` and ``postgresql`` hold the writes that differ per
backend, one object per backend that a store looks up once (``dialects.for_dialect``);
``messages`` reads a session's messages and decodes their JSON; ``listing`` lists sessions (the
rich list, compression chains, children); ``pgstream`` streams exports and imports through
psycopg on PostgreSQL. Nothing here begins or commits on its own: a write runs as the unit of
work runs it. May import: ``hermes_store.schema``, ``hermes_store.uow``,
``hermes_store.engine`` and the leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_store.faces import lazy_names

if TYPE_CHECKING:
    from hermes_store.repo.dialects import for_dialect
    from hermes_store.repo.statements import Statements

__all__ = ["Statements", "for_dialect"]

__getattr__, __dir__ = lazy_names(__name__, {"Statements": "statements", "for_dialect": "dialects"})
