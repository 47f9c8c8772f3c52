"""Values a careless export, a script or a file the original store wrote can bring: the
command line refuses them before writing, or shows what is stored, never a traceback."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from hermes_store import SessionDB, markdown
from hermes_store.cli import cli


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
    "JSON nested 100,000 deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
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
