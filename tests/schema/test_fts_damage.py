"""The full-text index survives maintenance beside a writer; a damaged one is found and repaired.

The damage: ``db optimize`` merged the FTS5 index with ``('merge', -64)`` at every step. A
negative count starts a merge of every segment, and FTS5 (SQLite 3.40) gives the restarted
merge a new level whenever a segment sits outside the merging one, as each insert of a writer
between two steps leaves one: two levels a step, a merge that never ends, and at 2,001 levels
FTS5 refuses its own structure record, so every statement on ``messages_fts`` fails (appends,
search, 'rebuild', DROP TABLE) while ``PRAGMA integrity_check`` still says ok. Scratch files
give a small file the leaf count of a large one with FTS5's ``pgsz`` option (the job's step
budget follows the leaf count).
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from click.testing import CliRunner

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.ops import maintenance, retention
from hermes_store.schema import fulltext
from tests.support import fts_damage_workers as workers

T = TypeVar("T")

#: A hang guard only: every wait is on an event or a pipe.
DEADLINE = 120.0
#: FTS5's ``crisismerge`` (default 16): a level that reaches it is merged at once, so no level
#: of a working index holds more segments.
CRISIS_MERGE = 16


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A year of 320 ended sessions (3,200 messages, 14 MB) whose index has ~160k leaves:
    a job budget of ~2,500 merge steps, more than the ~1,000 that broke the index, and still
    over 1,100 once a prune (which leaves the index's big segments to optimize) took half."""
    path = tmp_path_factory.mktemp("fts-damage") / "history.db"
    workers.build_history(path, sessions=320, per_session=10, page_size=32)
    return path


def _copy(source: Path, target: Path) -> Path:
    shutil.copy(source, target)
    return target


def _levels(path: Path) -> tuple[int, int, list[int]]:
    """(levels, segments, segments on each level) from the structure record, decoded here
    (not by the library under test): a 4-byte cookie, then varints: the level and segment
    counts, the write counter, then per level its merge count and segment count, each
    segment's id and first and last page."""
    conn = sqlite3.connect(path)
    try:
        block = conn.execute("SELECT block FROM messages_fts_data WHERE id = 10").fetchone()[0]
    finally:
        conn.close()
    assert block[4:8] != b"\xff\x00\x00\x01", "a structure record of FTS5's second format"
    at = 4

    def varint() -> int:
        nonlocal at
        value = 0
        while True:
            byte = block[at]
            at += 1
            value = (value << 7) | (byte & 0x7F)
            if not byte & 0x80:
                return value

    levels, segments, _writes = varint(), varint(), varint()
    per_level = []
    for _ in range(levels):
        _merging, count = varint(), varint()
        per_level.append(count)
        for _ in range(3 * count):
            varint()
    assert sum(per_level) == segments
    return levels, segments, per_level


def _fts5_check(path: Path, table: str = "messages_fts") -> str | None:
    """FTS5's own integrity-check of ``table``: None when sound, else the error."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(fulltext.integrity_statement(table))
    except sqlite3.DatabaseError as error:
        return str(error)
    finally:
        conn.close()
    return None


@pytest.mark.slow
def test_merge_steps_interleaved_with_appends_keep_the_index_sound(
    history: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic: another process appends one message through SessionDB after every step
    of the job (lock-step over a pipe). Every step merges ``MERGE_PAGES`` pages, as the job
    did when it broke the index (its pace would otherwise make the steps larger and fewer)."""
    monkeypatch.setattr(maintenance, "MAX_MERGE_PAGES", maintenance.MERGE_PAGES)
    path = _copy(history, tmp_path / "state.db")
    context = mp.get_context("spawn")
    pipe, child = context.Pipe()
    writer = context.Process(target=workers.append_on_request, args=(str(path), child))
    writer.start()
    answers: list[int | str] = []
    job = SessionDB(path)
    run = job.uow.run

    def step_then_append(fn: Callable[[Any], T], *args: Any, **kwargs: Any) -> T:
        result = run(fn, *args, **kwargs)
        pipe.send(len(answers))
        assert pipe.poll(DEADLINE), "the writer process did not answer"
        answers.append(pipe.recv())
        return result

    try:
        assert pipe.poll(DEADLINE) and pipe.recv() == "ready"
        with job.uow.connect(write=False) as conn:
            budget = fulltext.SQLITE.leaf_pages(conn) // maintenance.MERGE_PAGES
        assert budget > 1_100, "the scratch file must give the job the budget that broke it"
        job.uow.run = step_then_append  # type: ignore[method-assign]
        steps = maintenance.merge_index(job.uow)
    finally:
        job.uow.run = run  # type: ignore[method-assign]
        pipe.send(None)
        writer.join(DEADLINE)
        job.close()
    # Before: two levels a step, and at step ~1,000 the append failed (NotADatabaseError:
    # database disk image is malformed), then every statement on messages_fts.
    failures = [answer for answer in answers if isinstance(answer, str)]
    assert failures == []
    assert len(answers) == steps
    levels, segments, _per_level = _levels(path)
    assert levels <= 12
    assert segments <= 16
    assert _fts5_check(path) is None
    assert _fts5_check(path, "messages_cjk") is None
    with SessionDB(path) as store:
        assert len(store.search_messages("mergeable", limit=50)) == 50


@pytest.mark.slow
def test_prune_then_optimize_beside_a_writer_process_keeps_the_index_sound(
    history: Path, tmp_path: Path
) -> None:
    """The issue's sequence: ``sessions prune`` then ``db optimize`` (online) while another
    process appends to a live session through SessionDB."""
    path = _copy(history, tmp_path / "state.db")
    context = mp.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    receiver, sender = context.Pipe(duplex=False)
    writer = context.Process(
        target=workers.append_until_stopped, args=(str(path), ready, stop, sender)
    )
    writer.start()
    store = SessionDB(path)
    try:
        assert ready.wait(DEADLINE)
        pruned = retention.run(store.uow, retention.Policy(180), chunk=200)
        assert pruned.sessions > 90
        with store.uow.connect(write=False) as conn:
            budget = fulltext.SQLITE.leaf_pages(conn) // maintenance.MERGE_PAGES
        assert budget > 1_100, "the scratch file must give the job the budget that broke it"
        maintenance.optimize(store.uow)
    finally:
        stop.set()
        assert receiver.poll(DEADLINE), "the writer process did not report"
        appended, failure = receiver.recv()
        writer.join(DEADLINE)
        store.close()
    # Before: optimize failed with "database disk image is malformed", 2,002 levels.
    assert failure is None
    assert appended > 100
    # The writer goes on appending until it sees ``stop``: each append leaves a segment, so
    # how many there are depends on the machine's load; what a working merge bounds is the
    # depth and the segments of each level.
    levels, _segments, per_level = _levels(path)
    assert levels <= 12
    assert max(per_level) <= CRISIS_MERGE
    assert _fts5_check(path) is None
    assert _fts5_check(path, "messages_cjk") is None


def test_doctor_finds_a_damaged_structure_record_and_rebuild_index_repairs_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        store.append_message("s", "user", "a needle in the index")
        store.append_message("s", "user", "東京の天気は晴れです")
    workers.damage_structure_record(path)
    assert _fts5_check(path) == "vtable constructor failed: messages_fts"
    runner = CliRunner()

    doctor = runner.invoke(cli, ["--db", str(path), "doctor", "--json"])
    assert doctor.exit_code == 1, doctor.output
    line = next(c for c in _json_lines(doctor.stdout) if c["name"] == "full-text index")
    assert line["status"] == "error"
    assert "structure record damaged" in line["detail"]

    repaired = runner.invoke(cli, ["--db", str(path), "doctor", "--rebuild-index"])
    assert repaired.exit_code == 0, repaired.output
    assert _fts5_check(path) is None
    with SessionDB(path) as store:
        store.append_message("s", "user", "the agent writes again")
        assert len(store.search_messages("needle")) == 1
        assert len(store.search_messages("天気")) == 1


def test_doctor_warns_of_a_structure_near_fts5s_limit_and_rebuild_makes_it_shallow(
    tmp_path: Path,
) -> None:
    """1,500 empty levels: readable still, but a few hundred more starts of a full merge
    would break it, so the job stops starting them and the doctor says what to do."""
    path = tmp_path / "state.db"
    SessionDB(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    levels = 1_500
    deep = bytes(4) + bytes([0x80 | (levels >> 7), levels & 0x7F]) + bytes(2) + bytes(2 * levels)
    conn.execute("UPDATE messages_fts_data SET block = ? WHERE id = 10", (deep,))
    conn.close()
    assert _fts5_check(path) is None  # FTS5 itself finds nothing wrong
    runner = CliRunner()

    doctor = runner.invoke(cli, ["--db", str(path), "doctor", "--json"])
    line = next(c for c in _json_lines(doctor.stdout) if c["name"] == "full-text index")
    assert line["status"] == "warn", line
    assert "1500 levels" in line["detail"]

    with SessionDB(path) as store:
        report = maintenance.optimize(store.uow)
    assert any("1500 levels" in note for note in report.notes)
    assert _levels(path)[0] == levels  # no start, so no level added

    assert runner.invoke(cli, ["--db", str(path), "doctor", "--rebuild-index"]).exit_code == 0
    assert _levels(path)[0] < 5


def test_offline_vacuum_refuses_a_file_whose_index_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        store.append_message("s", "user", "text")
    workers.damage_structure_record(path)
    before = path.read_bytes()

    result = CliRunner().invoke(cli, ["--db", str(path), "db", "optimize", "--vacuum"])
    assert result.exit_code == 3, result.output
    assert "damaged, so it was not vacuumed" in result.output
    assert "messages_fts" in result.output
    assert path.read_bytes() == before

    # Online, the job says so before its first step instead of failing inside one.
    online = CliRunner().invoke(cli, ["--db", str(path), "db", "optimize"])
    assert online.exit_code == 3, online.output
    assert "doctor --rebuild-index" in online.output


def test_incremental_vacuum_frees_up_to_its_page_count_per_step(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        for number in range(40):
            store.create_session(f"s{number}", "cli")
            store.append_message(f"s{number}", "tool", "output " * 4_000)
            store.end_session(f"s{number}", "done")
    maintenance.vacuum_offline(path)  # turns on auto_vacuum=INCREMENTAL
    with SessionDB(path) as store:
        store.prune_sessions(older_than_days=-1)
        report = maintenance.optimize(store.uow)
    assert report.pages_freed > 100
    # Before: one page per step (the statement was stepped once), so one step per page.
    assert report.vacuum_steps <= report.pages_freed // maintenance.VACUUM_PAGES + 2, report


def _json_lines(output: str) -> list[dict[str, Any]]:
    import json

    data = json.loads(output)
    return list(data["checks"] if isinstance(data, dict) else data)
