"""The command line as a new user meets it: pipes, narrow terminals, confirmations, one-line
errors, repeated options and a light start.

Pipes and terminals are real where it matters (subprocesses with a pipe or a pty); the rest
runs through click's CliRunner, whose streams are not terminals (so ``--format table`` is
asked for explicitly where the terminal table is under test).
"""

from __future__ import annotations

import csv
import io
import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.models import sessions_table as S
from tests.support.backends import url_string

ROOT = Path(__file__).resolve().parents[2]
TITLE = "Discord moderation policy for the weekend raid team"
BIG = "b1900000-0000-4000-8000-000000000001"
PARENT = "a0000000-0000-4000-8000-00000000000a"
DAY = 86400.0
TIMEOUT = 120  # a hang guard only


def populate(path: Path | str) -> None:
    """14 sessions in three sources, one with a long title and seven-digit counters, a parent
    with a child and a system prompt, and CJK titles; all ended, started 10 days ago."""
    with SessionDB(path) as db:
        db.create_session(PARENT, "cli", model="m", system_prompt="You are Hermes. Be brief.")
        db.set_session_title(PARENT, "Parent plan")
        db.create_session(
            BIG, "discord", model="anthropic/claude-sonnet-4.5", parent_session_id=None
        )
        db.set_session_title(BIG, TITLE)
        db.append_message(BIG, "user", "ban the spammer\twith a tab")
        db.update_token_counts(
            BIG, input_tokens=1834567, output_tokens=2345678, estimated_cost_usd=2345.6789
        )
        for n in range(4):
            db.create_session(f"child-{n}", "cli", parent_session_id=PARENT if n == 0 else None)
            db.set_session_title(f"child-{n}", f"数据库迁移 {n}" if n else "Child step")
        for n in range(8):
            db.create_session(f"tg-{n}", "telegram")
        for session_id in (
            [PARENT, BIG] + [f"child-{n}" for n in range(4)] + [f"tg-{n}" for n in range(8)]
        ):
            db.end_session(session_id, "user_exit")
        old = time.time() - 10 * DAY
        db.uow.run(lambda conn: conn.execute(sa.update(S).values(started_at=old)))


@pytest.fixture
def path(tmp_path: Path) -> Path:
    target = tmp_path / "state.db"
    populate(target)
    return target


@pytest.fixture
def any_db(db_url: URL) -> str:
    """The same sessions on a SQLite file and on PostgreSQL (as a URL string)."""
    target = url_string(db_url)
    populate(target)
    return target


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1", "HERMES_STORE_URL": None})


def run(runner: CliRunner, path: Path | str, *args: str, **kwargs: Any) -> Result:
    return runner.invoke(cli, ["--db", str(path), *args], catch_exceptions=False, **kwargs)


def session_count(path: Path | str) -> int:
    with SessionDB(path) as db:
        return db.session_count()


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "COLUMNS")}
    return {**base, "NO_COLOR": "1", **extra}


def cli_process(
    *args: str, code: str | None = None, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``python -m hermes_store ARGS`` with pipes for stdin, stdout and stderr; ``code`` runs
    before the CLI in the same interpreter (to make a module unimportable)."""
    prelude = (code or "") + "\nimport sys\nfrom hermes_store.cli import main\n"
    argv = [sys.executable, "-c", prelude + "sys.argv[0] = 'hermes-store'\nmain()", *args]
    kwargs.setdefault("env", env())
    kwargs.setdefault("errors", "replace")  # a latin-1 child writes bytes UTF-8 cannot read
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL, **kwargs
    )


def one_line(done: subprocess.CompletedProcess[str] | Result, code: int) -> str:
    returncode = (
        done.returncode if isinstance(done, subprocess.CompletedProcess) else done.exit_code
    )
    assert returncode == code, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


# -- pipes: whole values -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_piped_list_is_tab_separated_with_whole_values(path: Path) -> None:
    done = cli_process("--db", str(path), "sessions", "list", env=env(COLUMNS="80"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = lines[0].split("\t")
    rows = [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]
    big = next(row for row in rows if row["id"] == BIG)  # the whole id
    assert big["title"] == TITLE
    assert big["input_tokens"] == "1834567" and big["output_tokens"] == "2345678"
    assert big["estimated_cost_usd"] == "2345.6789"
    assert [line for line in lines if "Discord moderation" in line] == [
        lines[lines.index(next(line for line in lines if line.startswith(BIG)))]
    ]
    assert big["preview"] == "ban the spammer\\twith a tab"  # escaped: one row stays one line


def test_every_list_command_pipes_tsv_and_csv(runner: CliRunner, path: Path) -> None:
    for args in (
        ("sessions", "list"),
        ("search", "spammer"),
        ("stats",),
        ("db", "history"),
        ("sessions", "prune", "--older-than", "1", "--dry-run"),
    ):
        piped = run(runner, path, *args)
        assert piped.exit_code == 0, piped.output
        lines = piped.stdout.splitlines()
        width = len(lines[0].split("\t"))
        assert width > 1 and all(len(line.split("\t")) == width for line in lines), args
        assert "…" not in piped.stdout
        as_csv = run(runner, path, *args, "--format", "csv")
        parsed = list(csv.reader(io.StringIO(as_csv.stdout)))
        assert parsed[0] == lines[0].split("\t") and len(parsed) == len(lines), args
    stats = run(runner, path, "stats").stdout
    model = next(line for line in stats.splitlines() if "claude-sonnet" in line).split("\t")
    assert model[:2] == ["model", "anthropic/claude-sonnet-4.5"] and "1834567" in model
    hit = run(runner, path, "search", "spammer").stdout.splitlines()[1].split("\t")
    assert hit[1] == BIG and ">>>" not in hit[-1] and "spammer" in hit[-1]


def test_json_alias_and_conflicting_formats(runner: CliRunner, path: Path) -> None:
    by_alias = run(runner, path, "sessions", "list", "--json")
    by_format = run(runner, path, "sessions", "list", "--format", "json")
    assert json.loads(by_alias.stdout) == json.loads(by_format.stdout)
    assert len(json.loads(by_alias.stdout)) == 13  # the child is left out
    assert run(runner, path, "sessions", "list", "--json", "--format", "csv").exit_code == 2
    assert run(runner, path, "doctor", "--format", "tsv").stdout.startswith("check\tstatus\tdetail")


# -- terminal tables -----------------------------------------------------------------------------


@pytest.mark.parametrize("columns", ["80", "60"])
def test_terminal_table_never_cuts_numbers_and_wraps_titles_at_words(
    path: Path, columns: str
) -> None:
    runner = CliRunner(env={"COLUMNS": columns, "NO_COLOR": "1", "HERMES_STORE_URL": None})
    table = run(runner, path, "sessions", "list", "--format", "table").stdout
    assert "1,834,567/2,345,678" in table and "~$2345.6789" in table
    assert "…" not in table
    words = " ".join(table.split())
    for word in TITLE.split():
        assert f" {word} " in f" {words} ", word  # each word whole, never split across lines
    assert "left out for width" in table  # said, not silently dropped
    stats = run(runner, path, "stats", "--format", "table").stdout
    assert "1,834,567" in stats and "2,345,678" in stats and "$2345.6789" in stats
    assert "…" not in stats


def test_cjk_titles_wrap_inside_their_column() -> None:
    from hermes_store.cli.output import cell_width, wrap

    lines = wrap("数据库迁移计划 and the follow-up", 10)
    assert all(cell_width(line) <= 10 for line in lines)
    assert "".join(lines).replace(" ", "") == "数据库迁移计划andthefollow-up"


# -- confirmations -------------------------------------------------------------------------------


def test_bulk_deletes_and_downgrades_refuse_without_a_terminal(
    runner: CliRunner, path: Path
) -> None:
    assert "--yes" in one_line(run(runner, path, "sessions", "prune", "--older-than", "0"), 1)
    assert session_count(path) == 14
    assert "--yes" in one_line(run(runner, path, "db", "downgrade", "base", input="y\n"), 1)
    assert session_count(path) == 14
    done = run(runner, path, "sessions", "prune", "--older-than", "0", "--yes")
    assert done.exit_code == 0 and "Deleted 14 session(s)" in done.stdout
    assert run(runner, path, "db", "downgrade", "base", "--yes").exit_code == 0


def _on_a_terminal(args: list[str], answer: bytes) -> tuple[int, str]:
    """Run the CLI with a pty as stdin (stdout/stderr piped) and type ``answer``."""
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "hermes_store", *args],
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env(),
        )
        os.close(follower)
        os.write(leader, answer)
        out, err = process.communicate(timeout=TIMEOUT)
    finally:
        os.close(leader)
    return process.returncode, (out + err).decode()


@pytest.mark.slow
def test_a_terminal_is_asked_before_a_bulk_delete(path: Path) -> None:
    code, text = _on_a_terminal(
        ["--db", str(path), "sessions", "prune", "--older-than", "0"], b"n\n"
    )
    assert code == 1 and "Delete 14 session(s)" in text and "declined" in text
    assert session_count(path) == 14
    code, text = _on_a_terminal(["--db", str(path), "sessions", "delete", "tg-0"], b"y\n")
    assert code == 0, text
    assert session_count(path) == 13


# -- one-line errors with the documented exit codes ----------------------------------------------


@pytest.mark.slow
def test_postgresql_without_the_driver_is_one_line_exit_3() -> None:
    done = cli_process(
        "--db",
        "postgresql://hermes@127.0.0.1:5432/hermes",
        "sessions",
        "list",
        code="import sys; sys.modules['psycopg'] = None",
    )
    assert "pip install 'hermes-store[postgresql]'" in one_line(done, 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mysql://u@localhost/db", "unsupported database"),
        ("oracle://u@localhost/db", "unsupported database"),
        ("postgresql://u@localhost:port/db", "port must be a number"),
        ("nosuchdialect://x/y", "unsupported database"),
    ],
)
def test_bad_database_urls_are_one_line_exit_2(url: str, words: str) -> None:
    assert words in one_line(cli_process("--db", url, "stats"), 2)
    from_env = cli_process("sessions", "list", env=env(HERMES_STORE_URL=url))
    assert words in one_line(from_env, 2)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"PYTHONIOENCODING": "latin-1"}, {"LC_ALL": "C"}])
def test_a_non_utf8_terminal_gets_output_not_a_traceback(
    path: Path, tmp_path: Path, settings: dict[str, str]
) -> None:
    for args in (
        ["sessions", "list", "--format", "table"],
        ["sessions", "list"],
        ["sessions", "show", "child-1"],
        ["search", "spammer", "--format", "table"],
    ):
        done = cli_process("--db", str(path), *args, env=env(**settings))
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert any(word in done.stdout for word in ("Discord", "spammer", "child-1")), args
    exported = subprocess.run(
        [sys.executable, "-m", "hermes_store", "--db", str(path), "export", "-o", "-"],
        capture_output=True,
        timeout=TIMEOUT,
        env=env(**settings),
    )
    assert exported.returncode == 0, exported.stderr
    assert "数据库迁移 1".encode() in exported.stdout  # JSON Lines stay UTF-8


def test_import_refuses_the_database_itself(runner: CliRunner, path: Path) -> None:
    for suffix in ("", "-wal"):
        target = Path(f"{path}{suffix}")
        if target.exists():
            assert "database itself" in one_line(run(runner, path, "import", str(target)), 1)
    assert session_count(path) == 14


# -- repeated options accumulate -----------------------------------------------------------------


def test_source_given_twice_means_both(runner: CliRunner, any_db: str, tmp_path: Path) -> None:
    path = any_db
    two = ("--source", "telegram", "--source", "cli")
    stats = json.loads(run(runner, path, "stats", *two, "--json").stdout)
    assert stats["totals"]["sessions"] == 13
    assert {r["source"] for r in stats["by_source"]} == {"telegram", "cli"}
    listed = json.loads(run(runner, path, "sessions", "list", *two, "--children", "--json").stdout)
    assert len(listed) == 13 and {r["source"] for r in listed} == {"telegram", "cli"}
    limited = json.loads(
        run(runner, path, "sessions", "list", *two, "--limit", "3", "--json").stdout
    )
    assert len(limited) == 3
    out = tmp_path / "two.jsonl"
    assert run(runner, path, "export", *two, "-o", str(out)).exit_code == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 13
    dry = run(runner, path, "sessions", "prune", "--older-than", "1", *two, "--dry-run")
    assert len(dry.stdout.splitlines()) == 1 + 13 and "would delete 13" in dry.stderr
    done = run(runner, path, "sessions", "prune", "--older-than", "1", *two, "--yes")
    assert "Deleted 13 session(s)" in done.stdout
    assert session_count(path) == 1


def test_the_dry_run_lists_exactly_what_the_prune_deletes(runner: CliRunner, path: Path) -> None:
    with SessionDB(path) as db:  # one recent ended session and one old active one stay
        db.reopen_session("tg-0")
        db.uow.run(
            lambda conn: conn.execute(
                sa.update(S).where(S.c.id == "tg-1").values(started_at=time.time())
            )
        )
    dry = run(runner, path, "sessions", "prune", "--older-than", "5", "--dry-run")
    listed = {line.split("\t")[0] for line in dry.stdout.splitlines()[1:]}
    with SessionDB(path) as db:
        before = {row["id"] for row in db.search_sessions(limit=100)}
    assert run(runner, path, "sessions", "prune", "--older-than", "5", "--yes").exit_code == 0
    with SessionDB(path) as db:
        after = {row["id"] for row in db.search_sessions(limit=100)}
    assert before - after == listed and after == {"tg-0", "tg-1"}


# -- sessions show -------------------------------------------------------------------------------


def test_show_lists_parent_children_and_the_system_prompt_on_request(
    runner: CliRunner, path: Path
) -> None:
    parent = run(runner, path, "sessions", "show", PARENT).stdout
    assert "child-0 (Child step, cli)" in parent
    assert "25 chars (--system-prompt shows it)" in parent
    assert "You are Hermes." not in parent
    assert (
        "You are Hermes. Be brief."
        in run(runner, path, "sessions", "show", PARENT, "--system-prompt").stdout
    )
    child = run(runner, path, "sessions", "show", "child-0").stdout
    assert "parent" in child and f"{PARENT} (Parent plan, cli)" in child
    rows = run(runner, path, "sessions", "show", BIG, "--format", "tsv").stdout.splitlines()
    assert rows[0].startswith("id\trole\ttimestamp") and "ban the spammer\\twith a tab" in rows[1]


# -- help and start-up ---------------------------------------------------------------------------


def _command_paths(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix]
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            found += _command_paths(command, (*prefix, name))
        else:
            found.append((*prefix, name))
    return found


def test_help_has_examples_and_no_raw_markup(runner: CliRunner) -> None:
    for words in _command_paths(cli):
        text = runner.invoke(cli, [*words, "--help"]).stdout
        assert "``" not in text and ":func:" not in text, words
    assert (
        "hermes-store sessions prune --older-than 90 --yes" in runner.invoke(cli, ["--help"]).stdout
    )
    prune_help = runner.invoke(cli, ["sessions", "prune", "--help"]).stdout
    assert "\n    hermes-store sessions prune --older-than 90 --dry-run\n" in prune_help


@pytest.mark.slow
def test_importing_the_cli_loads_no_database_or_rendering_library() -> None:
    code = (
        "import sys, hermes_store.cli\n"
        "heavy = sorted(m for m in ('sqlalchemy', 'alembic', 'rich') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
        "from hermes_store import SessionDB\n"
        "assert 'sqlalchemy' in sys.modules and SessionDB.__name__ == 'SessionDB'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, env=env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_every_id_a_narrow_list_shows_resolves(tmp_path: Path) -> None:
    """The agent's ``YYYYMMDD_HHMMSS_hex`` ids share long prefixes with sessions the listing
    does not show: a shortened id must still name exactly one session in the database."""
    target = tmp_path / "state.db"
    with SessionDB(target) as db:
        for n in range(30):
            db.create_session(f"20251203_10{n:02d}00_{n:06x}", "telegram")
        for n in range(3):
            db.create_session(f"20251203_10{n:02d}01_{n:06x}", "cli")
    runner = CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1", "HERMES_STORE_URL": None})
    table = run(runner, target, "sessions", "list", "--source", "cli", "--format", "table").stdout
    shown = [line.split()[0] for line in table.splitlines() if line.startswith("2025")]
    assert len(shown) == 3
    for prefix in shown:
        done = run(runner, target, "sessions", "show", prefix, "--format", "json")
        assert done.exit_code == 0, (prefix, done.stderr)
        assert json.loads(done.stdout)["id"].startswith(prefix)


def test_unique_id_prefixes_are_unique_in_the_database(store: SessionDB) -> None:
    for session_id in ("abc_1", "abc_10", "abc_2", "abd", "b%_x", "b%_y", "zz"):
        store.create_session(session_id, "cli")
    shortened = store.unique_id_prefixes(["abc_1", "abd", "b%_x", "zz", "abc_10"], minimum=1)
    assert shortened == {
        "abc_1": "abc_1",
        "abd": "abd",
        "b%_x": "b%_x",
        "zz": "z",
        "abc_10": "abc_10",
    }
    for session_id, prefix in shortened.items():
        assert store.resolve_session_id(prefix) == session_id
