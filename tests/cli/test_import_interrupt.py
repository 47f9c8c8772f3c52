"""Ctrl-C during an import into a new SQLite file: the command says it was interrupted and
what landed (exit 130), at once; no error met while unwinding (the connection the interrupt
cut, the lock it held) takes the interrupt's place, and no private build file is left."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from tests.support.import_workers import export_records, write_export
from tests.support.waiting import GUARD

#: ``hermes-store ARGS`` in a fresh interpreter that sends itself SIGINT as the full-text
#: index statement of batch ``T_BATCH`` (its ``json_each`` insert) starts or returns
#: (``T_EVENT``: ``c_call`` or ``c_return``): the signal a user's Ctrl-C sends, at the point
#: where an import spends most of its time, reached the same way every run.
SIGINT_IN_INDEXING = """
import os, signal, sqlite3, sys
from hermes_store.cli import main

wanted, event_wanted = int(os.environ["T_BATCH"]), os.environ["T_EVENT"]
seen = 0

def profile(frame, event, arg):
    global seen
    if event != event_wanted or getattr(arg, "__name__", "") != "execute":
        return
    if type(getattr(arg, "__self__", None)) is not sqlite3.Cursor:
        return
    sql = frame.f_locals.get("statement")
    if isinstance(sql, str) and "json_each" in sql and sql.lstrip().startswith("INSERT"):
        seen += 1
        if seen == wanted:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGINT)

sys.setprofile(profile)
sys.argv[0] = "hermes-store"
main()
"""


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "all.jsonl"
    write_export(path, export_records(sessions=400, per_session=2))
    return path


@pytest.mark.parametrize("event", ["c_call", "c_return"])
@pytest.mark.parametrize("batch", [1, 3])
def test_ctrl_c_while_indexing_a_new_file_exits_130_saying_what_landed(
    tmp_path: Path, export: Path, event: str, batch: int
) -> None:
    target = tmp_path / "new.db"
    env = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "COLUMNS")}
    env |= {"T_BATCH": str(batch), "T_EVENT": event}
    done = subprocess.run(
        [sys.executable, "-c", SIGINT_IN_INDEXING, "--db", str(target), "import", str(export)],
        env=env,
        capture_output=True,
        text=True,
        timeout=GUARD,
    )
    assert done.returncode == 130, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Interrupted. "), done.stderr
    assert "locked" not in done.stderr and "Traceback" not in done.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".new.db.")] == []
    said = re.search(r"Interrupted\. (\d+) session\(s\)", lines[0])
    assert said is not None, lines[0]
    landed = 0
    if target.exists():
        with closing(sqlite3.connect(target)) as conn:
            landed = conn.execute("SELECT count(*) FROM sessions").fetchone()[0]
    assert landed == int(said.group(1))
