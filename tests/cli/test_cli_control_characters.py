"""Stored text comes from remote chat users (through the gateways): what the command line shows
a person never sends its control characters to the terminal (no clearing the screen, setting
the window title or writing the clipboard), while JSON, and tsv/csv written to a pipe, keep
every value exactly as stored.

The human format is checked through click's CliRunner with colour on (so click strips nothing
that would hide a stored escape sequence), and on a real pty, where the default format is the
table and tsv/csv are escaped too.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.cli.output import terminal_text
from tests.support.cli_process import RUN_CLI, read_terminal

SESSION = "s\x1b[2Jx"  # ESC [ 2 J: clears the screen
SOURCE = "cli\x1b]0;pwned\x07"  # OSC 0: sets the window title
MODEL = "gpt\x9b31m\u202eevil"  # a C1 CSI and a right-to-left override
CONTENT = (
    "deploy \x1b[31mRED\x1b[0m \x1b]52;c;cHduZWQ=\x07 end \x9b2J \u202eevil\u202c"
    " [bold red]x[/] del\x7f"
)
REASONING = "think \x1b]52;c;b3duZWQ=\x07 hard"
TOOL = "sh\x1b[8m"
#: What must never reach a terminal: C0 controls but newline and tab, DEL, C1, bidi overrides.
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
#: Colour and style codes the CLI writes itself (click.style).
OWN_STYLE = re.compile(r"\x1b\[[0-9;]*m")
QUERY = "SELECT content, session_id FROM messages WHERE role = 'user'"


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session(SESSION, source=SOURCE, model=MODEL)
        db.append_message(SESSION, "user", CONTENT)
        db.append_message(
            SESSION,
            "assistant",
            "on it",
            tool_calls=[{"function": {"name": TOOL, "arguments": '{"cmd": "\x1b]0;t\x07"}'}}],
            reasoning=REASONING,
        )
        db.append_message(SESSION, "tool", "out \x1b[2J done", tool_name=TOOL)
    return path


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": None, "HERMES_STORE_URL": None})


def run(runner: CliRunner, path: Path, *args: str) -> Result:
    """The command with colour on: click strips nothing that would hide a stored sequence."""
    result = runner.invoke(cli, ["--db", str(path), *args], color=True, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def assert_safe(shown: str) -> None:
    """No control character but the CLI's own colour codes, newlines and tabs; the stored
    sequences shown escaped, rich-style markup shown literally."""
    assert UNSAFE.findall(OWN_STYLE.sub("", shown)) == [], shown
    assert "\x1b[2J" not in shown and "\x1b]" not in shown and "\x1b[31m" not in shown


def assert_content_escaped(shown: str) -> None:
    shown = OWN_STYLE.sub("", shown)  # a search shows the match bold
    assert "deploy \\x1b[31mRED\\x1b[0m \\x1b]52;c;cHduZWQ=\\x07 end \\x9b2J" in shown, shown
    assert "\\u202eevil\\u202c [bold red]x[/] del\\x7f" in shown, shown


def tsv_rows(text: str) -> list[dict[str, str]]:
    lines = text.rstrip("\n").split("\n")
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]


def test_terminal_text_escapes_controls_in_one_readable_form() -> None:
    assert terminal_text("a\x1b[2Jb\x07\x7f\x9b\u202e\u2066z") == (
        "a\\x1b[2Jb\\x07\\x7f\\x9b\\u202e\\u2066z"
    )
    assert terminal_text("line\tone\nline two\r\nthree\rX") == "line\tone\nline two\nthree\\x0dX"
    assert terminal_text("a\tb\nc", one_line=True) == "a\\x09b\\x0ac"
    # A line the CLI styled keeps its own colour codes; anything else is escaped still.
    styled = "\x1b[1mbold\x1b[0m \x1b]0;t\x07 \x1b[2J"
    assert terminal_text(styled, styled=True) == "\x1b[1mbold\x1b[0m \\x1b]0;t\\x07 \\x1b[2J"
    assert (
        terminal_text("\x1b[1ma\tb\x1b[0m", styled=True, one_line=True) == "\x1b[1ma\\x09b\x1b[0m"
    )
    once = terminal_text(CONTENT)
    assert terminal_text(once) == once and not UNSAFE.search(once)
    assert terminal_text("[bold red]x[/] C:\\temp") == "[bold red]x[/] C:\\temp"


def test_search_escapes_on_the_terminal_and_keeps_values_in_machine_formats(
    runner: CliRunner, hostile: Path
) -> None:
    shown = run(runner, hostile, "search", "deploy", "--format", "table").stdout
    assert_safe(shown)
    assert_content_escaped(shown)
    assert "s\\x1b[2Jx" in shown and "cli\\x1b]0;pwned\\x07" in shown
    assert "\x1b[1mdeploy\x1b[0m" in shown  # the match is still highlighted
    (hit,) = json.loads(run(runner, hostile, "search", "deploy", "--json").stdout)
    assert (hit["session_id"], hit["source"]) == (SESSION, SOURCE)
    assert "\x1b[31mRED\x1b[0m \x1b]52;c;cHduZWQ=\x07 end \x9b2J" in hit["snippet"]
    (row,) = tsv_rows(run(runner, hostile, "search", "deploy", "--format", "tsv").stdout)
    assert (row["session_id"], row["source"]) == (SESSION, SOURCE)
    assert row["snippet"] == CONTENT  # a pipe gets the value as stored, escapes and all


def test_sessions_list_escapes_the_table_and_keeps_values_in_machine_formats(
    runner: CliRunner, hostile: Path
) -> None:
    shown = run(runner, hostile, "sessions", "list", "--format", "table").stdout
    assert_safe(shown)
    assert "s\\x1b[2Jx" in shown and "cli\\x1b]0;pwned\\x07" in shown
    assert "gpt\\x9b31m\\u202eevil" in shown and "deploy \\x1b[31mRED" in shown
    (listed,) = json.loads(run(runner, hostile, "sessions", "list", "--json").stdout)
    assert (listed["id"], listed["source"], listed["model"]) == (SESSION, SOURCE, MODEL)
    for fmt in ("tsv", "csv"):
        text = run(runner, hostile, "sessions", "list", "--format", fmt).stdout
        rows = tsv_rows(text) if fmt == "tsv" else list(csv.DictReader(io.StringIO(text)))
        (row,) = rows
        assert (row["id"], row["source"], row["model"]) == (SESSION, SOURCE, MODEL), fmt


def test_sessions_show_escapes_every_stored_text_and_keeps_values_in_machine_formats(
    runner: CliRunner, hostile: Path
) -> None:
    for extra in ((), ("--full",)):
        shown = run(runner, hostile, "sessions", "show", SESSION, *extra).stdout
        assert_safe(shown)
        assert_content_escaped(shown)
        assert "s\\x1b[2Jx" in shown and "cli\\x1b]0;pwned\\x07 / gpt\\x9b31m\\u202eevil" in shown
        assert "sh\\x1b[8m" in shown and "out \\x1b[2J done" in shown
    full = run(runner, hostile, "sessions", "show", SESSION, "--full").stdout
    assert "think \\x1b]52;c;b3duZWQ=\\x07 hard" in full
    exported = json.loads(run(runner, hostile, "sessions", "show", SESSION, "--json").stdout)
    assert (exported["id"], exported["source"], exported["model"]) == (SESSION, SOURCE, MODEL)
    assert exported["messages"][0]["content"] == CONTENT
    assert exported["messages"][1]["reasoning"] == REASONING
    rows = tsv_rows(run(runner, hostile, "sessions", "show", SESSION, "--format", "tsv").stdout)
    assert rows[0]["content"] == CONTENT and rows[1]["reasoning"] == REASONING
    assert rows[2]["tool_name"] == TOOL


def test_query_escapes_the_table_and_keeps_values_in_machine_formats(
    runner: CliRunner, hostile: Path
) -> None:
    shown = run(runner, hostile, "query", QUERY, "--format", "table").stdout
    assert_safe(shown)
    assert_content_escaped(shown)
    assert "s\\x1b[2Jx" in shown
    (row,) = json.loads(run(runner, hostile, "query", QUERY, "--json").stdout)
    assert row == {"content": CONTENT, "session_id": SESSION}
    (row,) = tsv_rows(run(runner, hostile, "query", QUERY, "--format", "tsv").stdout)
    assert row == {"content": CONTENT, "session_id": SESSION}
    text = run(runner, hostile, "query", QUERY, "--format", "csv").stdout
    assert list(csv.DictReader(io.StringIO(text))) == [{"content": CONTENT, "session_id": SESSION}]


def on_a_terminal(path: Path, *args: str) -> str:
    """Run the CLI with stdout on a pty (colour on, no pager); what reached the terminal."""
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "NO_COLOR")}
    env.update({"COLUMNS": "200", "TERM": "xterm"})
    process = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, "--no-pager", "--db", str(path), *args],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(follower)
    shown = read_terminal(leader)
    assert process.stderr is not None
    with process.stderr:
        assert process.wait(timeout=120) == 0, process.stderr.read()
    return shown.decode("utf-8").replace("\r\n", "\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("search", "deploy"),
        ("sessions", "list"),
        ("sessions", "show", SESSION, "--full"),
        ("query", QUERY),
        ("query", QUERY, "--format", "tsv"),
        ("sessions", "list", "--format", "csv"),
    ],
    ids=["search", "sessions-list", "sessions-show", "query", "query-tsv", "list-csv"],
)
def test_nothing_stored_reaches_a_real_terminal_unescaped(hostile: Path, args: tuple[str]) -> None:
    shown = on_a_terminal(hostile, *args)
    assert_safe(shown)
    assert "s\\x1b[2Jx" in shown or args[0] == "search", shown
    if args[0] != "sessions" or args[1] == "show":
        assert_content_escaped(shown)
