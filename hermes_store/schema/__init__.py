"""The schema and its history: DDL facts, the full-text index per backend, migrations.

``ddl`` holds the frozen facts (the column history, the raw DDL SQLAlchemy cannot express),
``steps`` the mechanics the Alembic revisions share, ``revisions`` where the revisions are,
``fulltext`` the full-text index strategy per backend, ``migrate`` upgrade, adoption of the
original store's files and the open-time check. May import: ``hermes_store.uow``,
``hermes_store.engine``, ``hermes_store.errors`` and the leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_store.faces import lazy_names

if TYPE_CHECKING:
    from hermes_store.schema.migrate import current, downgrade, history, stamp, upgrade

__all__ = ["current", "downgrade", "history", "stamp", "upgrade"]

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "migrate"))
