"""Fixtures: every backend test runs on a SQLite file in tmp_path and on a real PostgreSQL.

PostgreSQL runs when ``HERMES_STORE_TEST_PG_URL`` is set (one database per xdist worker);
without it those tests skip, unless ``HERMES_STORE_REQUIRE_PG=1`` (CI), where they fail.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB, migrate
from hermes_store.engine import to_url

PG_ENV = "HERMES_STORE_TEST_PG_URL"
#: PgBouncer in transaction pooling mode in front of the same server (host, port and options
#: are taken from it; the database is the worker's), e.g.
#: ``postgresql+psycopg://postgres@127.0.0.1:6432/test?prepare_threshold=none``.
PGBOUNCER_ENV = "HERMES_STORE_TEST_PGBOUNCER_URL"
BACKENDS = ("sqlite", "postgresql")
#: The contract suites also run through PgBouncer.
CONTRACT_BACKENDS = (*BACKENDS, "pgbouncer")
#: A SQLite file at head without the CJK trigram index, as on a SQLite older than 3.34 (where
#: the revision creates nothing): the search contract must hold with and without it.
NO_CJK_INDEX = "sqlite-no-cjk-index"
SEARCH_BACKENDS = (*CONTRACT_BACKENDS, NO_CJK_INDEX)
#: The contract suites run through ``SessionDB`` and through ``AsyncSessionDB``.
FLAVORS = ("sync", "async")


def _pg_base_url() -> URL | None:
    raw = os.environ.get(PG_ENV)
    if not raw:
        if os.environ.get("HERMES_STORE_REQUIRE_PG") == "1":
            pytest.fail(f"{PG_ENV} is not set but HERMES_STORE_REQUIRE_PG=1")
        return None
    return to_url(raw)


@pytest.fixture(scope="session")
def pg_worker_url(worker_id: str, testrun_uid: str) -> Iterator[URL | None]:
    """A fresh database for this xdist worker of this run, or None without PostgreSQL.

    The run's id keeps simultaneous runs against one server out of each other's databases.
    """
    base = _pg_base_url()
    if base is None:
        yield None
        return
    name = f"hermes_test_{testrun_uid[:10]}_{worker_id}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except sa.exc.OperationalError as error:
        admin.dispose()
        if os.environ.get("HERMES_STORE_REQUIRE_PG") == "1":
            pytest.fail(f"PostgreSQL at {base} is unreachable: {error}")
        pytest.skip(f"PostgreSQL unreachable: {error.orig}")
    yield base.set(database=name)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def reset_pg(url: URL) -> None:
    """Drop everything in the worker's database (a fresh public schema)."""
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA IF EXISTS public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()


def _require_backend(backend: str, pg_worker_url: URL | None) -> None:
    if backend in ("postgresql", "pgbouncer") and pg_worker_url is None:
        pytest.skip(f"PostgreSQL tests need {PG_ENV}")
    if backend == "pgbouncer" and not os.environ.get(PGBOUNCER_ENV):
        if os.environ.get("HERMES_STORE_REQUIRE_PG") == "1":
            pytest.fail(f"{PGBOUNCER_ENV} is not set but HERMES_STORE_REQUIRE_PG=1")
        pytest.skip(f"PostgreSQL-through-PgBouncer tests need {PGBOUNCER_ENV}")


def through_pgbouncer(url: URL) -> URL:
    """The worker's database, reached through PgBouncer."""
    bouncer = to_url(os.environ[PGBOUNCER_ENV])
    return url.set(host=bouncer.host, port=bouncer.port, query=bouncer.query)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def empty_url(backend: str, pg_worker_url: URL | None, tmp_path: Path) -> URL:
    """A database with nothing in it (SQLite: a path that does not exist yet)."""
    _require_backend(backend, pg_worker_url)
    if backend in ("sqlite", NO_CJK_INDEX):
        return to_url(tmp_path / "state.db")
    assert pg_worker_url is not None
    reset_pg(pg_worker_url)
    return through_pgbouncer(pg_worker_url) if backend == "pgbouncer" else pg_worker_url


@pytest.fixture
def db_url(empty_url: URL, backend: str) -> URL:
    """A database at head with no rows."""
    migrate.upgrade(empty_url)
    if backend == NO_CJK_INDEX:
        raw = sqlite3.connect(make_url(url_string(empty_url)).database or "")
        with raw:
            for name in ("messages_cjk_insert", "messages_cjk_delete", "messages_cjk_update"):
                raw.execute(f"DROP TRIGGER {name}")
            raw.execute("DROP TABLE messages_cjk")
        raw.close()
    return empty_url


@pytest.fixture
def pg_url(pg_worker_url: URL | None) -> URL:
    """This worker's PostgreSQL database, empty and at head (for PostgreSQL-only tests)."""
    if pg_worker_url is None:
        pytest.skip(f"PostgreSQL tests need {PG_ENV}")
    reset_pg(pg_worker_url)
    migrate.upgrade(pg_worker_url)
    return pg_worker_url


@pytest.fixture
def flavor() -> str:
    """Which API the ``store`` fixture is: ``sync`` here; the contract modules override this
    with both :data:`FLAVORS`."""
    return "sync"


@pytest.fixture
def store(db_url: URL, flavor: str) -> Iterator[SessionDB]:
    if flavor == "async":
        from tests.aio_driver import AsyncDriver

        driver = AsyncDriver(db_url.render_as_string(hide_password=False))
        yield driver  # type: ignore[misc]
        driver.shutdown()
        return
    db = SessionDB(db_url.render_as_string(hide_password=False))
    yield db
    db.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SessionDB]:
    """A store on a SQLite file only (for SQLite-specific behaviour)."""
    db = SessionDB(tmp_path / "state.db")
    yield db
    db.close()


def url_string(url: URL | str) -> str:
    return url.render_as_string(hide_password=False) if isinstance(url, URL) else url


def is_sqlite(url: URL | str) -> bool:
    return make_url(url_string(url)).get_backend_name() == "sqlite"
