"""A credential in a URL's query string (``?password=...``, which psycopg and libpq accept) is
never shown: not by the CLI, not in logs, not in error messages, not in ``repr(engine)``."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB, create_engine
from hermes_store.cli import cli
from hermes_store.errors import HermesStoreError
from hermes_store.schema import migrate
from tests.support.backends import reset_pg, url_string

SECRET = "S3cr3tValue"


def _with_secret(url: URL) -> str:
    """The server URL with the password in its query string (trust auth ignores it)."""
    return f"{url_string(url)}?password={SECRET}&sslpassword={SECRET}x&sslmode=prefer"


def test_display_url_masks_every_credential() -> None:
    from hermes_store.engine.factory import display_url

    shown = display_url(
        make_url(
            f"postgresql+psycopg://hermes:{SECRET}@db:5432/hermes?password={SECRET}"
            f"&sslpassword={SECRET}&auth_token={SECRET}&client_secret={SECRET}"
            "&sslmode=require&sslkey=/etc/k.pem&passfile=/home/h/.pgpass&application_name=gw"
        )
    )
    assert SECRET not in shown
    assert shown.startswith("postgresql+psycopg://hermes:***@db:5432/hermes?")
    for kept in ("sslmode=require", "application_name=gw", "passfile=", "sslkey="):
        assert kept in shown
    for masked in ("password=***", "sslpassword=***", "auth_token=***", "client_secret=***"):
        assert masked in shown


@pytest.fixture
def secret_url(pg_url: URL) -> Iterator[str]:
    db = SessionDB(url_string(pg_url))
    try:
        db.create_session("s1", "cli", model="m")
        db.append_message("s1", "user", "hello quetzalcoatlus")
    finally:
        db.close()
    yield _with_secret(pg_url)


COMMANDS = [
    ["doctor"],
    ["doctor", "--json"],
    ["db", "current"],
    ["db", "current", "--json"],
    ["db", "upgrade"],
    ["db", "check"],
    ["db", "history"],
    ["stats"],
    ["stats", "--json"],
    ["stats", "--format", "table"],
    ["sessions", "list"],
    ["sessions", "list", "--json"],
    ["sessions", "list", "--format", "table"],
    ["sessions", "show", "s1"],
    ["sessions", "show", "nope"],
    ["export"],
    ["search", "quetzalcoatlus"],
    ["search", "quetzalcoatlus", "--json"],
    ["search", "quetzalcoatlus", "--format", "table"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda args: " ".join(args))
def test_no_cli_command_shows_a_query_string_password(
    secret_url: str, args: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    result = CliRunner().invoke(cli, ["--db", secret_url, *args])
    shown = result.stdout + result.stderr + caplog.text
    assert result.exception is None or isinstance(result.exception, SystemExit), shown
    assert SECRET not in shown
    if result.exception is not None:
        assert SECRET not in repr(result.exception)


READERS = [
    ["stats"],
    ["doctor"],
    ["doctor", "--json"],
    ["db", "current", "--json"],
    ["sessions", "list"],
    ["export"],
    ["search", "hello"],
]


def test_cli_errors_on_unusable_databases_hide_the_password(
    pg_worker_url: URL | None, pg_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    unknown = url_string(pg_url.set(database="hermes_no_such_database_here"))
    empty = pg_url
    reset_pg(pg_url)  # no schema: the commands that read refuse it, naming the database
    for target in (unknown, url_string(empty)):
        for args in READERS:
            result = CliRunner().invoke(cli, ["--db", f"{target}?password={SECRET}", *args])
            assert SECRET not in result.stdout + result.stderr + caplog.text, (target, args)
    bad = CliRunner().invoke(cli, ["--db", f"mysql://u@h/d?password={SECRET}", "stats"])
    assert bad.exit_code == 2 and SECRET not in bad.stdout + bad.stderr


def test_a_migration_log_hides_the_password(pg_url: URL, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    reset_pg(pg_url)
    result = CliRunner().invoke(cli, ["--db", _with_secret(pg_url), "db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert "migration committed" in caplog.text
    assert SECRET not in result.stdout + result.stderr + caplog.text


def test_library_logs_errors_and_reprs_hide_the_password(
    pg_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = _with_secret(pg_url)
    engine = create_engine(url)
    try:
        assert SECRET not in repr(engine) + str(engine.url) + repr(engine.url)
        with engine.connect() as conn:  # the password still reaches the driver's arguments
            assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1
    finally:
        engine.dispose()
    with SessionDB(url) as db:
        db.append_message  # noqa: B018 (opened: the migration check ran)
        assert SECRET not in repr(db.engine) + repr(db.engine.url)
    # A schema the store does not recognise: the error names the database.
    raw = sa.create_engine(pg_url, poolclass=NullPool)
    with raw.begin() as conn:
        conn.exec_driver_sql("DROP TABLE alembic_version")
        conn.exec_driver_sql("UPDATE schema_version SET version = 99")
    raw.dispose()
    with pytest.raises(HermesStoreError) as caught:
        SessionDB(url)
    assert SECRET not in str(caught.value) + repr(caught.value)
    with pytest.raises(HermesStoreError) as caught:
        migrate.upgrade(url)
    assert SECRET not in str(caught.value)
    assert SECRET not in caplog.text
