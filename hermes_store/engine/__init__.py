"""Connections: where a path, URL or Engine becomes a configured Engine.

``factory`` builds engines (SQLite hooks, PostgreSQL liveness, the autocommit twin), ``placement``
says which schema and version table the tables live in, ``files`` looks at a SQLite database's
files without disturbing its locks, and ``fastpath`` runs compiled statements on the driver.
May import: ``hermes_store.errors`` and the leaves, nothing above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hermes_store.faces import lazy_names

if TYPE_CHECKING:
    from hermes_store.engine.factory import (
        create_engine,
        default_db_path,
        display_url,
        to_url,
        url_from_environment,
    )
    from hermes_store.engine.placement import Placement

__all__ = [
    "Placement",
    "create_engine",
    "default_db_path",
    "display_url",
    "to_url",
    "url_from_environment",
]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        **dict.fromkeys(
            ("create_engine", "default_db_path", "display_url", "to_url", "url_from_environment"),
            "factory",
        ),
        "Placement": "placement",
    },
)
