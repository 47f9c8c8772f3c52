"""A database the store cannot use as it is gets a package error, never a raw driver error,
and is left as it was: a role granted SELECT only, a recorded revision whose tables are not
there (or are another application's), and a ``search_path`` naming no existing schema."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.errors import (
    AccessDeniedError,
    ReadOnlyDatabaseError,
    StoreConfigError,
    UnrecognizedSchemaError,
)
from hermes_store.schema import migrate
from tests.support.backends import reset_pg, run_sql, url_string


def _cli(url: URL | str, *args: str) -> Result:
    runner = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1", "HERMES_STORE_URL": None})
    return runner.invoke(cli, ["--db", url_string(url), *args])


def _error_line(result: Result) -> str:
    """The one ``Error:`` line of a command that failed with exit 3."""
    assert result.exit_code == 3, (result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "database error:" not in lines[0]  # the package's words, not the driver's
    return lines[0]


def _snapshot(url: URL) -> dict[str, Any]:
    """Every table of the database's schemas with its columns and rows: what must not change."""
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            tables = conn.exec_driver_sql(
                "SELECT table_schema, table_name FROM information_schema.tables "
                "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2"
            ).all()
            found: dict[str, Any] = {}
            for schema, table in tables:
                name = f'"{schema}"."{table}"'
                columns = conn.exec_driver_sql(
                    "SELECT column_name, data_type FROM information_schema.columns "
                    f"WHERE table_schema = '{schema}' AND table_name = '{table}' ORDER BY 1"
                ).all()
                rows = sorted(map(tuple, conn.exec_driver_sql(f"SELECT * FROM {name}").all()))
                found[name] = (columns, rows)
            triggers = conn.exec_driver_sql(
                "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1"
            ).scalars()
            found["triggers"] = list(triggers)
            return found
    finally:
        engine.dispose()


@pytest.fixture
def blank_pg(pg_worker_url: URL | None) -> URL:
    """This worker's PostgreSQL database with nothing in it (no migration run)."""
    if pg_worker_url is None:
        pytest.skip("PostgreSQL tests need HERMES_STORE_TEST_PG_URL")
    reset_pg(pg_worker_url)
    return pg_worker_url


# -- a role granted SELECT only ----------------------------------------------------------------


@pytest.fixture
def select_only_url(pg_url: URL) -> Iterator[URL]:
    """``pg_url`` (at head, one session with one message) reached as a role of its own that
    was granted SELECT on every table and nothing more; the role is dropped afterwards."""
    with SessionDB(url_string(pg_url)) as store:
        store.create_session("s1", "cli")
        store.append_message("s1", "user", "hello")
    role = f"hermes_ro_{uuid.uuid4().hex[:12]}"
    run_sql(
        pg_url,
        f'CREATE ROLE "{role}" LOGIN',
        f'GRANT USAGE ON SCHEMA public TO "{role}"',
        f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"',
    )
    try:
        yield pg_url.set(username=role, password=None)
    finally:
        run_sql(pg_url, f'DROP OWNED BY "{role}"', f'DROP ROLE IF EXISTS "{role}"')


WRITES: dict[str, Callable[[SessionDB], object]] = {
    "create_session": lambda db: db.create_session("s2", "cli"),
    "append_message": lambda db: db.append_message("s1", "assistant", "hi"),
    "append_message_keyed": lambda db: db.append_message(
        "s1", "assistant", "hi", idempotency_key="k1"
    ),
    "update_token_counts": lambda db: db.update_token_counts("s1", input_tokens=5),
    "update_token_counts_keyed": lambda db: db.update_token_counts(
        "s1", input_tokens=5, idempotency_key="k2"
    ),
    "set_session_title": lambda db: db.set_session_title("s1", "a title"),
    "delete_session": lambda db: db.delete_session("s1"),
}


def test_a_select_only_role_reads_and_every_write_names_the_privilege(
    pg_url: URL, select_only_url: URL
) -> None:
    before = _snapshot(pg_url)
    with SessionDB(url_string(select_only_url)) as store:
        assert store.get_session("s1") is not None  # reading is granted
        for name, write in WRITES.items():
            with pytest.raises(AccessDeniedError, match="permission denied") as raised:
                write(store)
            assert isinstance(raised.value, ReadOnlyDatabaseError), name
            assert "privilege" in str(raised.value), name
    assert _snapshot(pg_url) == before  # nothing was written


def test_the_cli_prints_the_privilege_error(pg_url: URL, select_only_url: URL) -> None:
    line = _error_line(_cli(select_only_url, "sessions", "rename", "s1", "new title"))
    assert "permission denied for table sessions" in line and "privilege" in line
    with SessionDB(url_string(pg_url)) as store:
        assert store.get_session_title("s1") is None


# -- a recorded revision the tables do not match -------------------------------------------------

VERSION_TABLE = (
    "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)",
    "INSERT INTO alembic_version VALUES ('{revision}')",
)


@pytest.mark.parametrize("revision", ["v3_session_title", "h9_write_keys", "v1_base"])
def test_a_recorded_revision_without_its_tables_is_refused(blank_pg: URL, revision: str) -> None:
    run_sql(blank_pg, *(s.format(revision=revision) for s in VERSION_TABLE))
    before = _snapshot(blank_pg)
    with pytest.raises(UnrecognizedSchemaError, match=rf"{revision}.*no sessions"):
        SessionDB(url_string(blank_pg))
    with pytest.raises(UnrecognizedSchemaError, match="no sessions"):
        migrate.upgrade(blank_pg)
    assert "no sessions" in _error_line(_cli(blank_pg, "db", "upgrade"))
    assert "no sessions" in _error_line(_cli(blank_pg, "stats"))  # opened without migrating
    assert _snapshot(blank_pg) == before


def test_a_recorded_revision_over_another_applications_tables_is_refused(blank_pg: URL) -> None:
    run_sql(
        blank_pg,
        "CREATE TABLE sessions (id SERIAL PRIMARY KEY, owner TEXT, expires TIMESTAMP)",
        "CREATE TABLE messages (id SERIAL PRIMARY KEY, session INTEGER, body TEXT)",
        "INSERT INTO sessions (owner) VALUES ('alice')",
        "INSERT INTO messages (session, body) VALUES (1, 'their data')",
        *(s.format(revision="v5_billing_columns") for s in VERSION_TABLE),
    )
    before = _snapshot(blank_pg)
    with pytest.raises(UnrecognizedSchemaError) as raised:
        SessionDB(url_string(blank_pg))
    message = str(raised.value)
    # What was found against what the revision needs.
    assert "v5_billing_columns" in message and "sessions" in message
    assert "has columns expires, id, owner and lacks 25 of the 26 it needs" in message
    with pytest.raises(UnrecognizedSchemaError):
        migrate.upgrade(blank_pg)
    assert "v5_billing_columns" in _error_line(_cli(blank_pg, "db", "upgrade"))
    assert _snapshot(blank_pg) == before


@pytest.mark.parametrize("revision", ["v3_session_title", "v5_billing_columns"])
def test_the_upgrade_names_a_missing_table_even_past_the_preflight(
    blank_pg: URL, revision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net alone (the preflight switched off): the revision that meets another
    application's tables fails as the package's error, rolled back."""
    run_sql(
        blank_pg,
        "CREATE TABLE sessions (id SERIAL PRIMARY KEY, owner TEXT)",
        "CREATE TABLE messages (id SERIAL PRIMARY KEY, body TEXT)",
        *(s.format(revision=revision) for s in VERSION_TABLE),
    )
    before = _snapshot(blank_pg)
    monkeypatch.setattr(migrate, "check_recorded_tables", lambda state, where: None)
    with pytest.raises(UnrecognizedSchemaError, match=rf"{revision}.*does not exist"):
        migrate.upgrade(blank_pg)
    assert _snapshot(blank_pg) == before


def test_a_table_a_later_revision_creates_is_refused(blank_pg: URL) -> None:
    """``write_keys`` already there at h8: h9 would fail creating it."""
    migrate.upgrade(blank_pg)
    migrate.stamp(blank_pg, "h8_pg_bigint_counters")
    before = _snapshot(blank_pg)
    with pytest.raises(UnrecognizedSchemaError, match="write_keys"):
        SessionDB(url_string(blank_pg))
    assert _snapshot(blank_pg) == before


def test_an_upgrade_that_meets_objects_it_creates_is_refused(blank_pg: URL) -> None:
    """The safety net under the preflight: a database at head recorded as h9 passes the
    table check, and h10 then finds its own triggers there already. The upgrade's error is
    the package's, and its transaction is rolled back."""
    migrate.upgrade(blank_pg)
    migrate.stamp(blank_pg, "h9_write_keys")
    before = _snapshot(blank_pg)
    with pytest.raises(UnrecognizedSchemaError, match=r"h9_write_keys.*already exists"):
        SessionDB(url_string(blank_pg))
    assert _snapshot(blank_pg) == before
    assert migrate.current(blank_pg) == "h9_write_keys"


def test_sqlite_a_recorded_revision_without_its_tables_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as raw:
        for statement in VERSION_TABLE:
            raw.execute(statement.format(revision="v3_session_title"))
    raw.close()
    with pytest.raises(UnrecognizedSchemaError, match=r"v3_session_title.*no sessions"):
        SessionDB(path)
    with sqlite3.connect(path) as raw:
        tables = {name for (name,) in raw.execute("SELECT name FROM sqlite_master")}
    raw.close()
    assert tables <= {"alembic_version", "sqlite_autoindex_alembic_version_1"}


# -- a search_path that names no existing schema ------------------------------------------------


def test_a_search_path_naming_no_schema_is_a_config_error(blank_pg: URL) -> None:
    url = blank_pg.update_query_dict({"options": "-csearch_path=nosuch"})
    before = _snapshot(blank_pg)
    with pytest.raises(StoreConfigError, match="search_path") as raised:
        SessionDB(url_string(url))
    assert "nosuch" in str(raised.value)
    with pytest.raises(StoreConfigError, match="search_path"):
        migrate.upgrade(url)
    assert "search_path" in _error_line(_cli(url, "stats"))
    assert _snapshot(blank_pg) == before


# -- a database that is not UTF-8 ---------------------------------------------------------------


@pytest.fixture
def latin1_pg(pg_worker_url: URL | None) -> Iterator[URL]:
    """A new, empty LATIN1 database beside this worker's (dropped afterwards)."""
    if pg_worker_url is None:
        pytest.skip("PostgreSQL tests need HERMES_STORE_TEST_PG_URL")
    name = f"{pg_worker_url.database}_latin1"
    admin = sa.create_engine(pg_worker_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(
            f"CREATE DATABASE \"{name}\" ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0"
        )
    try:
        yield pg_worker_url.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_a_database_that_is_not_utf8_is_refused_before_anything_is_created(
    latin1_pg: URL,
) -> None:
    """A LATIN1 database took the schema and plain text, then refused the first message in
    Chinese ("has no equivalent in encoding LATIN1"), long after the store opened."""
    with pytest.raises(StoreConfigError, match="encoding is LATIN1") as raised:
        SessionDB(url_string(latin1_pg))
    assert "UTF8" in str(raised.value)
    with pytest.raises(StoreConfigError, match="encoding is LATIN1"):
        migrate.upgrade(latin1_pg)
    assert "encoding is LATIN1" in _error_line(_cli(latin1_pg, "db", "upgrade"))
    assert _snapshot(latin1_pg) == {"triggers": []}
