"""Which databases the tests run on and how they reach them: the environment variables naming
the PostgreSQL server (and PgBouncer in front of it), the backend parameter values, and the
helpers tests and fixtures share (``url_string``, ``is_sqlite``, ``reset_pg``,
``through_pgbouncer``). The fixtures themselves are in tests/conftest.py."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

from hermes_store.engine.factory import to_url

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


#: An ordinary PostgreSQL role, as analysts' queries connect (``query`` refuses a role whose
#: SQL reaches past the database, the superuser the tests connect as among them). It may write
#: the store's tables, so a query's read-only transaction, not a missing grant, is what refuses
#: a write. PgBouncer's user list names it too (.ci/pgbouncer).
ANALYST_ROLE = "hermes_analyst"


def url_string(url: URL | str) -> str:
    """A URL as text with its password (what a store or a subprocess is given)."""
    return url.render_as_string(hide_password=False) if isinstance(url, URL) else url


def is_sqlite(url: URL | str) -> bool:
    return make_url(url_string(url)).get_backend_name() == "sqlite"


def sqlite_lock_is_free(path: Path | str) -> bool:
    """No one holds the SQLite file's write lock: a foreign connection (the original store, a
    shell) takes it at once."""
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


def run_sql(url: URL, *statements: str) -> None:
    """Run ``statements`` in one transaction on a connection of its own (a setup step)."""
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.exec_driver_sql(statement)
    finally:
        engine.dispose()


def reset_pg(url: URL) -> None:
    """Drop everything in the worker's database: a fresh public schema, and no schema an
    earlier test placed a store in (``SessionDB(schema=...)``, the README's example)."""
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        schemas = conn.exec_driver_sql(
            "SELECT nspname FROM pg_namespace WHERE left(nspname, 3) <> 'pg_' "
            "AND nspname <> 'information_schema'"
        ).scalars()
        for name in list(schemas):
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()


def through_pgbouncer(url: URL) -> URL:
    """The worker's database, reached through PgBouncer."""
    bouncer = to_url(os.environ[PGBOUNCER_ENV])
    return url.set(host=bouncer.host, port=bouncer.port, query=bouncer.query)


def analyst_url(url: URL | str) -> str:
    """``url`` as :data:`ANALYST_ROLE` (created once per server), granted every table its
    public schema holds now; a SQLite target as it is."""
    if is_sqlite(url):
        return url_string(url)
    engine = sa.create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(  # several test workers may create it at once
                f"DO $$ BEGIN CREATE ROLE {ANALYST_ROLE} LOGIN; "
                "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
            )
            conn.exec_driver_sql(f"GRANT ALL ON SCHEMA public TO {ANALYST_ROLE}")
            conn.exec_driver_sql(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {ANALYST_ROLE}")
    finally:
        engine.dispose()
    return url_string(make_url(url_string(url)).set(username=ANALYST_ROLE, password=None))
