"""What an import refuses, and what it says when it stops partway: a value the target
cannot hold is refused with its line and field, never stored as something else; a failure
after committed batches says how many sessions landed and that running it again skips them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hermes_store import SessionDB, transfer
from hermes_store.cli import cli
from hermes_store.errors import InvalidInputError


def session(sid: str, **fields: Any) -> dict[str, Any]:
    return {"id": sid, "source": "cli", "started_at": 1.0, **fields}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def run_import(tmp_path: Path, export: Path, *args: str) -> Result:
    runner = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1", "HERMES_STORE_URL": None})
    return runner.invoke(cli, ["--db", str(tmp_path / "state.db"), "import", str(export), *args])


def error_line(result: Result, code: int) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("fresh", [True, False], ids=["new-file", "existing-file"])
def test_a_bad_line_after_committed_batches_says_what_landed(tmp_path: Path, fresh: bool) -> None:
    if not fresh:
        SessionDB(tmp_path / "state.db").close()
    good = [json.dumps(session(f"s{n}")) for n in range(300)]
    export = write_lines(tmp_path / "e.jsonl", [*good, json.dumps(session("bad", started_at="x"))])
    line = error_line(run_import(tmp_path, export), 1)
    assert line.startswith("Error: line 301: started_at must be")
    assert line.endswith(
        "(300 session(s) of the batches before it were imported; run the same import again "
        "to add the rest: known ids are skipped)"
    )


def test_a_lone_surrogate_is_refused_with_its_line_and_field(tmp_path: Path) -> None:
    good = [json.dumps(session(f"s{n}")) for n in range(3)]
    lone = json.dumps(session("bad", messages=[{"role": "user", "timestamp": 2.0, "content": ""}]))
    lone = lone.replace('"content": ""', '"content": "half \\ud83d of a pair"')
    export = write_lines(tmp_path / "e.jsonl", [*good, lone])
    line = error_line(run_import(tmp_path, export, "--batch-size", "1"), 1)
    assert line.startswith("Error: line 4, message 0: content holds a lone surrogate"), line
    assert "(3 session(s) of the batches before it were imported" in line


def test_a_nan_cost_is_refused_by_sqlite_not_stored_as_null(tmp_path: Path) -> None:
    nan = {"$sqlite": "real", "value": "NaN"}
    with SessionDB(tmp_path / "state.db") as db:
        with pytest.raises(InvalidInputError, match=r"^line 1: estimated_cost_usd holds NaN"):
            transfer.import_sessions(db, [(1, session("s", estimated_cost_usd=nan))])
        assert db.get_session("s") is None
