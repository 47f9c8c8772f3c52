"""What users of gh, sqlite-utils and alembic expect of a command line: a listing says when
it is cut and can list everything."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy.engine import URL

from hermes_store import SessionDB, analytics
from hermes_store.cli import cli
from hermes_store.errors import InvalidInputError
from hermes_store.query import read_only_query
from hermes_store.schema import migrate
from tests.support.backends import analyst_url, url_string
from tests.support.cli_process import RUN_CLI, read_terminal


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1", "HERMES_STORE_URL": None})


def run(runner: CliRunner, db: str | Path, *args: str) -> Result:
    return runner.invoke(cli, ["--db", str(db), *args])


@pytest.fixture
def many(tmp_path: Path) -> Path:
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        for n in range(45):
            db.create_session(f"s{n:03d}", "cli" if n % 3 else "telegram")
        db.create_session("child", "cli", parent_session_id="s000")
    return path


def test_a_cut_listing_says_so_on_a_terminal(runner: CliRunner, many: Path) -> None:
    table = run(runner, many, "sessions", "list", "--format", "table").stdout
    assert "20 of 45 session(s)" in table and "--all" in table
    whole = run(runner, many, "sessions", "list", "--format", "table", "--limit", "50").stdout
    assert "45 session(s)" in whole and " of " not in whole.splitlines()[0]
    telegram = run(runner, many, "sessions", "list", "--source", "telegram", "--format", "table")
    assert "15 session(s)" in telegram.stdout
    with_children = run(runner, many, "sessions", "list", "--children", "--format", "table")
    assert "20 of 46 session(s)" in with_children.stdout


@pytest.mark.parametrize("flag", [["--all"], ["--limit", "0"]])
def test_all_lists_every_session(runner: CliRunner, many: Path, flag: list[str]) -> None:
    piped = run(runner, many, "sessions", "list", *flag)
    assert piped.exit_code == 0, piped.stderr
    ids = [line.split("\t")[0] for line in piped.stdout.splitlines()[1:]]
    assert len(ids) == 45 and len(set(ids)) == 45
    listed = json.loads(run(runner, many, "sessions", "list", "--json", *flag).stdout)
    assert len(listed) == 45


def test_count_sessions_matches_what_paging_lists(many: Path) -> None:
    with SessionDB(many) as db:
        for sources, excluded, children in [
            (None, None, False),
            (["cli"], None, False),
            (["cli", "telegram"], None, True),
            (None, ["telegram"], False),
        ]:
            listed = []
            for source in sources or [None]:
                listed += db.list_sessions_rich(
                    source=source, exclude_sources=excluded, limit=1000, include_children=children
                )
            assert db.count_sessions(sources, excluded, children) == len(listed)


def test_query_reads_and_refuses_every_write(runner: CliRunner, db_url: URL) -> None:
    with SessionDB(url_string(db_url)) as db:
        db.create_session("q1", "cli", model="gpt")
        db.create_session("q2", "telegram", model="claude")
        db.append_message("q1", "user", "hello")
    target = analyst_url(db_url)  # PostgreSQL: an ordinary role, as analysts connect
    listed = run(runner, target, "query", "SELECT id, source FROM sessions ORDER BY id", "--json")
    assert listed.exit_code == 0, listed.stderr
    assert json.loads(listed.stdout) == [
        {"id": "q1", "source": "cli"},
        {"id": "q2", "source": "telegram"},
    ]
    hostile = "x' OR '1'='1"
    bound = run(
        runner, target, "query", "SELECT id FROM sessions WHERE model = :m", "-p", f"m={hostile}"
    )
    assert bound.exit_code == 0 and bound.stdout.strip() == "id"  # a value, never SQL
    piped = run(runner, target, "query", "SELECT count(*) AS n FROM messages")
    assert piped.stdout.splitlines() == ["n", "1"]
    for write in (
        "DELETE FROM messages",
        "UPDATE sessions SET title = 'x'",
        "CREATE TABLE intruder (a INTEGER)",
        "DROP TABLE messages",
        "SELECT 1; DELETE FROM messages",
        # A statement that ends the read-only transaction, then writes in autocommit: with no
        # parameters psycopg sent them all with the simple protocol, and they ran.
        "COMMIT; DELETE FROM messages",
        "COMMIT; DROP TABLE write_keys",
        "ROLLBACK; UPDATE sessions SET title = 'x'",
        "END; DELETE FROM sessions WHERE id = 'q2'",
    ):
        refused = run(runner, target, "query", write)
        assert refused.exit_code == 1, (write, refused.stdout, refused.stderr)
        assert refused.stderr.startswith("Error: ") and "Traceback" not in refused.stderr
    with SessionDB(url_string(db_url)) as db:
        assert db.session_count() == 2 and db.message_count() == 1
        assert db.get_session("q1")["title"] is None  # type: ignore[index]
    assert read_only_query(target, "SELECT count(*) FROM write_keys").rows == [(0,)]
    missing = run(runner, target, "query", "SELECT :m")  # no value for :m: said, not raised
    assert missing.exit_code == 1 and missing.stderr.startswith("Error: "), missing.stderr


@pytest.mark.parametrize(
    "statement",
    [
        "ATTACH DATABASE '{new}' AS x",
        "ATTACH 'file:{new}?mode=rwc' AS x",
        "VACUUM INTO '{new}'",
        "VACUUM",
        "DETACH DATABASE main",
    ],
)
def test_query_opens_and_creates_no_other_file(
    runner: CliRunner, many: Path, tmp_path: Path, statement: str
) -> None:
    """ATTACH created a missing file and VACUUM INTO left an empty one behind (``query_only``
    refuses only the copy's writes): both are refused before SQLite opens anything."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    beside = sorted(many.parent.iterdir())
    refused = run(runner, many, "query", statement.format(new=elsewhere / "new.db"))
    assert refused.exit_code == 1, (refused.stdout, refused.stderr)
    assert refused.stderr.startswith("Error: ") and len(refused.stderr.splitlines()) == 1
    assert "ATTACH, DETACH and VACUUM are refused" in refused.stderr
    assert list(elsewhere.iterdir()) == []
    assert sorted(many.parent.iterdir()) == beside
    with pytest.raises(InvalidInputError, match="are refused"):
        read_only_query(str(many), statement.format(new=elsewhere / "new.db"))
    assert list(elsewhere.iterdir()) == []
    counted = run(runner, many, "query", "SELECT count(*) AS n FROM sessions", "--format", "tsv")
    assert counted.stdout.splitlines() == ["n", "46"]


def test_query_cut_by_limit_says_so(runner: CliRunner, many: Path) -> None:
    cut = run(runner, many, "query", "SELECT id FROM sessions", "--limit", "5", "--format", "tsv")
    assert cut.exit_code == 0 and len(cut.stdout.splitlines()) == 6
    assert "--limit" in cut.stderr


def _cli(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "COLUMNS")}
    return subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, *args], env=env, text=True, stderr=subprocess.PIPE, **kwargs
    )


def _wait_for(condition: Callable[[], bool], what: str, deadline_s: float = 120.0) -> None:
    """Until ``condition`` holds (a generous deadline: a loaded machine is slow, not wrong)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_exits_130_and_says_what_landed(tmp_path: Path) -> None:
    source = tmp_path / "source.db"
    with SessionDB(source) as db:
        for n in range(5):
            db.create_session(f"imp{n}", "cli")
            db.append_message(f"imp{n}", "user", f"message {n}")
    exported = tmp_path / "all.jsonl"
    assert (
        CliRunner().invoke(cli, ["--db", str(source), "export", "-o", str(exported)]).exit_code == 0
    )
    lines = exported.read_text(encoding="utf-8").splitlines(keepends=True)
    target = tmp_path / "target.db"
    SessionDB(target).close()

    def imported() -> int:
        with sqlite3.connect(target) as con:
            return int(con.execute("SELECT count(*) FROM sessions").fetchone()[0])

    process = _cli("--db", str(target), "import", "-", "--batch-size", "1", stdin=subprocess.PIPE)
    assert process.stdin is not None
    process.stdin.writelines(lines[:3])  # three whole batches; the rest never comes
    process.stdin.flush()
    _wait_for(lambda: imported() == 3, "three committed batches")
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Interrupted. 3 session(s) and 3 message(s) were imported" in err
    assert "Traceback" not in err and "Aborted" not in err
    assert imported() == 3


def _cpu_seconds(pid: int) -> float:
    """User and system time of a running process (/proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_in_a_long_query_exits_130(tmp_path: Path) -> None:
    """SQLite reports the Ctrl-C its progress handler let through as "interrupted": the
    query exited 1, "the database refused the query", where every other command says
    Interrupted and exits 130."""
    path = tmp_path / "state.db"
    SessionDB(path).close()
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
    process = _cli("--db", str(path), "query", endless, stdout=subprocess.PIPE)
    # Past its start (well under a second of CPU), it is in the query.
    _wait_for(lambda: _cpu_seconds(process.pid) > 2.0, "the query to run")
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Interrupted" in err and "refused" not in err and "Traceback" not in err


@pytest.mark.slow
def test_an_export_into_a_pipe_closed_early_ends_quietly(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        for n in range(200):
            db.create_session(f"s{n:03d}", "cli")
            db.append_messages(f"s{n:03d}", [{"role": "user", "content": "word " * 200}] * 5)
    for fmt in ("jsonl", "md"):
        process = _cli(
            "--db", str(path), "export", "--format", fmt, "-o", "-", stdout=subprocess.PIPE
        )
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline()  # like `| head -1`: one line, then the reader is gone
        process.stdout.close()
        err = process.stderr.read()
        assert process.wait(timeout=120) == 0, err
        assert err == "", err


@pytest.fixture
def narrow() -> CliRunner:
    return CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1", "HERMES_STORE_URL": None})


def test_stats_fit_80_columns_and_say_what_they_leave_out(narrow: CliRunner, many: Path) -> None:
    with SessionDB(many) as db:
        db.update_token_counts("s001", input_tokens=1_234_567, output_tokens=34_567)
        db.update_token_counts("s002", estimated_cost_usd=12.5, actual_cost_usd=11.0)
    table = run(narrow, many, "stats", "--format", "table").stdout
    assert all(len(line) <= 80 for line in table.splitlines()[1:]), table  # after the path
    assert "1,234,567" in table and "$12.5000" in table
    assert "(all zero, left out: cache read, cache write, reasoning)" in table
    assert "cache write" not in table.split("(all zero")[0]
    with SessionDB(many, migrate="check") as db:
        report = analytics.summary(db, days=7)
    assert report["totals"]["input_tokens"] == 1_234_567 and len(report["by_day"]) == 1


def test_db_history_is_one_line_per_revision(narrow: CliRunner, many: Path) -> None:
    table = run(narrow, many, "db", "history", "--format", "table").stdout.splitlines()
    revisions = migrate.history(many)
    assert len(table) == 1 + len(revisions)  # a header, then one line each
    assert all(len(line) <= 80 for line in table)
    assert table[-1].startswith("→") and "(current, head)" in table[-1]
    assert [r.revision for r in revisions][:2] == ["v1_base", "v2_finish_reason"]
    assert revisions[-1].current and revisions[-1].head and revisions[1].down_revision == "v1_base"
    piped = run(narrow, many, "db", "history").stdout.splitlines()
    assert piped[1].split("\t")[-1].endswith("full-text objects.")  # whole when piped


def _on_a_terminal(args: list[str], extra_env: dict[str, str]) -> str:
    """Run the CLI with stdout on a 24x80 pty; returns what reached the terminal."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "COLUMNS")}
    env.update({"NO_COLOR": "1", "TERM": "dumb", **extra_env})
    process = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, *args],
        stdin=follower,  # a pager needs a terminal on both sides, as at a shell prompt
        stdout=follower,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(follower)
    shown = read_terminal(leader)
    assert process.wait(timeout=120) == 0, process.stderr.read() if process.stderr else ""
    return shown.decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.slow
def test_long_output_is_paged_and_wrapped_on_a_terminal_only(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    sentence = "a checkpoint cannot copy frames past the oldest reader snapshot"
    with SessionDB(path) as db:
        db.create_session("long", "cli")
        for turn in range(30):
            db.append_message("long", "user", f"turn {turn}: {sentence}, " * 3)
    paged = tmp_path / "paged.txt"
    script = tmp_path / "pager.sh"
    script.write_text(f"#!/bin/sh\ncat > '{paged}'\n", encoding="utf-8")
    script.chmod(0o755)
    pager_env = {"PAGER": str(script)}
    screen = _on_a_terminal(["--db", str(path), "sessions", "show", "long"], pager_env)
    assert "turn 29" not in screen  # it went to the pager, not straight to the terminal
    text = paged.read_text(encoding="utf-8")
    assert "turn 0:" in text and "turn 29:" in text
    assert all(len(line) <= 80 for line in text.splitlines())  # wrapped at words
    paged.unlink()
    screen = _on_a_terminal(
        ["--db", str(path), "--no-pager", "sessions", "show", "long"], pager_env
    )
    assert not paged.exists() and "turn 29:" in screen
    assert all(len(line) <= 80 for line in screen.splitlines())
    piped = _cli("--db", str(path), "sessions", "show", "long", stdout=subprocess.PIPE)
    out, _ = piped.communicate(timeout=120)
    assert not paged.exists()  # piped: never paged
    assert any(len(line) > 80 for line in out.splitlines())  # and lines stay whole for grep


def _complete(*words: str) -> list[str]:
    """What bash completion offers after ``words`` (click's completion protocol)."""
    env = {k: v for k, v in os.environ.items() if k != "HERMES_STORE_URL"}
    env.update(
        {
            "COMP_WORDS": " ".join(("hermes-store", *words)),
            "COMP_CWORD": str(len(words)),
            "_HERMES_STORE_COMPLETE": "bash_complete",
        }
    )
    done = subprocess.run(
        [sys.executable, "-c", RUN_CLI], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return [line.split(",", 1)[1] for line in done.stdout.splitlines() if line]


@pytest.mark.slow
def test_session_references_complete_to_ids(many: Path, tmp_path: Path) -> None:
    assert _complete("--db", str(many), "sessions", "show", "s04") == [
        f"s04{n}" for n in range(4, -1, -1)
    ]
    assert "s000" in _complete("--db", str(many), "export", "--session", "s00")
    assert _complete("--db", str(tmp_path / "missing.db"), "sessions", "show", "s") == []
    assert "prune" in _complete("sessions", "p")
