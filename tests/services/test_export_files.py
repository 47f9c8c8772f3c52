"""``transfer.write_records``: exported sessions written as JSON Lines, one Markdown document,
or one Markdown file per session, redacted on request, as the ``export`` command writes them."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hermes_store import InvalidInputError, SessionDB, transfer
from hermes_store.engine.factory import to_url

SECRET = "sk-proj-Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SessionDB]:
    with SessionDB(tmp_path / "state.db") as db:
        db.create_session("first", "cli")
        db.set_session_title("first", "Deploy plan")
        db.append_message("first", "user", f"export OPENAI_API_KEY={SECRET}")
        db.append_message("first", "assistant", "noted")
        db.create_session("second", "telegram")
        db.append_message("second", "user", "hello")
        yield db


def _write(
    store: SessionDB,
    output: Path | str,
    *,
    fmt: str = "jsonl",
    split: bool = False,
    redacted: bool = False,
    on_record: Callable[[], None] | None = None,
) -> transfer.ExportReport:
    """Every session of ``store`` written to ``output``."""
    records, total = transfer.export_records(store)
    assert total == 2
    return transfer.write_records(
        records,
        str(output),
        store.engine.url,
        fmt=fmt,
        split=split,
        redacted=redacted,
        on_record=on_record,
    )


def test_json_lines_round_trip(store: SessionDB, tmp_path: Path) -> None:
    taken: list[None] = []
    out = tmp_path / "export.jsonl"
    report = _write(store, out, on_record=lambda: taken.append(None))
    assert (report.sessions, report.messages, len(taken)) == (2, 3, 2)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == ["first", "second"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert SECRET in out.read_text()
    copy = SessionDB(tmp_path / "copy.db")
    with out.open("rb") as handle:
        imported = transfer.import_sessions(copy, transfer.read_records(handle, lambda n: None))
    assert (imported.sessions, imported.messages) == (2, 3)
    copy.close()


def test_redacted_markdown_document(store: SessionDB, tmp_path: Path) -> None:
    out = tmp_path / "export.md"
    report = _write(store, out, fmt="md", redacted=True)
    text = out.read_text()
    assert (report.sessions, report.messages) == (2, 3)
    assert "Deploy plan" in text and "hello" in text and SECRET not in text


def test_one_markdown_file_per_session_in_a_private_folder(
    store: SessionDB, tmp_path: Path
) -> None:
    folder = tmp_path / "nested" / "conversations"
    report = _write(store, folder, fmt="md", split=True)
    names = sorted(p.name for p in folder.iterdir())
    assert report.sessions == len(names) == 2
    assert any("deploy-plan" in name for name in names)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_stdout(store: SessionDB, capsys: pytest.CaptureFixture[str]) -> None:
    report = _write(store, "-")
    assert report.sessions == 2 and len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.parametrize(
    ("fmt", "split", "output"),
    [("csv", False, "out"), ("jsonl", True, "out"), ("md", True, "-")],
    ids=["unknown-format", "split-json-lines", "split-to-stdout"],
)
def test_impossible_combinations_are_refused(
    store: SessionDB, tmp_path: Path, fmt: str, split: bool, output: str
) -> None:
    with pytest.raises(InvalidInputError):
        _write(store, output if output == "-" else tmp_path / output, fmt=fmt, split=split)
    assert not (tmp_path / "out").exists()


def test_the_database_itself_is_never_the_target(store: SessionDB, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="database itself"):
        _write(store, tmp_path / "state.db")
    assert store.session_count() == 2


def test_nothing_to_write_writes_an_empty_file(tmp_path: Path) -> None:
    with SessionDB(tmp_path / "state.db") as db:
        records, _ = transfer.export_records(db, session_id="missing")
        out = tmp_path / "none.jsonl"
        report = transfer.write_records(records, str(out), to_url(tmp_path / "state.db"))
    assert (report.sessions, report.messages, out.read_text()) == (0, 0, "")
