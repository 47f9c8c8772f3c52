"""The ``hermes-store`` command line through click's CliRunner, on SQLite files and PostgreSQL.

Every command's output, its exit code (0 ok, 1 problem/not found, 2 usage, 3 database error)
and its ``--json`` form; export -> import round trips compared byte for byte.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.models import messages_table as M
from hermes_store.models import sessions_table as S
from hermes_store.schema import migrate
from tests.support import legacy
from tests.support.backends import is_sqlite, reset_pg, url_string

ROOT = "7f3c9a2e-1b4d-4c8e-9f01-a1b2c3d4e5f6"
CHILD = "7f3c9a2e-2c5e-4d9f-8a12-b2c3d4e5f607"
TG = "c0ffee00-3d6f-4eaf-9b23-c3d4e5f60718"
OLD_ENDED = "0ld00000-0000-4000-8000-000000000001"
OLD_ACTIVE = "0ld00000-0000-4000-8000-000000000002"
LONG_REASONING = "I should inspect the schema first, then plan each step of the migration. " * 3
TOOL_CALLS = [
    {
        "id": "call_zx81",
        "type": "function",
        "function": {"name": "terminal", "arguments": '{"command": "ls -la ~/.hermes"}'},
    }
]
DAY = 86400.0


def populate(db: SessionDB) -> None:
    """Sessions with CJK, tool calls, reasoning, a compression continuation and old sessions."""
    db.create_session(ROOT, "cli", model="anthropic/claude-sonnet-4.5", system_prompt="Be brief.")
    db.set_session_title(ROOT, "Database migration plan")
    db.append_message(ROOT, "user", "Plan the database migration for state.db", token_count=9)
    db.append_message(
        ROOT,
        "assistant",
        None,
        tool_calls=TOOL_CALLS,
        finish_reason="tool_calls",
        reasoning=LONG_REASONING,
        reasoning_details=[{"type": "reasoning.summary"}],
        codex_reasoning_items=[{"id": "rs_001", "encrypted_content": "gAAAAB"}],
    )
    db.append_message(
        ROOT, "tool", '{"exit_code": 0}\nstate.db', tool_call_id="call_zx81", tool_name="terminal"
    )
    db.append_message(ROOT, "assistant", "Migration done. Codename: zebracorn. 🦓", reasoning="")
    db.update_token_counts(
        ROOT,
        input_tokens=12345,
        output_tokens=6789,
        cache_read_tokens=4096,
        estimated_cost_usd=0.1234,
        actual_cost_usd=0.118,
        billing_provider="openrouter",
    )
    db.end_session(ROOT, "compression")
    db.create_session(CHILD, "cli", model="anthropic/claude-sonnet-4.5", parent_session_id=ROOT)
    db.set_session_title(CHILD, "Database migration plan #2")
    db.append_message(CHILD, "user", "Continue: verify the FTS index after compression.")
    db.update_token_counts(CHILD, input_tokens=2222, output_tokens=1111, estimated_cost_usd=0.04)
    db.create_session(TG, "telegram", model="openai/gpt-4.1-mini", system_prompt="你是 Hermes。")
    db.set_session_title(TG, "数据库迁移 🚀")
    db.append_message(TG, "user", "数据库迁移完成了")
    db.append_message(TG, "assistant", "好的！迁移已经验证通过。", reasoning="用户确认了迁移")
    db.update_token_counts(TG, input_tokens=900, output_tokens=450, estimated_cost_usd=0.00175)
    for session_id in (OLD_ENDED, OLD_ACTIVE):
        db.create_session(session_id, "discord", model="local/llama")
        db.append_message(session_id, "user", "an old conversation about the weather")
    db.end_session(OLD_ENDED, "user_exit")
    old = time.time() - 200 * DAY
    db.uow.run(
        lambda conn: conn.execute(
            sa.update(S).where(S.c.id.in_([OLD_ENDED, OLD_ACTIVE])).values(started_at=old)
        )
    )


@pytest.fixture
def populated(db_url: URL) -> URL:
    with SessionDB(url_string(db_url)) as db:
        populate(db)
    return db_url


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "HERMES_STORE_URL": None})


def run(runner: CliRunner, url: URL | str | Path | None, *args: str, **kwargs: Any) -> Result:
    """``hermes-store [--db URL] ARGS``; unexpected exceptions propagate to the test."""
    prefix = [] if url is None else ["--db", url_string(url) if isinstance(url, URL) else str(url)]
    return runner.invoke(cli, [*prefix, *args], catch_exceptions=False, **kwargs)


def run_json(runner: CliRunner, url: URL | str | Path, *args: str) -> Any:
    result = run(runner, url, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def open_db(url: URL | str | Path) -> SessionDB:
    return SessionDB(url_string(url) if isinstance(url, URL) else url)


def one_line_error(result: Result, code: int) -> str:
    """The command failed with ``code`` and one ``Error:`` line on stderr, no traceback."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# -- global behaviour and exit codes ---------------------------------------------------------


def test_help_lists_every_group(runner: CliRunner) -> None:
    result = run(runner, None, "--help")
    assert result.exit_code == 0
    for name in ("db", "sessions", "search", "export", "import", "stats", "doctor"):
        assert name in result.stdout
    assert "upgrade" in run(runner, None, "db", "--help").stdout


def test_usage_errors_exit_2(runner: CliRunner, tmp_path: Path) -> None:
    assert run(runner, tmp_path / "x.db", "--no-such-option").exit_code == 2
    assert run(runner, tmp_path / "x.db", "sessions", "show").exit_code == 2
    assert run(runner, tmp_path / "x.db", "sessions", "list", "--limit", "-1").exit_code == 2
    assert run(runner, "nosuchdialect://x/y", "sessions", "list").exit_code == 2


def test_missing_database_is_a_database_error_and_is_not_created(
    runner: CliRunner, tmp_path: Path
) -> None:
    target = tmp_path / "typo.db"
    for args in (["sessions", "list"], ["search", "x"], ["stats"], ["db", "check"]):
        line = one_line_error(run(runner, target, *args), 3)
        assert "no database" in line or "no schema" in line
    assert not target.exists()


def test_not_a_database_exits_3(runner: CliRunner, tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    line = one_line_error(run(runner, junk, "sessions", "list"), 3)
    assert "not a SQLite database" in line
    assert junk.read_bytes() == b"this is not sqlite at all" * 100


def test_schema_too_new_exits_3(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    legacy.build_legacy_db(path, 6)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE schema_version SET version = 99")
    assert "99" in one_line_error(run(runner, path, "sessions", "list"), 3)


def test_unreachable_server_and_unusable_folder_exit_3(runner: CliRunner, tmp_path: Path) -> None:
    # Nothing listens on port 1: the command waits $HERMES_STORE_UNAVAILABLE_TIMEOUT seconds
    # for the server (as the store waits during a failover), then says it stayed unreachable.
    nowhere = "postgresql://nobody@127.0.0.1:1/db"
    brief = {"HERMES_STORE_UNAVAILABLE_TIMEOUT": "0.2"}
    line = one_line_error(run(runner, nowhere, "sessions", "list", env=brief), 3)
    assert "stayed unreachable for" in line and "Connection refused" in line
    bad = {"HERMES_STORE_UNAVAILABLE_TIMEOUT": "soon"}
    assert "HERMES_STORE_UNAVAILABLE_TIMEOUT" in one_line_error(
        run(runner, nowhere, "sessions", "list", env=bad), 2
    )
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    one_line_error(run(runner, blocker / "state.db", "db", "upgrade"), 3)


def test_database_from_environment_then_hermes_home(runner: CliRunner, tmp_path: Path) -> None:
    env_db = tmp_path / "from-env.db"
    result = run(runner, None, "db", "upgrade", env={"HERMES_STORE_URL": str(env_db)})
    assert result.exit_code == 0 and env_db.exists()
    home = tmp_path / "home"
    result = run(runner, None, "db", "upgrade", env={"HERMES_HOME": str(home)})
    assert result.exit_code == 0, result.output
    assert (home / "state.db").exists()
    assert run(runner, None, "doctor", env={"HERMES_HOME": str(home)}).exit_code == 0


def test_python_dash_m_runs_the_quickstart(tmp_path: Path) -> None:
    """The README's main job, through the real entry point: create, then check, the default file."""
    env = {k: v for k, v in os.environ.items() if k != "HERMES_STORE_URL"}
    env["HERMES_HOME"] = str(tmp_path / "hermes")
    for args in (["db", "upgrade"], ["doctor"]):
        done = subprocess.run(
            [sys.executable, "-m", "hermes_store", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    assert "Healthy." in done.stdout
    assert (tmp_path / "hermes" / "state.db").exists()


# -- sessions ---------------------------------------------------------------------------------


def test_sessions_list_table_and_json(runner: CliRunner, populated: URL) -> None:
    result = run(runner, populated, "sessions", "list", "--format", "table")
    assert result.exit_code == 0, result.output
    for text in (
        CHILD,
        TG,
        "数据库迁移 🚀",
        "openai/gpt-4.1-mini",
        "telegram",
        "数据库迁移完成了",
        "$0.1180",
        "900/450",
    ):
        assert text in result.stdout, text
    rows = run_json(runner, populated, "sessions", "list")
    # Newest first; the compression root shows its continuation; children are left out.
    assert [r["id"] for r in rows] == [TG, CHILD, OLD_ACTIVE, OLD_ENDED]
    projected = rows[1]
    assert (
        projected["_lineage_root_id"] == ROOT and projected["title"] == "Database migration plan #2"
    )
    assert rows[0]["preview"] == "数据库迁移完成了"


def test_sessions_list_filters(runner: CliRunner, populated: URL) -> None:
    rows = run_json(runner, populated, "sessions", "list", "--children")
    assert {r["id"] for r in rows} == {ROOT, CHILD, TG, OLD_ENDED, OLD_ACTIVE}
    assert [
        r["id"] for r in run_json(runner, populated, "sessions", "list", "--source", "telegram")
    ] == [TG]
    rows = run_json(runner, populated, "sessions", "list", "--exclude-source", "discord")
    assert [r["id"] for r in rows] == [TG, CHILD]
    assert len(run_json(runner, populated, "sessions", "list", "--limit", "1")) == 1


def test_sessions_show_resolves_id_prefix_and_title(runner: CliRunner, populated: URL) -> None:
    for ref in (ROOT, ROOT[:12], "Database migration plan"):
        result = run(runner, populated, "sessions", "show", ref)
        assert result.exit_code == 0, result.output
        assert ROOT in result.stdout and "Database migration plan" in result.stdout
    out = run(runner, populated, "sessions", "show", ROOT).stdout
    assert "Plan the database migration for state.db" in out
    assert "zebracorn" in out and "🦓" in out
    assert 'tool call terminal({"command": "ls -la ~/.hermes"})' in out
    assert f"reasoning ({len(LONG_REASONING)} chars)" in out
    assert LONG_REASONING.strip() not in out  # folded to one short line
    assert "(2 lines," in out  # the tool result is folded too
    full = run(runner, populated, "sessions", "show", ROOT, "--full").stdout
    assert LONG_REASONING.strip() in full and "state.db" in full
    assert "gAAAAB" in full and "gAAAAB" not in out


def test_sessions_show_json_and_cjk_title(runner: CliRunner, populated: URL) -> None:
    shown = run_json(runner, populated, "sessions", "show", "数据库迁移 🚀")
    with open_db(populated) as db:
        assert shown == json.loads(json.dumps(db.export_session(TG), ensure_ascii=False))
    assert [m["content"] for m in shown["messages"]] == [
        "数据库迁移完成了",
        "好的！迁移已经验证通过。",
    ]


def test_sessions_show_not_found_and_ambiguous_prefix(runner: CliRunner, populated: URL) -> None:
    assert "no single session" in one_line_error(
        run(runner, populated, "sessions", "show", "nope"), 1
    )
    one_line_error(run(runner, populated, "sessions", "show", "7f3c9a2e"), 1)  # two match


def test_sessions_rename(runner: CliRunner, populated: URL) -> None:
    result = run(runner, populated, "sessions", "rename", TG[:8], "  Weekly   report ")
    assert result.exit_code == 0 and "Weekly report" in result.stdout
    line = one_line_error(
        run(runner, populated, "sessions", "rename", TG, "Database migration plan"), 1
    )
    assert "already in use" in line
    assert "too long" in one_line_error(
        run(runner, populated, "sessions", "rename", TG, "x" * 101), 1
    )
    assert "cleared" in run(runner, populated, "sessions", "rename", TG, "").stdout
    with open_db(populated) as db:
        assert db.get_session_title(TG) is None
        assert db.get_session_title(ROOT) == "Database migration plan"
    one_line_error(run(runner, populated, "sessions", "rename", "nope", "x"), 1)


def test_sessions_delete_needs_yes_without_a_terminal(runner: CliRunner, populated: URL) -> None:
    """A pipe's "y" is not a confirmation (the terminal prompt is in test_cli_output.py)."""
    refused = run(runner, populated, "sessions", "delete", ROOT, input="y\n")
    assert "--yes" in one_line_error(refused, 1)
    with open_db(populated) as db:
        assert db.get_session(ROOT) is not None
    assert run(runner, populated, "sessions", "delete", ROOT, "--yes").exit_code == 0
    assert run(runner, populated, "sessions", "delete", TG, "-y").exit_code == 0
    with open_db(populated) as db:
        assert db.get_session(ROOT) is None and db.get_session(TG) is None
        assert db.message_count(ROOT) == 0
        child = db.get_session(CHILD)
        assert child is not None and child["parent_session_id"] is None  # orphaned, kept
    one_line_error(run(runner, populated, "sessions", "delete", ROOT, "--yes"), 1)


def test_sessions_prune_dry_run_then_real(runner: CliRunner, populated: URL) -> None:
    prune = ("sessions", "prune", "--older-than", "90")
    dry = run(runner, populated, *prune, "--dry-run", "--format", "table")
    assert dry.exit_code == 0, dry.output
    assert OLD_ENDED in dry.stdout and OLD_ACTIVE not in dry.stdout
    assert "would delete 1 session" in dry.stdout
    with open_db(populated) as db:
        assert db.session_count() == 5
    other = run(
        runner, populated, "sessions", "prune", "--older-than", "90", "--source", "cli", "--yes"
    )
    assert "Deleted 0 session" in other.stdout
    real = run(runner, populated, "sessions", "prune", "--older-than", "90", "--yes")
    assert real.exit_code == 0 and "Deleted 1 session" in real.stdout
    with open_db(populated) as db:
        assert db.get_session(OLD_ENDED) is None and db.get_session(OLD_ACTIVE) is not None
        assert db.session_count() == 4
    assert run(runner, populated, "sessions", "prune", "--older-than", "-1").exit_code == 2


# -- search ------------------------------------------------------------------------------------


def test_search_highlights_and_json(runner: CliRunner, populated: URL) -> None:
    result = run(runner, populated, "search", "zebracorn", "--format", "table")
    assert result.exit_code == 0, result.output
    assert ROOT in result.stdout and "zebracorn" in result.stdout
    assert ">>>" not in result.stdout  # the markers are rendered, not shown
    assert "1 result(s)" in result.stdout
    hits = run_json(runner, populated, "search", "zebracorn")
    assert [h["session_id"] for h in hits] == [ROOT]
    assert ">>>zebracorn<<<" in hits[0]["snippet"]
    assert set(hits[0]) == {
        "id",
        "session_id",
        "role",
        "snippet",
        "timestamp",
        "tool_name",
        "source",
        "model",
        "session_started",
        "context",
    }


def test_search_filters_and_cjk(runner: CliRunner, populated: URL) -> None:
    hits = run_json(runner, populated, "search", "迁移")
    assert {h["session_id"] for h in hits} == {TG}
    assert run_json(runner, populated, "search", "迁移", "--source", "cli") == []
    assert run_json(runner, populated, "search", "迁移", "--exclude-source", "telegram") == []
    roles = {h["role"] for h in run_json(runner, populated, "search", "迁移", "--role", "user")}
    assert roles == {"user"}
    assert len(run_json(runner, populated, "search", "conversation", "--limit", "1")) == 1
    none = run(runner, populated, "search", "xylophone", "--format", "table")
    assert none.exit_code == 0 and "No results" in none.stdout
    # Syntax that FTS5 would reject is still a search, never an error.
    assert run(runner, populated, "search", 'chat-send AND (" OR').exit_code == 0


def test_search_sort(runner: CliRunner, populated: URL) -> None:
    newest = run_json(runner, populated, "search", "the", "--sort", "newest", "--limit", "50")
    oldest = run_json(runner, populated, "search", "the", "--sort", "oldest", "--limit", "50")
    assert len(newest) >= 2
    assert [h["timestamp"] for h in newest] == sorted(
        (h["timestamp"] for h in newest), reverse=True
    )
    assert [h["id"] for h in oldest] == [h["id"] for h in reversed(newest)]
    assert run(runner, populated, "search", "the", "--sort", "best").exit_code == 2


# -- export / import ---------------------------------------------------------------------------


def export_file(runner: CliRunner, url: URL | Path, path: Path, *args: str) -> bytes:
    result = run(runner, url, "export", "-o", str(path), *args)
    assert result.exit_code == 0, result.output
    return path.read_bytes()


def test_export_streams_one_session_per_line(
    runner: CliRunner, populated: URL, tmp_path: Path
) -> None:
    data = export_file(runner, populated, tmp_path / "all.jsonl")
    lines = [json.loads(line) for line in data.decode("utf-8").splitlines()]
    assert [r["id"] for r in lines] == [TG, CHILD, ROOT, OLD_ACTIVE, OLD_ENDED]
    assert "数据库迁移完成了".encode() in data  # UTF-8, not \u escapes
    root = lines[2]
    assert root["messages"][1]["tool_calls"] == TOOL_CALLS
    assert root["messages"][1]["reasoning"] == LONG_REASONING
    assert not list(tmp_path.glob(".all.jsonl.*"))
    one = export_file(runner, populated, tmp_path / "one.jsonl", "--session", "数据库迁移 🚀")
    assert [json.loads(x)["id"] for x in one.decode().splitlines()] == [TG]
    some = export_file(runner, populated, tmp_path / "cli.jsonl", "--source", "cli")
    assert len(some.splitlines()) == 2
    stdout = run(runner, populated, "export", "-o", "-", "--source", "telegram")
    assert json.loads(stdout.stdout.splitlines()[0])["id"] == TG
    both = run(runner, populated, "export", "-o", "x", "--session", TG, "--source", "cli")
    assert both.exit_code == 2
    unwritable = run(runner, populated, "export", "-o", str(tmp_path / "no" / "such" / "dir.jsonl"))
    assert unwritable.exit_code == 1 and "Could not open file" in unwritable.stderr


def test_export_import_round_trip_is_exact(
    runner: CliRunner, populated: URL, tmp_path: Path
) -> None:
    """Any backend -> a fresh SQLite file -> export again: the same bytes."""
    first = export_file(runner, populated, tmp_path / "first.jsonl")
    target = tmp_path / "restored.db"
    result = run(runner, target, "import", str(tmp_path / "first.jsonl"), "--batch-size", "2")
    assert result.exit_code == 0, result.output
    assert "Imported 5 session(s) and 9 message(s)" in result.stdout
    assert export_file(runner, target, tmp_path / "second.jsonl") == first
    with open_db(target) as db:
        assert db.get_session(CHILD)["parent_session_id"] == ROOT  # type: ignore[index]
        assert [h["session_id"] for h in db.search_messages("zebracorn")] == [ROOT]  # FTS follows
    assert run(runner, target, "doctor").exit_code == 0


def test_import_into_postgresql_round_trips_and_keeps_appending(
    runner: CliRunner, pg_worker_url: URL | None, tmp_path: Path
) -> None:
    """SQLite file -> PostgreSQL: exact, and the message id sequence moved past the ids."""
    if pg_worker_url is None:
        pytest.skip("needs HERMES_STORE_TEST_PG_URL")
    source = tmp_path / "source.db"
    with open_db(source) as db:
        populate(db)
    first = export_file(runner, source, tmp_path / "first.jsonl")
    reset_pg(pg_worker_url)
    result = run(runner, pg_worker_url, "import", str(tmp_path / "first.jsonl"), "--json")
    assert json.loads(result.stdout)["sessions"] == 5
    assert export_file(runner, pg_worker_url, tmp_path / "second.jsonl") == first
    with open_db(pg_worker_url) as db:
        top = db.uow.run(lambda conn: conn.scalar(sa.select(sa.func.max(M.c.id))), write=False)
        assert db.append_message(TG, "user", "after the import") > top


def test_import_skips_and_counts_collisions(
    runner: CliRunner, populated: URL, tmp_path: Path
) -> None:
    dump = tmp_path / "dump.jsonl"
    original = export_file(runner, populated, dump)
    again = run_json(runner, populated, "import", str(dump))
    assert again == {
        "sessions": 0,
        "sessions_skipped": 5,
        "messages": 0,
        "messages_skipped": 9,
        "messages_renumbered": 0,
        "titles_cleared": 0,
        "titles_refused": 0,
        "parents_missing": 0,
        "parents_restored": 0,
        "parents_differing": 0,
    }
    assert export_file(runner, populated, tmp_path / "after.jsonl") == original


def test_import_renumbers_taken_message_ids_and_clears_taken_titles(
    runner: CliRunner, populated: URL, tmp_path: Path
) -> None:
    dump = tmp_path / "dump.jsonl"
    export_file(runner, populated, dump)
    target = tmp_path / "busy.db"
    with open_db(target) as db:  # its own session holds message ids 1..3 and one title
        db.create_session("local", "cli")
        db.set_session_title("local", "数据库迁移 🚀")
        for n in range(3):
            db.append_message("local", "user", f"local message {n}")
    report = run_json(runner, target, "import", str(dump))
    assert report["sessions"] == 5 and report["messages"] == 9
    assert report["messages_renumbered"] == 3 and report["titles_cleared"] == 1
    with open_db(populated) as source, open_db(target) as db:
        for session_id in (ROOT, CHILD, TG, OLD_ENDED, OLD_ACTIVE):
            assert db.get_messages_as_conversation(session_id) == (
                source.get_messages_as_conversation(session_id)
            )
        assert db.get_session_title(TG) is None and db.get_session_title("local") == "数据库迁移 🚀"
        assert db.message_count("local") == 3


def test_import_refuses_bad_lines_before_writing(runner: CliRunner, tmp_path: Path) -> None:
    good = {"id": "s1", "source": "cli", "started_at": 1.0, "messages": []}
    cases = {
        "{not json": "line 2: not valid JSON",
        json.dumps({**good, "id": "s2", "colour": "red"}): "unknown fields ['colour']",
        json.dumps({**good, "id": "s2", "started_at": "yesterday"}): "started_at must be",
        json.dumps({**good, "id": "s2", "messages": [{"role": "user"}]}): "timestamp is required",
    }
    for bad, message in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n" + bad + "\n", encoding="utf-8")
        target = tmp_path / "target.db"
        assert message in one_line_error(run(runner, target, "import", str(path)), 1)
        with open_db(target) as db:
            assert db.session_count() == 0  # the whole batch was refused before writing
    assert run(runner, tmp_path / "t.db", "import", str(tmp_path / "missing.jsonl")).exit_code == 2


def test_import_links_children_whose_parent_comes_later(runner: CliRunner, tmp_path: Path) -> None:
    lines = [
        {"id": "grandchild", "source": "cli", "started_at": 3.0, "parent_session_id": "child"},
        {"id": "child", "source": "cli", "started_at": 2.0, "parent_session_id": "root"},
        {"id": "lost", "source": "cli", "started_at": 2.5, "parent_session_id": "nowhere"},
        {"id": "root", "source": "cli", "started_at": 1.0},
    ]
    path = tmp_path / "tree.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    report = run_json(runner, tmp_path / "t.db", "import", str(path), "--batch-size", "1")
    assert report["sessions"] == 4 and report["parents_missing"] == 1
    with open_db(tmp_path / "t.db") as db:
        parents = {
            s: (db.get_session(s) or {})["parent_session_id"]
            for s in ("grandchild", "child", "lost", "root")
        }
    assert parents == {"grandchild": "child", "child": "root", "lost": None, "root": None}


def test_import_refuses_a_cycle_of_parents_keeping_the_batches_before(
    runner: CliRunner, tmp_path: Path
) -> None:
    """'a' and 'b' each other's parent, a batch apart: one line naming them and what stayed."""
    lines = [
        {"id": "a", "source": "cli", "started_at": 1.0, "parent_session_id": "b"},
        {"id": "b", "source": "cli", "started_at": 2.0, "parent_session_id": "a"},
    ]
    path = tmp_path / "ring.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    result = run(runner, tmp_path / "t.db", "import", str(path), "--batch-size", "1")
    assert one_line_error(result, 1) == (
        "Error: line 2: the parent links 'b' -> 'a' -> 'b' form a cycle (each session would be "
        "its own ancestor): refused; its batch (line 2) was rolled back; the 1 session(s) of "
        "the batches before it stay imported"
    )
    with open_db(tmp_path / "t.db") as db:
        assert [s["id"] for s in db.list_sessions_rich()] == ["a"]
        assert (db.get_session("a") or {})["parent_session_id"] is None


# -- stats -------------------------------------------------------------------------------------


def test_stats_by_model_source_and_day(runner: CliRunner, populated: URL) -> None:
    report = run_json(runner, populated, "stats")
    totals = report["totals"]
    assert totals["sessions"] == 5 and totals["messages"] == 9
    assert totals["input_tokens"] == 12345 + 2222 + 900
    assert totals["estimated_cost_usd"] == pytest.approx(0.1234 + 0.04 + 0.00175)
    by_model = {r["model"]: r for r in report["by_model"]}
    assert by_model["anthropic/claude-sonnet-4.5"]["sessions"] == 2
    assert by_model["anthropic/claude-sonnet-4.5"]["output_tokens"] == 6789 + 1111
    assert by_model["anthropic/claude-sonnet-4.5"]["actual_cost_usd"] == pytest.approx(0.118)
    assert {r["source"]: r["sessions"] for r in report["by_source"]} == {
        "cli": 2,
        "discord": 2,
        "telegram": 1,
    }
    # The 200-day-old sessions fall outside the last 30 days.
    assert sum(r["sessions"] for r in report["by_day"]) == 3
    only_tg = run_json(runner, populated, "stats", "--source", "telegram")
    assert only_tg["totals"]["sessions"] == 1
    text = run(runner, populated, "stats", "--format", "table").stdout
    assert "By model" in text and "openai/gpt-4.1-mini" in text and "By day" in text


# -- doctor ------------------------------------------------------------------------------------


def test_doctor_healthy(runner: CliRunner, populated: URL) -> None:
    result = run(runner, populated, "doctor")
    assert result.exit_code == 0, result.output
    assert "Healthy." in result.stdout
    report = run_json(runner, populated, "doctor")
    assert report["ok"] is True
    names = {c["name"] for c in report["checks"]}
    assert {"schema", "full-text index", "orphan messages", "orphan sessions"} <= names
    if is_sqlite(populated):
        assert {"journal mode", "WAL size", "integrity_check"} <= names


def _insert_orphans(url: URL) -> None:
    """A message and a child whose session and parent do not exist (foreign keys bypassed)."""
    if is_sqlite(url):
        with sqlite3.connect(url.database or "") as con:
            con.execute("PRAGMA foreign_keys=OFF")
            con.execute(
                "INSERT INTO sessions (id, source, started_at, parent_session_id) "
                "VALUES ('stray', 'cli', 1.0, 'gone')"
            )
            con.execute(
                "INSERT INTO messages (session_id, role, content, timestamp) "
                "VALUES ('vanished', 'user', 'hello', 1.0)"
            )
        return
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
        conn.exec_driver_sql(
            "INSERT INTO sessions (id, source, started_at, parent_session_id) "
            "VALUES ('stray', 'cli', 1.0, 'gone')"
        )
        conn.exec_driver_sql(
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "VALUES ('vanished', 'user', 'hello', 1.0)"
        )
    engine.dispose()


def test_doctor_finds_orphan_rows(runner: CliRunner, populated: URL) -> None:
    _insert_orphans(populated)
    result = run(runner, populated, "doctor", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert report["ok"] is False
    assert status["orphan messages"] == "error" and status["orphan sessions"] == "error"
    assert status["full-text index"] == "ok"
    assert "Problems found." in run(runner, populated, "doctor").stdout


def test_doctor_finds_a_corrupt_full_text_index_and_rebuilds_it(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    with open_db(path) as db:
        populate(db)
    with sqlite3.connect(path) as con:  # drop one row from the index behind the triggers' back
        con.execute(
            "INSERT INTO messages_fts(messages_fts, rowid, content) "
            "VALUES ('delete', 1, 'Plan the database migration for state.db')"
        )
    report = json.loads(run(runner, path, "doctor", "--json").stdout)
    assert {c["name"]: c["status"] for c in report["checks"]}["full-text index"] == "error"
    assert run(runner, path, "doctor").exit_code == 1
    fixed = run(runner, path, "doctor", "--rebuild-index")
    assert fixed.exit_code == 0, fixed.output
    with sqlite3.connect(path) as con:
        con.execute("DROP TRIGGER messages_fts_insert")
    result = run(runner, path, "doctor", "--json")
    assert result.exit_code == 1 and "messages_fts_insert" in result.stdout


def test_doctor_on_files_it_cannot_use(runner: CliRunner, tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"garbage" * 1000)
    result = run(runner, junk, "doctor")
    assert result.exit_code == 1 and "not a SQLite database" in result.stdout
    assert run(runner, tmp_path / "absent.db", "doctor").exit_code == 1
    assert not (tmp_path / "absent.db").exists()
    old = tmp_path / "v3.db"
    legacy.build_legacy_db(old, 3)
    result = run(runner, old, "doctor")
    assert result.exit_code == 1 and "db upgrade" in result.stdout
    assert legacy.dump_rows(old) == legacy.expected_rows(3)  # doctor changed nothing


# -- db ----------------------------------------------------------------------------------------


def test_db_commands_adopt_a_legacy_file(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    info = run_json(runner, path, "db", "current")
    assert info["legacy"] is True and info["revision"] == "v3_session_title"
    assert info["schema_version"] == 3 and info["at_head"] is False
    assert "not adopted" in run(runner, path, "db", "current").stdout
    assert "db upgrade" in one_line_error(run(runner, path, "db", "check"), 1)
    history = run(runner, path, "db", "history", "--format", "table").stdout
    assert "v3_session_title (current)" in history and "(head)" in history

    result = run(runner, path, "db", "upgrade")
    assert result.exit_code == 0, result.output
    assert (
        "Adopted" in result.stdout
        and f"v3_session_title -> {migrate.head_revision()}" in result.stdout
    )
    info = run_json(runner, path, "db", "current")
    assert info["at_head"] is True and info["schema_version"] == 6 and info["legacy"] is False
    assert run(runner, path, "db", "check").exit_code == 0
    rows = legacy.dump_rows(path)
    assert [r["title"] for r in rows["sessions"]] == [
        r["title"] for r in legacy.expected_rows(3)["sessions"]
    ]

    down = run(runner, path, "db", "downgrade", "v5_billing_columns", "--yes")
    assert down.exit_code == 0 and "-> v5_billing_columns" in down.stdout
    assert run_json(runner, path, "db", "current")["schema_version"] == 5
    assert run(runner, path, "db", "check").exit_code == 1  # behind head
    assert run(runner, path, "db", "upgrade", "no_such_rev").exit_code == 2
    assert run(runner, path, "db", "upgrade").exit_code == 0


def test_db_check_on_an_unadopted_head_file_changes_nothing(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 6)
    before = path.read_bytes()
    result = run(runner, path, "db", "check")
    assert result.exit_code == 0, result.output
    assert "no drift" in result.stdout
    with sqlite3.connect(path) as con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "alembic_version" not in tables
    assert legacy.dump_rows(path) == legacy.expected_rows(6)
    assert len(before) > 0


def test_db_upgrade_current_and_drift(runner: CliRunner, empty_url: URL) -> None:
    info = run_json(runner, empty_url, "db", "current")
    assert info["exists"] is False and info["revision"] is None
    result = run(runner, empty_url, "db", "upgrade")
    assert result.exit_code == 0, result.output
    info = run_json(runner, empty_url, "db", "current")
    assert info["at_head"] is True and info["revision"] == migrate.head_revision()
    assert run(runner, empty_url, "db", "check").exit_code == 0
    engine = sa.create_engine(empty_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE sessions ADD COLUMN mood TEXT")
    engine.dispose()
    line = one_line_error(run(runner, empty_url, "db", "check"), 1)
    assert "drifted" in line and "mood" in line
