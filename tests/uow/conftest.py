"""Fixtures shared by the unit-of-work tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import NullPool


@pytest.fixture
def admin(pg_worker_url: URL | None, db_url: URL) -> Iterator[Connection]:
    """A direct connection to the test database (never through PgBouncer), in autocommit:
    to watch ``pg_stat_activity`` while the store's writes wait."""
    assert pg_worker_url is not None
    engine = sa.create_engine(pg_worker_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        yield conn
    engine.dispose()
