"""Opening a database at head loads no migration machinery, in a fresh interpreter.

A process that opens its ``state.db`` and reads once (an agent's command, a CLI read) pays for
every module it imports: at head the open-time check compares the version table with the head
revision id known as a constant (:data:`hermes_store.schema.revisions.HEAD`), so neither Alembic
nor the revision scripts nor the ORM load. The constants are held equal to the script directory
here, and a database behind head shows that the probe does see Alembic when it loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.schema import migrate, revisions
from tests.support.backends import url_string

ROOT = Path(__file__).resolve().parents[2]
#: Modules an open at head must not import: Alembic (and its Mako templates), the shared
#: steps of the revisions, the revisions' package, and the ORM (the store runs Core only).
MACHINERY = ("alembic", "mako", "hermes_store.schema.steps", "hermes_store.migrations")
ORM = ("sqlalchemy.orm", "hermes_store.models")
#: A SQLite process has no use for PostgreSQL's dialect (16-29 ms to import).
POSTGRESQL = ("sqlalchemy.dialects.postgresql", "psycopg")

#: Opens argv[1] with migrate=argv[2], reads a session, prints what it read and what loaded.
OPEN_AND_READ = """
import json, sys
from hermes_store import SessionDB
with SessionDB(sys.argv[1], migrate=sys.argv[2]) as store:
    row = store.get_session("s1")
print(json.dumps({"title": row and row["title"], "modules": sorted(sys.modules)}))
"""
#: Runs the CLI with argv[1:] and prints the modules it loaded once it has exited.
CLI_THEN_MODULES = """
import atexit, json, sys
atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))
sys.argv = ["hermes-store", *sys.argv[1:]]
from hermes_store.cli import main
main()
"""


def fresh_python(code: str, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a new interpreter importing this checkout's hermes_store."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HERMES_HOME": str(home)}
    env.pop("HERMES_STORE_URL", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def loaded(modules: list[str], watched: tuple[str, ...]) -> list[str]:
    """The watched modules (or their submodules) among ``modules``."""
    return [m for m in modules if any(m == w or m.startswith(f"{w}.") for w in watched)]


def open_and_read(url: URL, migrate_mode: str, home: Path) -> dict[str, object]:
    done = fresh_python(OPEN_AND_READ, url_string(url), migrate_mode, home=home)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def with_a_session(url: URL) -> None:
    with SessionDB(url_string(url)) as store:
        store.create_session("s1", "cli")
        store.set_session_title("s1", "cold")


def test_revision_ids_are_the_script_directory() -> None:
    """The constants the open-time check uses are the scripts' own chain and head."""
    scripts = ScriptDirectory(revisions.script_location())
    assert scripts.get_heads() == [revisions.HEAD]
    chain = [s.revision for s in reversed(list(scripts.walk_revisions()))]
    assert chain == list(revisions.REVISIONS)
    assert [scripts.get_revision(r).down_revision for r in revisions.REVISIONS] == [
        None,
        *revisions.REVISIONS[:-1],
    ]
    assert revisions.up_to("v2_finish_reason") == ("v1_base", "v2_finish_reason")
    assert revisions.up_to("no_such_revision") == ()
    assert revisions.for_version(7) is None
    assert migrate.head_revision() == revisions.HEAD


@pytest.mark.parametrize("mode", ["auto", "check"])
def test_open_at_head_and_read_loads_no_migration_machinery(
    db_url: URL, mode: str, tmp_path: Path
) -> None:
    with_a_session(db_url)
    result = open_and_read(db_url, mode, tmp_path)
    assert result["title"] == "cold"
    modules = result["modules"]
    assert isinstance(modules, list)
    assert loaded(modules, MACHINERY) == []
    assert loaded(modules, ORM) == []
    if db_url.get_backend_name() == "sqlite":
        assert loaded(modules, POSTGRESQL) == []


def test_cli_read_command_loads_no_migration_machinery(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with_a_session(URL.create("sqlite", database=str(path)))
    done = fresh_python(CLI_THEN_MODULES, "--db", str(path), "sessions", "list", home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "cold" in done.stdout
    modules = json.loads(done.stderr.strip().splitlines()[-1])
    assert loaded(modules, MACHINERY) == []
    assert loaded(modules, ORM) == []
    assert loaded(modules, POSTGRESQL) == []


def test_the_title_index_is_partial_on_both_backends() -> None:
    """Its PostgreSQL ``WHERE`` is attached when PostgreSQL's options are read, not at import
    (which kept that dialect out of SQLite processes): the DDL of both still has it."""
    from sqlalchemy.dialects import postgresql, sqlite
    from sqlalchemy.schema import CreateIndex

    from hermes_store.tables import sessions_table

    index = next(i for i in sessions_table.indexes if i.name == "idx_sessions_title_unique")
    for dialect in (sqlite.dialect(), postgresql.dialect()):
        ddl = str(CreateIndex(index).compile(dialect=dialect))
        assert ddl.endswith("ON sessions (title) WHERE title IS NOT NULL"), ddl
        assert "UNIQUE" in ddl


def test_opening_behind_head_migrates_through_alembic(tmp_path: Path) -> None:
    """The probe's control: a database at an older revision is brought to head, and that
    does load Alembic."""
    url = URL.create("sqlite", database=str(tmp_path / "state.db"))
    migrate.upgrade(url, "v5_billing_columns")
    result = open_and_read(url, "auto", tmp_path)
    assert result["title"] is None  # no such session: the file was empty
    modules = result["modules"]
    assert isinstance(modules, list)
    assert "alembic" in modules
    assert migrate.current(url) == revisions.HEAD
