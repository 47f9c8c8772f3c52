"""Exit codes and wording a new user meets: the exit code table holds, and every message
speaks the command line's language (options, not Python arguments)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.cli import cli
from tests.support import legacy
from tests.support.backends import url_string
from tests.support.read_only import archived_database, read_only_folder


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1", "HERMES_STORE_URL": None})


def run(runner: CliRunner, db: str | Path, *args: str) -> Result:
    return runner.invoke(cli, ["--db", str(db), *args])


def error_line(result: Result, code: int) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def test_doctor_on_an_unreachable_server_exits_3(runner: CliRunner) -> None:
    line = error_line(run(runner, "postgresql://127.0.0.1:1/nowhere", "doctor"), 3)
    assert "cannot reach the database" in line


def test_a_non_numeric_port_is_a_usage_error_in_words(runner: CliRunner) -> None:
    line = error_line(run(runner, "postgresql://u:secret@db.example:abc/x", "stats"), 2)
    assert "port must be a number" in line
    assert "int()" not in line and "secret" not in line


def test_a_missing_database_is_not_an_unreachable_server(runner: CliRunner, pg_url: URL) -> None:
    missing = pg_url.set(database=f"{pg_url.database}_missing")
    line = error_line(run(runner, url_string(missing), "stats"), 3)
    assert "cannot reach" not in line
    assert "refused the connection" in line and "does not exist" in line


def test_cli_messages_name_options_not_python_arguments(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("s1", "cli")
    taken = tmp_path / "taken.db"
    taken.write_bytes(b"")
    line = error_line(run(runner, path, "backup", str(taken)), 1)
    assert "--force" in line and "overwrite=" not in line
    old = tmp_path / "v3.db"
    legacy.build_legacy_db(old, 3)
    line = error_line(run(runner, old, "sessions", "list"), 3)
    assert "hermes-store db upgrade" in line and "migrate=" not in line


def test_db_current_reports_a_newer_releases_file(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path):
        pass
    with sqlite3.connect(path) as con:
        con.execute("UPDATE alembic_version SET version_num = 'z9_from_the_future'")
        con.execute("UPDATE schema_version SET version = 9")
    human = run(runner, path, "db", "current")
    assert human.exit_code == 0, human.stderr
    assert "z9_from_the_future" in human.stdout and "newer hermes_store" in human.stdout
    report = json.loads(run(runner, path, "db", "current", "--json").stdout)
    assert report["too_new"] is True and report["schema_version"] == 9
    assert report["revision"] == "z9_from_the_future" and report["at_head"] is False
    # Opening it is still refused: reporting is not adopting.
    assert run(runner, path, "stats").exit_code == 3


def _migrations(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HERMES_STORE_URL"}
    return subprocess.run(
        [sys.executable, "-m", "hermes_store.migrations", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("downgrade", "head:base", "--sql"),  # offline: a SQLite rebuild needs the live schema
        ("downgrade", "base"),  # online, on a file that does not exist
        ("current",),
    ],
    ids=["offline-downgrade", "downgrade-missing", "current-missing"],
)
def test_the_migrations_command_line_fails_in_one_line(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    done = _migrations(tmp_path, "-x", "url=new.db", *args)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    failed = [line for line in output.splitlines() if line.startswith("FAILED: ")]
    assert len(failed) == 1, output
    assert not (tmp_path / "new.db").exists()  # nothing left behind


def test_a_database_in_a_read_only_folder_can_be_backed_up(
    runner: CliRunner, tmp_path: Path
) -> None:
    folder = tmp_path / "ro"
    path = archived_database(folder, "s1", "kept in a read-only folder")
    target = tmp_path / "copy.db"
    with read_only_folder(folder):
        assert not os.access(folder, os.W_OK) or os.geteuid() == 0
        done = run(runner, path, "backup", str(target), "--verify")
        assert done.exit_code == 0, done.stderr
        assert "Traceback" not in done.stderr
    with SessionDB(target) as copy:
        assert copy.get_messages("s1")[0]["content"] == "kept in a read-only folder"


def _commands() -> list[tuple[str, ...]]:
    import click

    found: list[tuple[str, ...]] = []

    def walk(group: click.Group, prefix: tuple[str, ...]) -> None:
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                walk(command, (*prefix, name))
            else:
                found.append((*prefix, name))

    walk(cli, ())
    return found


@pytest.mark.parametrize("command", _commands(), ids=" ".join)
def test_every_command_has_an_example_and_an_uncut_summary(
    runner: CliRunner, command: tuple[str, ...]
) -> None:
    shown = runner.invoke(cli, [*command, "--help"])
    assert shown.exit_code == 0
    assert "Examples:" in shown.stdout and f"hermes-store {' '.join(command)}" in shown.stdout
    listing = runner.invoke(cli, [*command[:-1], "--help"]).stdout
    line = next(line for line in listing.splitlines() if line.split()[:1] == [command[-1]])
    assert not line.rstrip().endswith("..."), line


def test_db_upgrade_sql_prints_the_sql_and_connects_to_nothing(
    runner: CliRunner, tmp_path: Path
) -> None:
    missing = tmp_path / "never-created.db"
    created = run(runner, missing, "db", "upgrade", "--sql")
    assert created.exit_code == 0, created.stderr
    assert "CREATE TABLE sessions" in created.stdout and "CREATE VIRTUAL TABLE" in created.stdout
    assert not missing.exists()
    server = "postgresql://hermes@127.0.0.1:1/nowhere"  # nothing listens there
    step = run(runner, server, "db", "upgrade", "v5_billing_columns:head", "--sql")
    assert step.exit_code == 0, step.stderr
    assert "ALTER TABLE messages ADD COLUMN reasoning TEXT" in step.stdout
    assert "CREATE TABLE sessions" not in step.stdout
