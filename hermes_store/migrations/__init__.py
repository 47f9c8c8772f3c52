"""The Alembic revisions, as ``hermes_store.migrations``.

They live in the top-level ``migrations/`` folder beside ``alembic.ini``; a built wheel carries
that folder here in place of this file. In a checkout (an editable install) this package points
its path at the folder, so ``python -m hermes_store.migrations`` works the same from both.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "migrations")]
