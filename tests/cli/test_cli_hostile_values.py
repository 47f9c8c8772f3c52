"""Values a careless export, a script or a file the original store wrote can bring: the
command line refuses them before writing, or shows what is stored, never a traceback."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hermes_store import SessionDB, markdown
from hermes_store.cli import cli
from tests.support.cli_process import RUN_CLI


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1", "HERMES_STORE_URL": None})


def run(runner: CliRunner, db: str | Path, *args: str) -> Result:
    return runner.invoke(cli, ["--db", str(db), *args])


def test_stored_timestamps_no_date_holds_are_shown_as_numbers(
    runner: CliRunner, tmp_path: Path
) -> None:
    """The store refuses such timestamps now, but a file the original store wrote may hold
    them (milliseconds, say): every command that shows a date still answers."""
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("ms", "cli")
        db.append_message("ms", "user", "hello millis")
        db.append_message("ms", "assistant", "hello huge")
    with sqlite3.connect(path) as con:  # as the original store would have written them
        con.execute("UPDATE sessions SET started_at = 1733500000000 WHERE id = 'ms'")
        con.execute("UPDATE messages SET timestamp = 1e300 WHERE content = 'hello huge'")
    for args in (
        ("sessions", "list"),
        ("sessions", "list", "--format", "table"),
        ("sessions", "show", "ms"),
        ("search", "hello"),
        ("export", "--format", "md", "-o", "-"),
        ("export", "--format", "md", "--split", "-o", str(tmp_path / "pages")),
        ("export", "-o", "-"),
    ):
        result = run(runner, path, *args)
        assert result.exit_code == 0, (args, result.output, result.exception)
    shown = run(runner, path, "sessions", "show", "ms").stdout
    assert "1e+300 (not a date)" in shown
    listed = run(runner, path, "sessions", "list", "--format", "json").stdout
    assert json.loads(listed)[0]["started_at"] == 1733500000000.0  # as stored
    tsv = run(runner, path, "sessions", "list", "--format", "tsv").stdout
    assert "\t1733500000000.0\t" in tsv  # where a date would be
    assert [page.name.startswith("undated-") for page in (tmp_path / "pages").iterdir()] == [True]


BAD_LINES = {
    "a cost beyond 64 bits": (
        '{"id": "x", "source": "cli", "started_at": 1.0, '
        '"estimated_cost_usd": 1180591620717411303424}',
        "estimated_cost_usd must be a float or an integer within the 64-bit range",
    ),
    "a message id beyond 64 bits": (
        '{"id": "x", "source": "cli", "started_at": 1.0, "messages": '
        '[{"id": 1180591620717411303424, "role": "user", "timestamp": 1.0}]}',
        "message 0: id must be between",
    ),
    "started_at in milliseconds": (
        '{"id": "x", "source": "cli", "started_at": 1733500000000}',
        "looks like milliseconds",
    ),
    "started_at NaN": ('{"id": "x", "source": "cli", "started_at": NaN}', "finite number"),
    "an infinite cost": (
        '{"id": "x", "source": "cli", "started_at": 1.0, "actual_cost_usd": Infinity}',
        "finite number",
    ),
    "JSON nested 100,000 deep": (
        '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "nested too deeply",
    ),
    "a session that is its own parent": (
        '{"id": "x", "source": "cli", "started_at": 1.0, "parent_session_id": "x"}',
        "its own parent",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_import_refuses_numbers_and_shapes_no_store_takes(
    runner: CliRunner, tmp_path: Path, case: str
) -> None:
    line, reason = BAD_LINES[case]
    good = '{"id": "fine", "source": "cli", "started_at": 1.0}'
    export = tmp_path / "in.jsonl"
    export.write_text(f"{good}\n{line}\n")
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("kept", "cli")
    result = run(runner, path, "import", str(export))
    assert result.exit_code == 1, (result.output, result.exception)
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("Error: line 2"), result.stderr
    assert reason in errors[0]
    with SessionDB(path) as db:  # refused before anything was written
        assert [s["id"] for s in db.list_sessions_rich()] == ["kept"]


def test_import_leaves_empty_a_title_the_store_would_not_keep(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A title over 100 characters (a redacted export's marker can lengthen one) or holding
    what ``set_session_title`` removes is left empty and counted; the rest of the session, and
    the rest of the file, import as exported."""
    records = [
        {"id": "long", "source": "cli", "started_at": 1.0, "title": "T" * 10_000},
        {"id": "invisible", "source": "cli", "started_at": 2.0, "title": "a\u200bb"},
        {"id": "fine", "source": "cli", "started_at": 3.0, "title": "kept as it is"},
    ]
    export = tmp_path / "in.jsonl"
    export.write_text("".join(json.dumps(r) + "\n" for r in records))
    path = tmp_path / "state.db"
    result = run(runner, path, "import", str(export))
    assert result.exit_code == 0, (result.output, result.exception)
    assert "2 title(s) left empty: not one the store keeps" in result.stdout
    with SessionDB(path) as db:
        titles = {sid: (db.get_session(sid) or {}).get("title") for sid in ("long", "invisible")}
        assert titles == {"long": None, "invisible": None}
        assert (db.get_session("fine") or {}).get("title") == "kept as it is"
        assert (db.get_session("long") or {}).get("started_at") == 1.0


#: The child's address space, capped: a reader that reads /dev/zero whole fails at once
#: instead of taking the machine's memory until the timeout.
_MEMORY_CAP = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"


def test_importing_dev_zero_fails_at_once(tmp_path: Path) -> None:
    """``hermes-store import /dev/zero`` read it as one endless line, growing to gigabytes
    without a word: now one line, exit 2 (the wrong file given), nothing created."""
    env = {k: v for k, v in os.environ.items() if k != "HERMES_STORE_URL"}
    argv = [sys.executable, "-c", _MEMORY_CAP + RUN_CLI, "--db", str(tmp_path / "state.db")]
    done = subprocess.run(
        [*argv, "import", "/dev/zero"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "Error: /dev/zero: line 1: holds a NUL byte: not a JSON Lines export (binary data?)"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"SQLite format 3\x00\x10\x00\x01\x01", "line 1: holds a NUL byte"),
        (b"\x1f\x8b\x08\x08\xd2\x93", "line 1: not a JSON Lines export: every line is a JSON"),
        (b"id,source,started_at\nx,cli,1.0\n", "starts with 'i'"),
    ],
    ids=["sqlite", "gzip", "csv"],
)
def test_import_of_a_file_that_is_no_export_is_a_usage_error(
    runner: CliRunner, tmp_path: Path, content: bytes, reason: str
) -> None:
    """A database, a gzip file or a CSV given to import: one line, exit 2, nothing written;
    an export given after it still imports."""
    source = tmp_path / "input"
    source.write_bytes(content)
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("kept", "cli")
    result = run(runner, path, "import", str(source))
    assert result.exit_code == 2, (result.output, result.exception)
    [line] = result.stderr.splitlines()
    assert line.startswith(f"Error: {source}: line 1: ") and reason in line
    export = tmp_path / "good.jsonl"
    export.write_text('{"id": "fine", "source": "cli", "started_at": 1.0}\n')
    assert run(runner, path, "import", str(export)).exit_code == 0
    with SessionDB(path) as db:
        assert sorted(s["id"] for s in db.list_sessions_rich()) == ["fine", "kept"]


def _refuse_constant(name: str) -> Any:
    raise AssertionError(f"not JSON: {name}")


def strict_json(text: str) -> Any:
    """``text`` read as JSON is: ``Infinity``, ``-Infinity`` and ``NaN`` refused (as jq does)."""
    return json.loads(text, parse_constant=_refuse_constant)


_INFINITE_CALLS = (
    '[{"id": "c1", "function": {"name": "f", "arguments": {"x": Infinity, "y": NaN}}}]'
)
_COSTS_QUERY = "SELECT id, estimated_cost_usd, actual_cost_usd FROM sessions"


def test_an_infinite_cost_is_valid_json_everywhere_and_survives_export(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A file the original store wrote may hold an infinite cost (a REAL column; SQLite keeps
    NaN as NULL) and tool calls whose JSON holds ``Infinity``: every ``--json`` output writes
    ``null`` there (``Infinity`` is not JSON: jq refuses the whole file); the export writes
    the cost as a marked object, which the import restores."""
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("inf", "cli", model="m")
        db.set_session_title("inf", "Infinite")
        db.append_message("inf", "assistant", "calling", tool_calls=[{"id": "c1"}])
    with sqlite3.connect(path) as con:  # as the original store could have left it
        con.execute(
            "UPDATE sessions SET estimated_cost_usd = 9e999, actual_cost_usd = -9e999 "
            "WHERE id = 'inf'"
        )
        con.execute(
            "UPDATE messages SET tool_calls = ? WHERE session_id = 'inf'", (_INFINITE_CALLS,)
        )
        stored = con.execute("SELECT estimated_cost_usd, actual_cost_usd FROM sessions").fetchone()
    assert stored == (float("inf"), float("-inf"))
    exported = tmp_path / "out.jsonl"
    assert run(runner, path, "export", "-o", str(exported)).exit_code == 0
    piped = run(runner, path, "export", "-o", "-")
    assert piped.exit_code == 0, (piped.output, piped.exception)
    for text in (exported.read_text(), piped.stdout):
        [record] = [strict_json(line) for line in text.splitlines()]
        assert record["estimated_cost_usd"] == {"$sqlite": "real", "value": "Infinity"}
        assert record["actual_cost_usd"] == {"$sqlite": "real", "value": "-Infinity"}
        arguments = record["messages"][0]["tool_calls"][0]["function"]["arguments"]
        assert arguments == {"x": None, "y": None}
    commands = {
        "list": ("sessions", "list", "--json"),
        "show": ("sessions", "show", "inf", "--json"),
        "stats": ("stats", "--json"),
        "query": ("query", _COSTS_QUERY, "--json"),
    }
    printed = {}
    for name, args in commands.items():
        result = run(runner, path, *args)
        assert result.exit_code == 0, (args, result.output, result.exception)
        printed[name] = strict_json(result.stdout)
    assert printed["list"][0]["estimated_cost_usd"] is None
    assert printed["list"][0]["actual_cost_usd"] is None
    assert printed["show"]["actual_cost_usd"] is None
    assert printed["query"] == [{"id": "inf", "estimated_cost_usd": None, "actual_cost_usd": None}]
    tsv = run(runner, path, "sessions", "show", "inf", "--format", "tsv").stdout
    assert '"arguments": {"x": null, "y": null}' in tsv
    copy = tmp_path / "copy.db"
    result = run(runner, copy, "import", str(exported), "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    assert strict_json(result.stdout)["sessions"] == 1
    with SessionDB(copy) as db:
        session = db.get_session("inf")
        assert session is not None
        assert (session["estimated_cost_usd"], session["actual_cost_usd"]) == stored
        assert db.get_session_title("inf") == "Infinite"


def test_an_empty_database_or_session_option_is_refused(runner: CliRunner, tmp_path: Path) -> None:
    """An empty shell variable must not silently mean the default database (a script's
    ``--db "$DB"`` would then restore over or prune the agent's own file), nor every session."""
    for db in ("", "  "):
        result = run(runner, db, "sessions", "list")
        assert result.exit_code == 2 and "--db is empty" in result.stderr, result.output
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("one", "cli")
    result = run(runner, path, "export", "--session", "", "-o", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 2 and "--session is empty" in result.stderr, result.output
    assert not (tmp_path / "out.jsonl").exists()


def _char_device(path: Path) -> Path | None:
    """A character device like ``/dev/null`` at ``path``, or None where making one is not
    allowed (not root, or no CAP_MKNOD): the FIFO cases still run there."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        return None
    return path


def test_an_export_streams_into_a_device_or_fifo_and_never_replaces_it(
    runner: CliRunner, tmp_path: Path
) -> None:
    """``export -o /dev/null`` once renamed its output over the device: as root that left a
    regular file at ``/dev/null`` and broke every program writing there. A device or a FIFO
    is written to as it is; a folder, or a FIFO where a split export names a page, refused."""
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("s1", "cli")
        db.append_message("s1", "user", "one")
        db.create_session("s2", "cli")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    result = run(runner, path, "export", "-o", str(fifo))
    reader.join(timeout=60)
    assert result.exit_code == 0, (result.output, result.exception)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(json.loads(line)["id"] for line in received[0].splitlines()) == ["s1", "s2"]
    device = _char_device(tmp_path / "null")
    if device is not None:
        for args in (("-o", str(device)), ("--format", "md", "-o", str(device))):
            result = run(runner, path, "export", *args)
            assert result.exit_code == 0, (result.output, result.exception)
            assert stat.S_ISCHR(os.lstat(device).st_mode)
    folder = tmp_path / "pages"
    folder.mkdir()
    with SessionDB(path) as db:
        record = db.export_session("s1")
    assert record is not None
    planted = folder / markdown.file_name(record)
    os.mkfifo(planted)  # nobody reads it: writing into it would block forever
    result = run(runner, path, "export", "--format", "md", "--split", "-o", str(folder))
    assert result.exit_code == 1 and "FIFO" in result.stderr, result.output
    assert stat.S_ISFIFO(os.lstat(planted).st_mode)
    result = run(runner, path, "export", "-o", str(tmp_path))
    assert result.exit_code == 1 and "folder" in result.stderr, result.output


def test_a_backup_never_replaces_a_device_or_fifo(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("s1", "cli")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    targets = [fifo, *filter(None, [_char_device(tmp_path / "null")])]
    for target in targets:
        result = run(runner, path, "backup", str(target), "--force")
        assert result.exit_code == 1 and "not a file" in result.stderr, result.output
        assert not stat.S_ISREG(os.lstat(target).st_mode)


def test_a_device_or_fifo_as_the_database_is_named_for_what_it_is(
    runner: CliRunner, tmp_path: Path
) -> None:
    """``--db /dev/null`` was refused as "an empty file (0 bytes)": refused still, in words
    that say what the path is; and it is left as it was."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target, kind in ((fifo, "FIFO"), (_char_device(tmp_path / "null"), "character device")):
        if target is None:
            continue
        result = run(runner, target, "sessions", "list")
        assert result.exit_code == 3 and kind in result.stderr, result.output
        assert not stat.S_ISREG(os.lstat(target).st_mode)


def test_a_database_path_that_is_not_utf8_is_a_usage_error(
    runner: CliRunner, tmp_path: Path
) -> None:
    """``--db`` or ``HERMES_HOME`` naming a folder whose name is not UTF-8: one line, exit 2,
    and no folder or file created (``db upgrade`` created the folder, then failed raw)."""
    folder = tmp_path / os.fsdecode(b"b\xffd")
    for env, args in (
        ({}, ["--db", str(folder / "state.db"), "stats"]),
        ({}, ["--db", str(folder / "state.db"), "db", "upgrade"]),
        ({"HERMES_HOME": str(folder)}, ["stats"]),
        ({"HERMES_HOME": str(folder)}, ["db", "upgrade"]),
    ):
        done = runner.invoke(cli, args, env=env)
        assert done.exit_code == 2, (args, done.output, done.exception)
        assert "is not valid UTF-8; rename the folder" in done.stderr
        assert len(done.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_prune_refuses_a_non_finite_age_and_counts_need_64_bits(
    runner: CliRunner, tmp_path: Path
) -> None:
    """``--older-than inf`` was taken (every ended session went); NaN and an age whose seconds
    overflow are refused as the API refuses them, and a --limit past 2**63-1 is a usage error
    stating the range, not the store's "between -9223372036854775808 and ..."."""
    from hermes_store.errors import InvalidInputError
    from hermes_store.ops import retention

    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("old", "cli")
        db.end_session("old", "done")
    with sqlite3.connect(path) as con:
        con.execute("UPDATE sessions SET started_at = 1000, ended_at = 1001")
    for days in ("inf", "Infinity", "nan", "1e305"):
        done = run(runner, path, "sessions", "prune", "--older-than", days, "--yes")
        assert done.exit_code == 2, (days, done.output, done.exception)
        assert "finite" in done.stderr or "too large" in done.stderr
    for days_value in (float("inf"), 1e305):
        with pytest.raises(InvalidInputError, match="finite"):
            retention.Policy(days_value)
    with SessionDB(path) as db:
        assert db.get_session("old") is not None  # nothing was pruned
    too_big = str(2**63)
    for args in (("sessions", "list", "--limit", too_big), ("search", "x", "--limit", too_big)):
        done = run(runner, path, *args)
        assert done.exit_code == 2, (args, done.output)
        assert f"<=x<={2**63 - 1}" in done.stderr
    assert run(runner, path, "sessions", "list", "--limit", str(2**63 - 1)).exit_code == 0


def test_doctor_budget_and_stats_days_out_of_range_are_usage_errors(
    runner: CliRunner, tmp_path: Path
) -> None:
    """``doctor --budget nan`` (or inf: 0 is the documented "no limit") and ``stats --days``
    past the analytics' 100,000 were taken, or refused with exit 1 as a refused input."""
    path = tmp_path / "state.db"
    SessionDB(path).close()
    for args in (("doctor", "--budget", "nan"), ("doctor", "--budget", "inf")):
        done = run(runner, path, *args)
        assert done.exit_code == 2 and "finite" in done.stderr, (args, done.output)
    done = run(runner, path, "stats", "--days", "100001")
    assert done.exit_code == 2 and "1<=x<=100000" in done.stderr, done.output
    assert run(runner, path, "stats", "--days", "100000").exit_code == 0
    assert run(runner, path, "doctor", "--budget", "0").exit_code == 0


def test_a_database_target_that_cannot_be_opened_is_one_line_with_its_exit_code(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``~user`` with no home folder, a ``%00`` in a URL, a SQLite URI parameter the store
    refuses: each raised a raw traceback (RuntimeError, ValueError, OperationalError) and
    exit 1. A usage error now (exit 2, one line naming --db or HERMES_HOME), nothing created;
    an in-memory URI is refused as ``sqlite:///:memory:`` is (exit 3)."""
    monkeypatch.chdir(tmp_path)
    commands = (("stats",), ("db", "current"), ("db", "upgrade"), ("doctor",))
    for db, reason in (
        ("~hermes-no-such-user-4f1c/x.db", "whose home folder cannot be found"),
        ("sqlite:///%00x", "NUL character"),
        ("sqlite:///file:%2500x?uri=true", "NUL character"),
        (f"sqlite:///file:{tmp_path}/u.db?vfs=nosuch&uri=true", "no such vfs: nosuch"),
        (f"sqlite:///file:{tmp_path}/u.db?mode=bogus&uri=true", "mode='bogus' is not one"),
    ):
        for args in commands:
            done = run(runner, db, *args)
            assert done.exit_code == 2, (db, args, done.output, done.exception)
            [line] = done.stderr.splitlines()
            assert line.startswith("Error: --db: ") and reason in line, line
    done = runner.invoke(cli, ["stats"], env={"HERMES_HOME": "~hermes-no-such-user-4f1c/h"})
    assert done.exit_code == 2, (done.output, done.exception)
    assert done.stderr.startswith("Error: HERMES_HOME: ") and "home folder" in done.stderr
    for memory in ("sqlite:///:memory:", "sqlite:///file:x.db?mode=memory&uri=true"):
        done = run(runner, memory, "stats")
        assert done.exit_code == 3, (memory, done.output, done.exception)
        assert done.stderr.startswith("Error: an in-memory SQLite database cannot hold a store")
    assert list(tmp_path.iterdir()) == []


def test_query_text_that_is_not_utf8_is_refused_as_other_commands_refuse_it(
    runner: CliRunner, tmp_path: Path
) -> None:
    """An argument whose bytes are not UTF-8 reaches Python as lone surrogates: ``query``
    raised a raw UnicodeEncodeError from its SQL or a ``-p`` value. Refused as every command
    refuses such text ("not valid Unicode", exit 1), before anything runs."""
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("s", "cli")
    undecodable = os.fsdecode(b"\xff")
    for args, named in (
        (("query", "SELECT :a", "-p", f"a={undecodable}"), "parameter 'a'"),
        (("query", f"SELECT '{undecodable}'"), "the query"),
        (("query", "SELECT 1", "-p", f"{undecodable}=1"), "the parameter name"),
        (("sessions", "list", "--source", undecodable), "a text argument"),  # as before
    ):
        done = run(runner, path, *args)
        assert done.exit_code == 1, (args, done.output, done.exception)
        [line] = done.stderr.splitlines()
        assert line.startswith(f"Error: {named}") and "not valid Unicode" in line, line
    assert run(runner, path, "query", "SELECT :a", "-p", "a=ü").exit_code == 0


def _planted(tmp_path: Path, *statements: str) -> Path:
    """A file the store made (session ``odd``: a user turn, a tool result) whose rows were then
    changed by plain sqlite3, as the original store's dynamic typing lets any writer."""
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("odd", "cli", model="m")
        db.append_message("odd", "user", "first turn")
        db.append_message("odd", "tool", "tool output", tool_name="shell")
        db.update_token_counts("odd", input_tokens=1200, output_tokens=30)
    with sqlite3.connect(path) as con:
        for statement in statements:
            con.execute(statement)
    return path


ODD_VALUES = {
    "a blob as content": (
        "UPDATE messages SET content = X'00FF10' WHERE content = 'first turn'",
        "[blob: 3 bytes, hex 00ff10]",
    ),
    "a blob as a tool's output": (
        "UPDATE messages SET content = X'0A0B' WHERE role = 'tool'",
        "[blob: 2 bytes, hex 0a0b]",
    ),
    "text as a counter": ("UPDATE sessions SET input_tokens = 'abc'", "abc"),
    "text as a timestamp": (
        "UPDATE messages SET timestamp = 'yesterday' WHERE role = 'user'",
        "'yesterday' (not a date)",
    ),
}


@pytest.mark.parametrize("case", sorted(ODD_VALUES))
def test_values_sqlite_allows_in_any_column_are_shown_as_they_are(
    runner: CliRunner, tmp_path: Path, case: str
) -> None:
    """Every command that shows a session shows the stored value (a blob by its size and
    bytes, text as the text) where a traceback was."""
    statement, shown = ODD_VALUES[case]
    path = _planted(tmp_path, statement)
    outputs = {}
    for args in (
        ("export", "-o", str(tmp_path / "out.jsonl")),
        ("export", "--format", "md", "-o", "-"),
        ("export", "--format", "md", "--split", "-o", str(tmp_path / "pages")),
        ("sessions", "show", "odd"),
        ("sessions", "show", "odd", "--full"),
        ("sessions", "show", "odd", "--format", "tsv"),
        ("sessions", "show", "odd", "--json"),
        ("sessions", "list", "--format", "table"),
    ):
        result = run(runner, path, *args)
        assert result.exit_code == 0, (args, result.output, result.exception)
        assert "Traceback" not in result.output
        outputs[args] = result.stdout
    assert shown in outputs[("export", "--format", "md", "-o", "-")]
    assert shown in outputs[("sessions", "show", "odd", "--full")]
    strict_json(outputs[("sessions", "show", "odd", "--json")])


def _rows(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of both tables, each value with its storage class (``typeof``)."""
    with closing(sqlite3.connect(path)) as con:
        tables = {}
        for table in ("sessions", "messages"):
            columns = [row[1] for row in con.execute(f"PRAGMA table_info({table})")]
            picked = ", ".join(f"{c}, typeof({c})" for c in columns)
            tables[table] = sorted(con.execute(f"SELECT {picked} FROM {table}"), key=repr)
    return tables


def test_an_export_of_values_of_any_type_imports_back_as_they_were(
    runner: CliRunner, tmp_path: Path
) -> None:
    """Blobs, text where numbers belong, infinite costs, a float counter and a timestamp in
    milliseconds: the export says it wrote them marked, and an import into a new file holds
    every row as it was, value and storage class."""
    path = _planted(
        tmp_path,
        "UPDATE messages SET content = X'00FF10', reasoning = X'' WHERE role = 'user'",
        "UPDATE messages SET timestamp = 'yesterday' WHERE role = 'tool'",
        "UPDATE sessions SET input_tokens = 'abc', output_tokens = 2.5, "
        "estimated_cost_usd = 9e999, actual_cost_usd = -9e999, started_at = 1733500000000, "
        "model = X'6D'",
    )
    exported = tmp_path / "out.jsonl"
    result = run(runner, path, "export", "-o", str(exported))
    assert result.exit_code == 0, (result.output, result.exception)
    assert "9 value(s) JSON or the import's checks have no plain form for" in result.stderr
    [record] = [strict_json(line) for line in exported.read_text().splitlines()]
    assert record["input_tokens"] == {"$sqlite": "text", "value": "abc"}
    assert record["model"] == {"$sqlite": "blob", "base64": "bQ=="}
    copy = tmp_path / "copy.db"
    result = run(runner, copy, "import", str(exported))
    assert result.exit_code == 0, (result.output, result.exception)
    assert _rows(copy) == _rows(path)


def test_an_export_says_what_it_leaves_out_and_imports_back(
    runner: CliRunner, tmp_path: Path
) -> None:
    """Messages whose session is gone and a session stored with no id cannot be imported (a
    message needs its session, nothing names the session): the export leaves them out and
    says how many, and the rest imports back exactly."""
    path = _planted(
        tmp_path,
        "INSERT INTO messages (session_id, role, content, timestamp) "
        "VALUES ('ghost', 'user', 'orphan', 1.0)",
        "INSERT INTO sessions (id, source, started_at) VALUES (NULL, 'cli', 1.0)",
    )
    exported = tmp_path / "out.jsonl"
    result = run(runner, path, "export", "-o", str(exported))
    assert result.exit_code == 0, (result.output, result.exception)
    assert "Exported 1 session(s), 2 message(s)" in result.stderr
    assert "1 message(s) left out: their session no longer exists" in result.stderr
    assert "1 session(s) left out: stored with no id" in result.stderr
    copy = tmp_path / "copy.db"
    result = run(runner, copy, "import", str(exported))
    assert result.exit_code == 0, (result.output, result.exception)
    kept = _rows(path)
    kept["sessions"] = [row for row in kept["sessions"] if row[0] is not None]
    kept["messages"] = [row for row in kept["messages"] if "ghost" not in row]
    assert _rows(copy) == kept
