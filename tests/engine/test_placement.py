"""Embedding the store in an application's own database: its tables in a schema, its Alembic
version table under another name, the application's same-named tables untouched."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import AsyncSessionDB, InvalidInputError, SessionDB, WriteNotLandedError, transfer
from hermes_store.engine.factory import create_engine
from hermes_store.engine.placement import Placement
from hermes_store.schema import migrate
from tests.support.backends import url_string

SCHEMAS = ("hermes_a", "hermes_b", "hermes_x")
SERVERS = ["postgresql", "pgbouncer"]


def _admin(url: URL) -> sa.Engine:
    """A plain engine in the default placement (PgBouncer's URL options understood)."""
    return create_engine(url, poolclass=NullPool, placement=Placement())


@pytest.fixture
def app_db(empty_url: URL) -> Iterator[URL]:
    """The worker's database with the application's own ``sessions`` and ``alembic_version``
    in ``public``, and none of the test schemas."""
    engine = _admin(empty_url)
    with engine.begin() as conn:
        for name in SCHEMAS:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        conn.exec_driver_sql("CREATE TABLE sessions (id int PRIMARY KEY, who text)")
        conn.exec_driver_sql("INSERT INTO sessions VALUES (1, 'app user')")
        conn.exec_driver_sql("CREATE TABLE alembic_version (version_num varchar(32) NOT NULL)")
        conn.exec_driver_sql("INSERT INTO alembic_version VALUES ('app_rev_42')")
    yield empty_url
    with engine.begin() as conn:
        for name in SCHEMAS:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {name} CASCADE")
    engine.dispose()


def _public(url: URL) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]], set[str]]:
    engine = _admin(url)
    with engine.connect() as conn:
        rows = [tuple(r) for r in conn.exec_driver_sql("SELECT * FROM public.sessions")]
        version = [tuple(r) for r in conn.exec_driver_sql("SELECT * FROM public.alembic_version")]
        tables = set(sa.inspect(conn).get_table_names(schema="public"))
    engine.dispose()
    return rows, version, tables


def _tables(url: URL, schema: str) -> set[str]:
    engine = _admin(url)
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names(schema=schema))
    engine.dispose()
    return tables


@pytest.mark.parametrize("backend", SERVERS)
def test_two_stores_in_two_schemas_beside_the_apps_tables(app_db: URL) -> None:
    before = _public(app_db)
    url = url_string(app_db)
    with (
        SessionDB(url, schema="hermes_a", version_table="hermes_alembic_version") as a,
        SessionDB(url, schema="hermes_b") as b,
    ):
        a.create_session("s1", "cli")
        a.append_message("s1", "user", "the quagga migrates in schema a")
        b.create_session("s1", "telegram")
        b.append_message("s1", "user", "the zebra stays in schema b")
        with a.transaction():
            a.update_token_counts("s1", input_tokens=7)
        assert a.get_session("s1")["source"] == "cli"  # type: ignore[index]
        assert b.get_session("s1")["source"] == "telegram"  # type: ignore[index]
        assert [h["session_id"] for h in a.search_messages("quagga")] == ["s1"]
        assert a.search_messages("zebra") == [] and b.search_messages("quagga") == []
        assert a.check_search_index() and b.check_search_index()
        a.rebuild_search_index()
        assert [h["session_id"] for h in a.search_messages("quagga")] == ["s1"]
        assert a.list_sessions_rich()[0]["preview"].startswith("the quagga")
        assert [s["id"] for s in b.export_all()] == ["s1"]
        exported = a.export_all()
        exported[0]["id"] = "from_a"
        for message in exported[0]["messages"]:
            message["session_id"] = "from_a"
        report = transfer.import_sessions(b, enumerate(exported, 1))
        assert report.sessions == 1
        assert [h["session_id"] for h in b.search_messages("quagga")] == ["from_a"]
        assert a.search_messages("quagga")[0]["session_id"] == "s1"
        assert a.prune_sessions(older_than_days=0) == 0  # not ended: kept
    assert _public(app_db) == before
    assert {"sessions", "messages", "hermes_alembic_version"} <= _tables(app_db, "hermes_a")
    assert "alembic_version" not in _tables(app_db, "hermes_a")
    assert {"sessions", "messages", "alembic_version"} <= _tables(app_db, "hermes_b")
    with SessionDB(url, schema="hermes_a", version_table="hermes_alembic_version") as again:
        assert again.get_session("s1")["input_tokens"] == 7  # type: ignore[index]


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_callers_engine_and_the_async_store_write_in_their_schema(app_db: URL) -> None:
    """A caller's Engine with ``schema=``, and ``AsyncSessionDB(url, schema=)`` (whose sync
    store is handed its engine's twin), wrote into ``public``: the placement was put only on
    engines the store made from a URL. The caller's Engine itself stays in ``public``."""
    before = _public(app_db)
    url = url_string(app_db)
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with SessionDB(engine, schema="hermes_a") as db:
            db.create_session("engine-s", "cli")
            db.append_message("engine-s", "user", "the okapi hides in schema a")
            with db.transaction():
                db.update_token_counts("engine-s", input_tokens=3)
            assert [h["session_id"] for h in db.search_messages("okapi")] == ["engine-s"]
        with engine.connect() as conn:  # the caller's own statements: still public's table
            assert conn.exec_driver_sql("SELECT who FROM sessions").scalars().all() == ["app user"]
    finally:
        engine.dispose()

    async def in_schema_b() -> list[str]:
        async with AsyncSessionDB(url, schema="hermes_b") as adb:
            await adb.create_session("async-s", "cli")
            await adb.append_message("async-s", "user", "the tapir naps in schema b")
            async with adb.transaction():
                await adb.update_token_counts("async-s", output_tokens=4)
            return [h["session_id"] for h in await adb.search_messages("tapir")]

    assert asyncio.run(in_schema_b()) == ["async-s"]
    assert _public(app_db) == before
    with SessionDB(url, schema="hermes_a") as a, SessionDB(url, schema="hermes_b") as b:
        assert [s["id"] for s in a.list_sessions_rich()] == ["engine-s"]
        assert a.get_session("engine-s")["input_tokens"] == 3  # type: ignore[index]
        assert [s["id"] for s in b.list_sessions_rich()] == ["async-s"]
        assert b.get_session("async-s")["output_tokens"] == 4  # type: ignore[index]


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_connection_lost_as_a_placed_transaction_begins_is_the_stores_error(
    app_db: URL,
) -> None:
    """The server ends the connection right after the pool handed it out (a restart or a
    failover racing a checkout): the placement's ``SET LOCAL search_path`` meets it first, in
    a hook SQLAlchemy runs outside its error handling, and the raw psycopg error escaped every
    write of a store with a schema (without one: WriteNotLandedError). Now it is the same."""
    admin = _admin(app_db)
    armed: list[bool] = []
    with SessionDB(url_string(app_db), schema="hermes_a") as db:
        db.create_session("s", "cli")

        @sa.event.listens_for(db.engine, "checkout")
        def _kill(dbapi_connection: Any, record: Any, proxy: Any) -> None:
            if armed:
                armed.clear()
                with admin.connect() as conn:
                    conn.exec_driver_sql(
                        "SELECT pg_terminate_backend(%s)", (dbapi_connection.info.backend_pid,)
                    )

        writes: list[Callable[[], object]] = [
            lambda: db.append_messages("s", [{"role": "user", "content": "lost"}]),
            lambda: db.clear_messages("s"),
            db.transaction().__enter__,
        ]
        for write in writes:
            armed.append(True)
            with pytest.raises(WriteNotLandedError):
                write()
            assert db.uow.current() is None  # nothing left open
        db.append_message("s", "user", "after")  # the pool gave the dead connection up
        assert [m["content"] for m in db.get_messages("s")] == ["after"]
    admin.dispose()


@pytest.mark.parametrize("backend", SERVERS)
def test_alembic_upgrade_and_downgrade_with_x_schema(app_db: URL) -> None:
    before = _public(app_db)
    config = migrate.alembic_config()
    config.cmd_opts = argparse.Namespace(
        x=[f"url={url_string(app_db)}", "schema=hermes_x", "version_table=hermes_v"]
    )
    command.upgrade(config, "head")
    assert {"sessions", "messages", "hermes_v"} <= _tables(app_db, "hermes_x")
    with SessionDB(
        url_string(app_db), schema="hermes_x", version_table="hermes_v", migrate="check"
    ) as db:
        db.create_session("s", "cli")
        assert db.session_count() == 1
    command.downgrade(config, "base")
    assert _tables(app_db, "hermes_x") <= {"hermes_v"}
    assert _public(app_db) == before


@pytest.mark.parametrize("backend", ["postgresql"])
def test_the_environment_places_the_store(app_db: URL, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERMES_STORE_SCHEMA", "hermes_b")
    with SessionDB(url_string(app_db)) as db:
        assert db.placement == Placement("hermes_b")
        db.create_session("env", "cli")
    assert "sessions" in _tables(app_db, "hermes_b")
    monkeypatch.delenv("HERMES_STORE_SCHEMA")
    with SessionDB(url_string(app_db), schema="hermes_b") as db:
        assert db.get_session("env") is not None


def test_sqlite_refuses_a_schema_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with pytest.raises(InvalidInputError, match="needs PostgreSQL"):
        SessionDB(path, schema="hermes")
    assert not path.exists()


def test_sqlite_takes_another_version_table(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path, version_table="hermes_v") as db:
        db.create_session("s", "cli")
        assert db.check_search_index()
    engine = sa.create_engine(f"sqlite:///{path}", poolclass=NullPool)
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
        revision = conn.exec_driver_sql("SELECT version_num FROM hermes_v").scalar()
    engine.dispose()
    assert "hermes_v" in tables and "alembic_version" not in tables
    assert revision == migrate.head_revision()
    with SessionDB(path, version_table="hermes_v", migrate="check") as db:
        assert db.get_session("s") is not None


@pytest.mark.parametrize(
    ("schema", "version_table"),
    [("Hermes", None), ("a;drop", None), ("", None), (None, "v-1"), (None, "x" * 64)],
)
def test_names_that_are_not_plain_identifiers_are_refused(
    tmp_path: Path, schema: str | None, version_table: str | None
) -> None:
    with pytest.raises(InvalidInputError):
        SessionDB(tmp_path / "state.db", schema=schema, version_table=version_table)
    assert not (tmp_path / "state.db").exists()


@pytest.mark.parametrize("backend", ["postgresql"])
def test_the_command_line_takes_schema_and_version_table(app_db: URL) -> None:
    from click.testing import CliRunner

    from hermes_store.cli import cli

    before = _public(app_db)
    runner = CliRunner()
    where = ["--db", url_string(app_db), "--schema", "hermes_a", "--version-table", "hermes_v"]
    upgraded = runner.invoke(cli, [*where, "db", "upgrade"])
    assert upgraded.exit_code == 0, upgraded.output
    assert {"sessions", "hermes_v"} <= _tables(app_db, "hermes_a")
    doctor = runner.invoke(cli, [*where, "doctor"])
    assert doctor.exit_code == 0, doctor.output
    listed = runner.invoke(cli, [*where, "sessions", "list"])
    assert listed.exit_code == 0, listed.output
    assert _public(app_db) == before
    bad = runner.invoke(cli, ["--db", url_string(app_db), "--schema", "No;Way", "stats"])
    assert bad.exit_code == 2 and "schema must be" in bad.output


def test_the_command_line_refuses_a_schema_on_sqlite(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hermes_store.cli import cli

    path = tmp_path / "state.db"
    result = CliRunner().invoke(cli, ["--db", str(path), "--schema", "hermes", "db", "upgrade"])
    assert result.exit_code == 1 and "needs PostgreSQL" in result.output
    assert result.output.count("\n") == 1 and not path.exists()


@pytest.mark.parametrize("backend", ["postgresql"])
def test_offline_sql_places_the_tables_too(app_db: URL) -> None:
    import io

    before = _public(app_db)
    buffer = io.StringIO()
    config = migrate.alembic_config()
    config.output_buffer = buffer
    config.cmd_opts = argparse.Namespace(
        x=[f"url={url_string(app_db)}", "schema=hermes_x", "version_table=hermes_v"]
    )
    command.upgrade(config, "head", sql=True)
    script = buffer.getvalue()
    assert 'CREATE SCHEMA IF NOT EXISTS "hermes_x"' in script
    engine = create_engine(
        app_db, poolclass=NullPool, placement=Placement(), isolation_level="AUTOCOMMIT"
    )
    with engine.connect() as conn:
        conn.connection.driver_connection.execute(script)  # type: ignore[union-attr]
    engine.dispose()
    assert {"sessions", "messages", "hermes_v"} <= _tables(app_db, "hermes_x")
    assert _public(app_db) == before
    with SessionDB(
        url_string(app_db), schema="hermes_x", version_table="hermes_v", migrate="check"
    ) as db:
        db.create_session("s", "cli")
        db.append_message("s", "user", "offline okapi")
        assert [h["session_id"] for h in db.search_messages("okapi")] == ["s"]
