"""Where an export (the import's input) may be written: never through a symbolic link that
would be replaced by a file while its target keeps the old content, and never reported as
written when standard output was closed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from hermes_store import SessionDB
from hermes_store.cli import cli
from tests.support.cli_process import RUN_CLI
from tests.support.waiting import GUARD


def a_database(tmp_path: Path) -> Path:
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("s1", "cli")
        db.append_message("s1", "user", "hello")
    return path


def test_an_export_onto_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    db = a_database(tmp_path)
    target = tmp_path / "real.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    runner = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1", "HERMES_STORE_URL": None})
    result = runner.invoke(cli, ["--db", str(db), "export", "-o", str(link)])
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.stderr.strip().splitlines() == [
        f"Error: refusing to write {str(link)!r}: it is a symbolic link (to {str(target)!r}); "
        "name the file it points to"
    ]
    assert link.is_symlink() and target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir() if "jsonl" in p.name) == [
        "link.jsonl",
        "real.jsonl",
    ]


def test_an_export_to_a_closed_stdout_fails_with_exit_3(tmp_path: Path) -> None:
    db = a_database(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "COLUMNS")}
    done = subprocess.run(
        [sys.executable, "-c", RUN_CLI, "--db", str(db), "export", "-o", "-"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        timeout=GUARD,
        preexec_fn=lambda: os.close(1),  # the shell's >&-
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: could not write the output: standard output is closed"
    ]
