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


#: Ids whose names once met: the same first 12 characters (the agent's timestamp ids), or
#: the same once what a portable name cannot hold is left out (non-ASCII, ``~``, ``:``, ``/``,
#: a leading dot), or the same but for case (one file on a case-insensitive file system).
CLASHING_IDS = [
    "20250612_143022_a1b2c3",
    "20250612_143025_d4e5f6",
    "会话一",
    "会话二",
    "a~b",
    "a:b",
    "a/b",
    "../a b",
    ".hidden",
    "Case",
    "case",
]
#: Two ids whose names agree but for the digest of the id, and whose first 8 hex digits of
#: that digest agree too (found by search): the export must give them two files all the same.
SAME_SHORT_DIGEST = ["s~ŁśŃ", "s~ćĄłĘŁ"]


def _import(path: Path, ids: list[str], title: str | None = None) -> SessionDB:
    """A store at ``path`` holding ``ids``, started the same second, each with one message
    naming its session."""
    db = SessionDB(path)
    records = [
        {
            "id": sid,
            "source": "cli",
            "started_at": 1_749_738_622.0,
            "title": title if n == 0 else None,
            "messages": [{"role": "user", "timestamp": 1_749_738_623.0, "content": f"<{sid}>"}],
        }
        for n, sid in enumerate(ids)
    ]
    transfer.import_sessions(db, enumerate(records, 1))
    return db


def _pages(store: SessionDB, folder: Path) -> dict[str, str]:
    """Every session of ``store`` exported one file per session into ``folder``: name, text."""
    records, total = transfer.export_records(store)
    report = transfer.write_records(records, str(folder), store.engine.url, fmt="md", split=True)
    assert report.sessions == total
    return {page.name: page.read_text(encoding="utf-8") for page in folder.iterdir()}


@pytest.mark.parametrize("ids", [CLASHING_IDS, SAME_SHORT_DIGEST], ids=["readable", "digest"])
def test_every_session_gets_a_page_of_its_own(tmp_path: Path, ids: list[str]) -> None:
    """One file per session, holding that session's messages and no other's; the names are
    safe (no separator, no leading dot, bounded), distinct even to a case-insensitive file
    system, and the same at every export: one into the same folder replaces the pages."""
    with _import(tmp_path / "state.db", ids) as store:
        pages = _pages(store, tmp_path / "out")
        assert len(pages) == len(ids)
        assert len({name.casefold() for name in pages}) == len(ids)
        for sid in ids:
            holding = [name for name, text in pages.items() if f"<{sid}>" in text]
            assert len(holding) == 1, (sid, holding)
            assert f"`{sid}`" in pages[holding[0]]
        for name in pages:
            assert "/" not in name and not name.startswith(".") and name.endswith(".md")
            assert len(name.encode()) <= 200
        assert _pages(store, tmp_path / "again").keys() == pages.keys()
        assert _pages(store, tmp_path / "out") == pages


def test_page_names_stay_bounded_and_readable(tmp_path: Path) -> None:
    """The longest title the store keeps, of 4-byte characters, and a long id: the name fits a
    file system's 255 bytes with the temp file's prefix and suffix, and still says the day,
    the title and the id."""
    sid = "20250612_143022_" + "x" * 200
    with _import(tmp_path / "state.db", [sid], title="𠀀" * 100) as store:
        (name,) = _pages(store, tmp_path / "out")
    assert len(name.encode()) + len(".") + len(".XXXXXXXX") <= 255
    assert name.startswith("2025-06-12-𠀀𠀀") and "-20250612_143022_xxx" in name


def test_a_page_is_never_written_over_another_sessions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should two sessions' names agree even with the whole digest, the export stops at the
    second rather than replace the first's page."""
    from hermes_store import markdown

    monkeypatch.setattr(markdown, "file_name", lambda record, digest=8: "same.md")
    store = _import(tmp_path / "state.db", ["one", "two"])
    with store, pytest.raises(InvalidInputError, match="another session's page"):
        _pages(store, tmp_path / "out")
    (page,) = (tmp_path / "out").iterdir()
    text = page.read_text(encoding="utf-8")
    assert page.name == "same.md" and ("<one>" in text) != ("<two>" in text)


def test_the_report_counts_what_the_export_left_out_or_marked(
    store: SessionDB, tmp_path: Path
) -> None:
    """What no import could restore (a message whose session is gone, a session stored with
    no id) is left out and counted, and so is each value written as a marked object: a
    caller of the library sees the export is not a whole copy, as the command line says."""
    import sqlite3

    with sqlite3.connect(tmp_path / "state.db") as con:  # as the original store could leave it
        con.execute(
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "VALUES ('ghost', 'user', 'orphan', 1.0)"
        )
        con.execute("INSERT INTO sessions (id, source, started_at) VALUES (NULL, 'cli', 1.0)")
        con.execute("UPDATE sessions SET input_tokens = 'abc' WHERE id = 'first'")
    report = transfer.ExportReport()
    records, _ = transfer.export_records(store, report=report)
    out = tmp_path / "export.jsonl"
    transfer.write_records(records, str(out), store.engine.url, report=report)
    assert (report.sessions, report.messages, report.values_marked) == (2, 3, 1)
    assert (report.orphan_messages, report.sessions_without_id) == (1, 1)
    first = next(r for r in map(json.loads, out.read_text().splitlines()) if r["id"] == "first")
    assert first["input_tokens"] == {"$sqlite": "text", "value": "abc"}
