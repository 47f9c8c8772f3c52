"""Applications that import the store can type-check against its row types (``py.typed``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hermes_store import SessionDB

APP = Path(__file__).resolve().parent / "typing_app"


def _mypy(target: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy", reason="mypy is part of the test extra")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # outside the checkout: the installed package's py.typed is what counts
    )


@pytest.mark.slow
def test_a_sample_app_type_checks_strictly(tmp_path: Path) -> None:
    result = _mypy(APP / "app.py", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_the_row_types_catch_misuse(tmp_path: Path) -> None:
    result = _mypy(APP / "wrong.py", tmp_path)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 3, result.stdout
    assert any("no_such_column" in line for line in errors)
    assert any("snipet" in line for line in errors)
    assert any("Incompatible types in assignment" in line for line in errors)


def test_the_row_types_name_exactly_the_keys_the_store_returns(store: SessionDB) -> None:
    """The TypedDicts are documentation a type checker enforces: they must match reality."""
    from typing import get_type_hints

    from hermes_store import rows

    def keys(kind: type) -> set[str]:
        return set(get_type_hints(kind))

    store.create_session("s", "cli", model="m")
    store.append_message("s", "user", "typed rows for the checker", tool_calls=[{"id": "1"}])
    session = store.get_session("s")
    assert session is not None and set(session) == keys(rows.SessionRow)
    (message,) = store.get_messages("s")
    assert set(message) == keys(rows.MessageRow)
    (listed,) = store.list_sessions_rich()
    assert set(listed) | {"_lineage_root_id"} == keys(rows.SessionListRow)
    (hit,) = store.search_messages("typed")
    assert set(hit) == keys(rows.SearchHit)
    assert set(hit["context"][0]) == keys(rows.ContextLine)
    record = store.export_session("s")
    assert record is not None and set(record) == keys(rows.ExportRecord)
    (turn,) = store.get_messages_as_conversation("s")
    assert set(turn) <= keys(rows.ConversationTurn)
