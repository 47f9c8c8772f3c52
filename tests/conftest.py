"""Fixtures: every backend test runs on a SQLite file in tmp_path and on a real PostgreSQL.
Test modules import the helpers the fixtures share from tests/support (``backends``,
``clock``), never from here.

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

from hermes_store import SessionDB
from hermes_store.engine.factory import to_url
from hermes_store.schema import migrate
from tests.support import disks
from tests.support.backends import (
    BACKENDS,
    NO_CJK_INDEX,
    PG_ENV,
    PGBOUNCER_ENV,
    reset_pg,
    through_pgbouncer,
    url_string,
)
from tests.support.clock import FakeClock

#: Modules whose tests run in-process in well under a second each: their SQLite cases (and
#: tests without a backend) form the unit tier, ``pytest -m unit``. PostgreSQL and PgBouncer
#: cases, tests that need the server (``pg_url``) and ``slow`` tests never do; a test elsewhere
#: joins with an explicit ``@pytest.mark.unit``.
UNIT_MODULES = frozenset(
    {
        "test_analytics",
        "test_bad_input",
        "test_clock",
        "test_engine",
        "test_fulltext",
        "test_hardening_open",
        "test_listing",
        "test_migrate_modes",
        "test_paths",
        "test_placement",
        "test_redact",
        "test_search",
        "test_store",
        "test_trajectory",
        "test_transactions",
    }
)
#: Tests of those modules that take seconds (large data, lock waits): integration tier, as are
#: all hypothesis tests.
UNIT_EXCLUDED = (
    "test_large_database",
    "test_ten_megabyte",
    "test_reads_and_searches_answer_or_refuse_cleanly",
    "test_damaged_database_waits_for_the_lock",
    "test_message_too_large_for_a_tsvector",
    "test_to_dataframe_on_every_kind_of_target",
)
#: Backends of the unit tier; the CJK-less SQLite variant repeats the search contract.
_SERVER_BACKENDS = frozenset({"postgresql", "pgbouncer", NO_CJK_INDEX})
_SERVER_FIXTURES = frozenset({"pg_url", "pg_worker_url"})


def _is_unit(item: pytest.Item) -> bool:
    if item.get_closest_marker("slow") is not None:
        return False
    module = getattr(item, "module", None)
    if module is None or module.__name__.rpartition(".")[2] not in UNIT_MODULES:
        return False
    if getattr(item, "originalname", item.name).startswith(UNIT_EXCLUDED):
        return False
    if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        return False
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    if any(isinstance(value, str) and value in _SERVER_BACKENDS for value in params):
        return False
    return not _SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the unit tier (see UNIT_MODULES)."""
    for item in items:
        if _is_unit(item):
            item.add_marker(pytest.mark.unit)


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


def _require_backend(backend: str, pg_worker_url: URL | None) -> None:
    if backend in ("postgresql", "pgbouncer") and pg_worker_url is None:
        pytest.skip(f"PostgreSQL tests need {PG_ENV}")
    if backend == "pgbouncer" and not os.environ.get(PGBOUNCER_ENV):
        if os.environ.get("HERMES_STORE_REQUIRE_PG") == "1":
            pytest.fail(f"{PGBOUNCER_ENV} is not set but HERMES_STORE_REQUIRE_PG=1")
        pytest.skip(f"PostgreSQL-through-PgBouncer tests need {PGBOUNCER_ENV}")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def empty_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> URL:
    """A database with nothing in it (SQLite: a path that does not exist yet). SQLite cases
    never touch the PostgreSQL server (the unit tier runs without one)."""
    if backend in ("sqlite", NO_CJK_INDEX):
        return to_url(tmp_path / "state.db")
    pg_worker_url: URL | None = request.getfixturevalue("pg_worker_url")
    _require_backend(backend, pg_worker_url)
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
def tiny_disk() -> Iterator[Path]:
    """A real 4 MB tmpfs, mounted for this test and unmounted afterwards (skipped where it
    cannot be: not root, no mount)."""
    with disks.tiny_tmpfs() as folder:
        yield folder


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def flavor() -> str:
    """Which API the ``store`` fixture is: ``sync`` here; the contract modules override this
    with both :data:`FLAVORS`."""
    return "sync"


@pytest.fixture
def store(db_url: URL, flavor: str, clock: FakeClock) -> Iterator[SessionDB]:
    if flavor == "async":
        from tests.support.aio_driver import AsyncDriver

        driver = AsyncDriver(db_url.render_as_string(hide_password=False), clock=clock)
        yield driver  # type: ignore[misc]
        driver.shutdown()
        return
    db = SessionDB(db_url.render_as_string(hide_password=False), clock=clock)
    yield db
    db.close()


@pytest.fixture
def sqlite_store(tmp_path: Path, clock: FakeClock) -> Iterator[SessionDB]:
    """A store on a SQLite file only (for SQLite-specific behaviour)."""
    db = SessionDB(tmp_path / "state.db", clock=clock)
    yield db
    db.close()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SessionDB]:
    """A store on a fresh SQLite file with session "s" (a module may define its own)."""
    store = SessionDB(tmp_path / "state.db")
    store.create_session("s", "cli")
    yield store
    store.close()
