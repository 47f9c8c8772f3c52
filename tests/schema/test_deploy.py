"""Deploying migrations: offline SQL, the packaged config, and revisions that never change.

- ``alembic upgrade head --sql`` prints DDL that, applied to an empty database, builds the same
  schema as the online upgrade, on SQLite and PostgreSQL.
- Each released revision's SQL is pinned in ``tests/schema/revisions/``: editing a revision, or a
  helper it calls, fails here. A new revision adds its files with ``HERMES_STORE_PIN_REVISIONS=1``.
- The packaged ``alembic.ini`` and ``python -m hermes_store.migrations`` work from any folder, and
  a minimal hand-written ini works too.
"""

from __future__ import annotations

import io
import os
import sqlite3
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store.schema import migrate
from hermes_store.schema.revisions import script_location
from tests.support.backends import PG_ENV, reset_pg, url_string
from tests.support.migration_checks import HEAD, REVISIONS

PINNED = Path(__file__).resolve().parent / "revisions"
#: Offline SQL is emitted for a URL's dialect only; nothing connects to these.
OFFLINE_URLS = {
    "sqlite": "sqlite:////nonexistent/offline.db",
    "postgresql": "postgresql+psycopg://offline@127.0.0.1:1/offline",
}


def offline_sql(url: str, revisions: str) -> str:
    """What ``alembic -x url=URL upgrade REVISIONS --sql`` prints."""
    out = io.StringIO()
    config = Config(output_buffer=out, cmd_opts=Namespace(x=[f"url={url}"]))
    config.set_main_option("script_location", script_location())
    command.upgrade(config, revisions, sql=True)
    return out.getvalue()


def _sqlite_schema(path: Path) -> list[tuple[str, str, str, str]]:
    """Every object's SQL, whitespace collapsed (offline SQL indents with spaces, online tabs)."""
    raw = sqlite3.connect(path)
    try:
        rows = raw.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE sql IS NOT NULL"
        ).fetchall()
    finally:
        raw.close()
    return sorted((kind, name, table, " ".join(sql.split())) for kind, name, table, sql in rows)


def _pg_schema(url: URL) -> dict[str, list[tuple[object, ...]]]:
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            columns = conn.execute(
                sa.text(
                    "SELECT table_name, column_name, data_type, is_nullable, column_default, "
                    "is_generated, generation_expression FROM information_schema.columns "
                    "WHERE table_schema = 'public' ORDER BY 1, 2"
                )
            ).all()
            indexes = conn.execute(
                sa.text(
                    "SELECT indexname, indexdef FROM pg_indexes "
                    "WHERE schemaname = 'public' ORDER BY 1"
                )
            ).all()
            constraints = conn.execute(
                sa.text(
                    "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                    "WHERE connamespace = 'public'::regnamespace ORDER BY 1"
                )
            ).all()
            rows = conn.execute(sa.text("SELECT version FROM schema_version")).all()
    finally:
        engine.dispose()
    return {
        "columns": [tuple(r) for r in columns],
        "indexes": [tuple(r) for r in indexes],
        "constraints": [tuple(r) for r in constraints],
        "schema_version": [tuple(r) for r in rows],
    }


def test_offline_sqlite_sql_builds_the_online_schema(tmp_path: Path) -> None:
    sql = offline_sql(OFFLINE_URLS["sqlite"], "head")
    offline = tmp_path / "offline.db"
    raw = sqlite3.connect(offline)
    raw.executescript(sql)
    raw.close()
    online = tmp_path / "online.db"
    assert migrate.upgrade(online) == HEAD
    assert _sqlite_schema(offline) == _sqlite_schema(online)
    assert migrate.current(offline) == HEAD


def test_offline_postgresql_sql_builds_the_online_schema(pg_worker_url: URL | None) -> None:
    if pg_worker_url is None:
        pytest.skip(f"PostgreSQL tests need {PG_ENV}")
    pg_url = pg_worker_url
    reset_pg(pg_url)
    sql = offline_sql(OFFLINE_URLS["postgresql"], "head")
    engine = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(sql)
        offline = _pg_schema(pg_url)
        with engine.connect() as conn:
            conn.exec_driver_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    finally:
        engine.dispose()
    assert migrate.upgrade(pg_url) == HEAD
    assert _pg_schema(pg_url) == offline


def test_offline_sql_from_a_stated_revision(tmp_path: Path) -> None:
    """``upgrade v3_session_title:head --sql`` brings a v3 database to head."""
    path = tmp_path / "state.db"
    migrate.upgrade(path, "v3_session_title")
    raw = sqlite3.connect(path)
    raw.executescript(offline_sql(OFFLINE_URLS["sqlite"], "v3_session_title:head"))
    raw.close()
    reference = tmp_path / "reference.db"
    migrate.upgrade(reference)
    assert _sqlite_schema(path) == _sqlite_schema(reference)


@pytest.mark.parametrize("dialect", sorted(OFFLINE_URLS))
@pytest.mark.parametrize("revision", REVISIONS)
def test_released_revisions_never_change(dialect: str, revision: str) -> None:
    """The SQL each revision emits (offline, fixed capabilities) is pinned."""
    previous = REVISIONS.index(revision) - 1
    span = f"{REVISIONS[previous]}:{revision}" if previous >= 0 else revision
    sql = offline_sql(OFFLINE_URLS[dialect], span)
    pinned = PINNED / f"{revision}.{dialect}.sql"
    if os.environ.get("HERMES_STORE_PIN_REVISIONS") == "1" and not pinned.exists():
        pinned.parent.mkdir(exist_ok=True)
        pinned.write_text(sql, encoding="utf-8")
    assert pinned.exists(), f"{pinned.name} is missing: pin a new revision once"
    assert sql == pinned.read_text(encoding="utf-8"), f"released revision {revision} changed"


def _run(
    argv: list[str], cwd: Path, env_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HERMES_STORE_URL"}
    env["HERMES_HOME"] = str(cwd / "home")
    if env_url is not None:
        env["HERMES_STORE_URL"] = env_url
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_packaged_config_works_from_any_folder(tmp_path: Path) -> None:
    ini = _run([sys.executable, "-m", "hermes_store.migrations", "--ini"], tmp_path)
    assert ini.returncode == 0, ini.stderr
    packaged = Path(ini.stdout.strip())
    assert packaged.is_file() and packaged.parent == Path(script_location())
    alembic = Path(sys.executable).with_name("alembic")
    target = tmp_path / "by-alembic.db"
    up = _run(
        [str(alembic), "-c", str(packaged), "-x", f"url={target}", "upgrade", "head"], tmp_path
    )
    assert up.returncode == 0, up.stderr
    assert migrate.current(target) == HEAD
    other = tmp_path / "by-module.db"
    up = _run([sys.executable, "-m", "hermes_store.migrations", "upgrade", "head"], tmp_path,
              env_url=url_string(URL.create("sqlite", database=str(other))))  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert migrate.current(other) == HEAD
    assert not (tmp_path / "home").exists()


def test_a_minimal_hand_written_ini_works(tmp_path: Path) -> None:
    ini = tmp_path / "alembic.ini"
    ini.write_text(f"[alembic]\nscript_location = {script_location()}\n", encoding="utf-8")
    alembic = Path(sys.executable).with_name("alembic")
    target = tmp_path / "state.db"
    up = _run([str(alembic), "-c", str(ini), "-x", f"url={target}", "upgrade", "head"], tmp_path)
    assert up.returncode == 0, up.stderr
    assert migrate.current(target) == HEAD
    sql = _run([str(alembic), "-c", str(ini), "upgrade", "head", "--sql"], tmp_path)
    assert sql.returncode == 0, sql.stderr
    assert "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts" in sql.stdout
    assert not (tmp_path / "home").exists()  # offline: the default database was not touched


def test_the_runtime_ddl_matches_the_revisions() -> None:
    """``ddl.py`` (adoption, repair, rebuild at run time) builds exactly what the revisions
    built: the revisions' own SQL contains the runtime statements verbatim."""
    from hermes_store.schema import ddl

    sqlite = offline_sql(OFFLINE_URLS["sqlite"], "head")
    for statement in (
        ddl.SQLITE_FTS_TABLE,
        *ddl.SQLITE_FTS_TRIGGERS,
        ddl.SQLITE_CJK_TABLE,
        *ddl.SQLITE_CJK_TRIGGERS,
    ):
        assert statement in sqlite, statement[:60]
    # The runtime rebuild selects by the revision triggers' own condition (the revision's
    # rebuild said its GLOB alone: the same rows, the length test only skips ASCII text fast).
    rebuild, condition = ddl.SQLITE_CJK_REBUILD[1].split(" WHERE ")
    assert f"{rebuild} WHERE content GLOB '{ddl.CJK_GLOB}'" in sqlite
    assert condition == ddl.cjk_matches("content")
    assert ddl.CJK_NEW_MATCHES in sqlite
    postgresql = offline_sql(OFFLINE_URLS["postgresql"], "head")
    for statement in (
        ddl.PG_FTS_COLUMN_CREATE,
        ddl.PG_FTS_CREATE,
        ddl.PG_TRGM_CREATE,
        ddl.PG_CHUNK_TABLE_CREATE,
        ddl.PG_CHUNK_INDEX_CREATE,
        ddl.PG_CHUNK_CUT_CREATE,
        ddl.PG_CHUNK_FILL_CREATE,
        ddl.PG_CHUNK_SYNC_CREATE,
        *ddl.PG_CHUNK_TRIGGERS_CREATE,
        ddl.PG_CHUNK_FILL_ALL,
    ):
        assert statement in postgresql, statement[:60]
