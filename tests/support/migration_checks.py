"""Looking at databases from outside the package, for the migration and adoption tests.

Everything here reads with plain SQLAlchemy or stdlib ``sqlite3`` (never through
``hermes_store``'s own engine), so the tests do not check the package against itself.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import NullPool

from hermes_store.engine.factory import sqlite_file
from hermes_store.schema import ddl
from tests.support import legacy
from tests.support.backends import is_sqlite

REPO = Path(__file__).resolve().parents[2]
#: The revisions matching the original's schema_version 1..6, then hermes_store's own (which keep
#: schema_version at 6, so the original store still opens the file).
SEED_REVISIONS = (
    "v1_base",
    "v2_finish_reason",
    "v3_session_title",
    "v4_title_unique_index",
    "v5_billing_columns",
    "v6_reasoning_columns",
)
REVISIONS = (
    *SEED_REVISIONS,
    "h7_cjk_index",
    "h8_pg_bigint_counters",
    "h9_write_keys",
    "h10_pg_long_text",
)
V6 = SEED_REVISIONS[-1]
HEAD = REVISIONS[-1]
CJK_OBJECTS = {"messages_cjk", "messages_cjk_delete", "messages_cjk_insert", "messages_cjk_update"}
TABLES = ("sessions", "messages")
FTS_TRIGGERS = ["messages_fts_delete", "messages_fts_insert", "messages_fts_update"]


def typed(value: Any) -> tuple[str, Any]:
    """(storage class as SQLite's typeof() names it, value): tells 0 from 0.0."""
    kinds = {type(None): "null", int: "integer", float: "real", str: "text"}
    return kinds[type(value)], value


def plain_engine(url: URL) -> Engine:
    """An engine without the package's hooks, for looking at a database from outside."""
    return sa.create_engine(url, poolclass=NullPool)


def sqlite_path(url: URL) -> Path:
    path = sqlite_file(url)
    assert path is not None
    return path


def observed(url: URL) -> dict[str, list[dict[str, tuple[str, Any]]]]:
    """Every row of sessions and messages, ordered by id, each value typed."""
    if is_sqlite(url):
        return legacy.dump_rows(sqlite_path(url), typed=True)
    engine = plain_engine(url)
    try:
        with engine.connect() as conn:
            out: dict[str, list[dict[str, tuple[str, Any]]]] = {}
            for table in TABLES:
                rows = conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY id")).mappings()
                out[table] = [
                    {k: typed(v) for k, v in row.items() if k not in ddl.UNMODELLED_COLUMNS}
                    for row in rows
                ]
            return out
    finally:
        engine.dispose()


def scalar(url: URL, sql: str) -> Any:
    engine = plain_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar()
    finally:
        engine.dispose()


def schema_version(url: URL) -> int:
    return int(scalar(url, "SELECT version FROM schema_version"))


def alembic_revision(url: URL) -> str | None:
    return scalar(url, "SELECT version_num FROM alembic_version")  # type: ignore[no-any-return]


def table_names(url: URL) -> set[str]:
    engine = plain_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def full_text_ids(url: URL, word: str) -> list[int]:
    """Ids of messages the backend's full-text search finds for ``word``."""
    if is_sqlite(url):
        sql = "SELECT rowid FROM messages_fts WHERE messages_fts MATCH :q ORDER BY rowid"
    else:
        sql = (
            "SELECT id FROM messages WHERE to_tsvector('simple'::regconfig, "
            "COALESCE(content, '')) @@ plainto_tsquery('simple', :q) ORDER BY id"
        )
    engine = plain_engine(url)
    try:
        with engine.connect() as conn:
            return [int(i) for i in conn.execute(sa.text(sql), {"q": word}).scalars()]
    finally:
        engine.dispose()


def fts_integrity_check(path: Path) -> None:
    """FTS5's own check that the index matches the messages table (raises when it does not)."""
    con = sqlite3.connect(path)
    try:
        con.execute("INSERT INTO messages_fts(messages_fts) VALUES('integrity-check')")
        con.commit()
    finally:
        con.close()


def file_state(path: Path) -> tuple[str, list[str]]:
    """(SHA-256 of the file, names of the files beside it): what must not change on refusal."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest, sorted(p.name for p in path.parent.iterdir())


def alembic_cli(
    *args: str, env_url: str | None, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """``alembic ARGS`` run from the repo root, as a developer would; the default database
    ($HERMES_HOME/state.db) points into ``tmp_path`` so a stray default touches nothing."""
    script = Path(sys.executable).with_name("alembic")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "alembic"]
    env = {k: v for k, v in os.environ.items() if k != "HERMES_STORE_URL"}
    env["HERMES_HOME"] = str(tmp_path / "hermes_home")
    if env_url is not None:
        env["HERMES_STORE_URL"] = env_url
    return subprocess.run(
        [*argv, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def cjk_objects(path: Path) -> set[str]:
    """Names of the CJK trigram table and its triggers in a SQLite file (not its shadows)."""
    con = sqlite3.connect(path)
    try:
        rows = con.execute(
            "SELECT name FROM sqlite_master WHERE name LIKE 'messages_cjk%' AND name NOT IN"
            " (SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'messages_cjk_%')"
        ).fetchall()
    finally:
        con.close()
    return {name for (name,) in rows}


def cjk_index_ids(path: Path) -> list[int]:
    """The message ids the CJK trigram index holds (one _docsize row per indexed message)."""
    con = sqlite3.connect(path)
    try:
        return [i for (i,) in con.execute("SELECT id FROM messages_cjk_docsize ORDER BY id")]
    finally:
        con.close()
