"""Fixtures shared by the unit-of-work tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB


@pytest.fixture
def admin(pg_worker_url: URL | None, db_url: URL) -> Iterator[Connection]:
    """A direct connection to the test database (never through PgBouncer), in autocommit:
    to watch ``pg_stat_activity`` while the store's writes wait."""
    assert pg_worker_url is not None
    engine = sa.create_engine(pg_worker_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        yield conn
    engine.dispose()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SessionDB]:
    """A store on a fresh SQLite file with session "s" (modules may define their own)."""
    store = SessionDB(tmp_path / "state.db")
    store.create_session("s", "cli")
    yield store
    store.close()
