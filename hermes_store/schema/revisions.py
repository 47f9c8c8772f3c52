"""Where the Alembic revisions are, read once per process.

Both the migrations and the full-text index's repair (which revision built which index) read the
revision graph; it lives here, below both.
"""

from __future__ import annotations

import functools
from pathlib import Path

from alembic.script import ScriptDirectory


def script_location() -> str:
    """The revisions' folder: ``hermes_store.migrations`` (a wheel, or a checkout's pointer)."""
    import hermes_store.migrations

    for folder in map(Path, hermes_store.migrations.__path__):
        if (folder / "env.py").is_file():
            return str(folder)
    raise FileNotFoundError("hermes_store's Alembic revisions are missing from this install")


@functools.cache
def scripts() -> ScriptDirectory:
    """The revisions, read once per process: opening a database consults them every time."""
    return ScriptDirectory(script_location())
