"""The revisions of the schema: their ids, known without Alembic, and where their scripts are.

Opening a database compares its version table with :data:`HEAD`; at head that is all the
open-time check needs, so it never imports Alembic or reads the scripts (which costs a process
more than its first read). :data:`REVISIONS` spells the linear history out once, and a test
holds it equal to the script directory: adding a revision means adding its id here.
Alembic's script reader (:func:`scripts`) loads only for the work that needs it (migrating,
``db history``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alembic.script import ScriptDirectory

#: Every revision, oldest first: one linear chain from base.
REVISIONS = (
    "v1_base",
    "v2_finish_reason",
    "v3_session_title",
    "v4_title_unique_index",
    "v5_billing_columns",
    "v6_reasoning_columns",
    "h7_cjk_index",
    "h8_pg_bigint_counters",
    "h9_write_keys",
    "h10_pg_long_text",
)
#: The revision a database is at once every migration has run.
HEAD = REVISIONS[-1]


def up_to(revision: str) -> tuple[str, ...]:
    """The revisions a database at ``revision`` has run, oldest first (empty when unknown)."""
    if revision not in REVISIONS:
        return ()
    return REVISIONS[: REVISIONS.index(revision) + 1]


def for_version(version: int) -> str | None:
    """The revision of the original store's schema version (``v3_session_title`` for 3)."""
    return next((r for r in REVISIONS if r.startswith(f"v{version}_")), None)


def script_location() -> str:
    """The revisions' folder: ``hermes_store.migrations`` (a wheel, or a checkout's pointer)."""
    import hermes_store.migrations

    for folder in map(Path, hermes_store.migrations.__path__):
        if (folder / "env.py").is_file():
            return str(folder)
    raise FileNotFoundError("hermes_store's Alembic revisions are missing from this install")


@functools.cache
def scripts() -> ScriptDirectory:
    """The revision scripts, read once per process, for the work that runs them."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(script_location())
