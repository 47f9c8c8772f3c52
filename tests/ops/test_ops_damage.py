"""Operations on a damaged or oddly named database: a prune refuses a full-text index that lost
pages before it deletes anything, and says what it had committed when it fails midway; the
doctor reports a file with a second name (a hard link) as a problem; a backup onto a dangling
symbolic link is refused as a link, and replaces the link only with ``--force``; what a killed
backup left beside its target is removed by the next backup there.

The damage is made with plain ``sqlite3`` on real files: the leaf pages
of the index deleted (every segment loses its pages: a few reads see it), or overwritten with
zeros (the rows are there: only a merge that reads them fails, after a step committed).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy.engine import URL

from hermes_store import NotADatabaseError, SessionDB
from hermes_store.cli import cli
from hermes_store.engine.factory import to_url
from hermes_store.errors import InvalidInputError
from hermes_store.ops import backup, health, retention
from hermes_store.schema import fulltext
from tests.support.proc_workers import back_up_until_killed
from tests.support.waiting import GUARD

SESSIONS = 30


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "HERMES_STORE_URL": None})


def _run(runner: CliRunner, db: Path, *args: str) -> Result:
    return runner.invoke(cli, ["--db", str(db), *args], catch_exceptions=False)


def _history(path: Path, sessions: int = SESSIONS) -> None:
    """``sessions`` sessions of three messages each (one index segment per session), every
    other one ended: what a prune of ``--older-than 0`` deletes."""
    with SessionDB(path) as store:
        for number in range(sessions):
            sid = f"s{number}"
            store.create_session(sid, "cli")
            text = f"hello world number{number} " + "x" * 200
            store.append_messages(sid, [{"role": "user", "content": text}] * 3)
            if number % 2 == 0:
                store.end_session(sid, "done")


def _damage(path: Path, how: str) -> None:
    """``lost``: every leaf page of the index deleted; ``zeroed``: overwritten with zeros."""
    statement = {
        "lost": "DELETE FROM messages_fts_data WHERE id > 10",
        "zeroed": "UPDATE messages_fts_data SET block = zeroblob(length(block)) WHERE id > 10",
    }[how]
    with closing(sqlite3.connect(path)) as raw, raw:
        raw.execute(statement)


def _rows(path: Path) -> dict[str, object]:
    """What a prune could change: the rows, and every row of the index's own tables."""
    with closing(sqlite3.connect(path)) as raw:
        return {
            table: raw.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("sessions", "messages", "messages_fts_data", "messages_fts_config")
        }


# -- a prune on a damaged full-text index ---------------------------------------------------------


def test_a_prune_refuses_an_index_that_lost_pages_before_it_deletes_anything(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    _history(path)
    _damage(path, "lost")
    before = _rows(path)
    refused = pytest.raises(NotADatabaseError, match="doctor --rebuild-index")
    with SessionDB(path) as store, refused as raised:
        retention.run(store.uow, retention.Policy(0))
    assert "Nothing was deleted" in str(raised.value)
    assert "messages_fts" in str(raised.value)
    assert _rows(path) == before  # no delete, no delete record, no job setting written
    with SessionDB(path) as store, pytest.raises(NotADatabaseError, match="Nothing was deleted"):
        store.prune_sessions(older_than_days=-1)  # the one-transaction prune: the same check
    assert _rows(path) == before


def test_the_cli_prune_refuses_a_damaged_index_and_names_the_repair(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    _history(path)
    _damage(path, "lost")
    before = _rows(path)
    result = _run(runner, path, "sessions", "prune", "--older-than", "0", "--yes")
    assert result.exit_code == 3, result.output
    assert "`hermes-store doctor --rebuild-index`" in result.stderr
    assert "Nothing was deleted" in result.stderr
    assert _rows(path) == before
    # The named repair makes the prune work.
    assert _run(runner, path, "doctor", "--rebuild-index").exit_code == 0
    done = _run(runner, path, "sessions", "prune", "--older-than", "0", "--yes", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["sessions"] == SESSIONS // 2


def test_a_prune_that_fails_midway_says_what_it_had_deleted(tmp_path: Path) -> None:
    """The zeroed pages are all there, so the up-front reads pass; the first merge of them
    fails after the first step committed, and the error says what landed."""
    path = tmp_path / "state.db"
    _history(path)
    _damage(path, "zeroed")
    report = retention.Report()
    with SessionDB(path) as store, pytest.raises(NotADatabaseError) as raised:
        retention.run(store.uow, retention.Policy(0), chunk=1, report=report)
    assert report.sessions >= 1 and report.messages == 3 * report.sessions
    notes = getattr(raised.value, "__notes__", [])
    assert notes == [
        f"retention: {report.sessions} session(s) and {report.messages} message(s) were "
        "deleted before it stopped (whole steps, committed); the others are kept"
    ]
    with closing(sqlite3.connect(path)) as raw:
        left = raw.execute("SELECT count(*) FROM sessions").fetchone()[0]
    assert left == SESSIONS - report.sessions


def test_the_cli_prune_that_fails_midway_says_what_it_had_deleted(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    _history(path)
    _damage(path, "zeroed")
    result = _run(runner, path, "sessions", "prune", "--older-than", "0", "--yes", "--chunk", "1")
    assert result.exit_code == 3, result.output
    with closing(sqlite3.connect(path)) as raw:
        deleted = SESSIONS - raw.execute("SELECT count(*) FROM sessions").fetchone()[0]
    assert deleted >= 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert (
        f"The prune stopped there: {deleted} session(s) and {3 * deleted} message(s) were "
        "deleted (whole steps); the others are kept." in lines[0]
    )


def test_the_up_front_check_passes_a_sound_index_mid_merge(tmp_path: Path) -> None:
    """A merge in progress leaves segments whose first pages are gone (their first page is
    then a later one): no damage, and the prune goes on."""
    path = tmp_path / "state.db"
    _history(path, sessions=60)
    with closing(sqlite3.connect(path, isolation_level=None)) as raw:
        raw.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES ('merge', -2)")
        raw.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES ('merge', 1)")
        block = raw.execute("SELECT block FROM messages_fts_data WHERE id = 10").fetchone()[0]
        present = {row[0] for row in raw.execute("SELECT id FROM messages_fts_data")}
    segments = fulltext.index_segments(block)
    assert segments and all(
        (segment << 37) | page in present
        for segment, first, last in segments
        for page in range(first, last + 1)
    )
    with SessionDB(path) as store:
        with store.uow.connect(write=False) as conn:
            assert fulltext.missing_index_pages(conn) == []
        report = retention.run(store.uow, retention.Policy(0))
    assert report.sessions == 30


def test_a_prune_fills_the_report_it_is_given_on_both_backends(store: SessionDB) -> None:
    for number in range(3):
        store.create_session(f"old{number}", "cli")
        store.append_message(f"old{number}", "user", "old words")
        store.end_session(f"old{number}", "done")
    given = retention.Report()
    returned = retention.run(store.uow, retention.Policy(0), chunk=1, report=given)
    assert returned is given
    assert (given.sessions, given.messages, given.chunks) == (3, 3, 3)


# -- the doctor and a file with a second name ----------------------------------------------------


def test_the_doctor_reports_a_hard_linked_database_as_a_problem(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    _history(path, sessions=2)
    other = tmp_path / "other.db"
    os.link(path, other)
    result = _run(runner, path, "doctor", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["ok"] is False
    names = next(check for check in report["checks"] if check["name"] == "file names")
    assert names["status"] == "error"
    assert f"also named {other}" in names["detail"]
    table = _run(runner, path, "doctor")
    assert table.exit_code == 1 and "Problems found." in table.output
    full = _run(runner, path, "doctor", "--full")  # no copy through the alias: still a report
    assert full.exit_code == 1 and "Problems found." in full.output
    other.unlink()
    healthy = _run(runner, path, "doctor", "--json")
    assert healthy.exit_code == 0, healthy.output
    assert {c["name"]: c["status"] for c in json.loads(healthy.output)["checks"]}[
        "file names"
    ] == "ok"


@pytest.mark.parametrize("size", ["small", "large"])
def test_the_doctor_names_the_leaf_pages_an_index_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: str
) -> None:
    if size == "large":
        monkeypatch.setattr(health, "SMALL_FILE_BYTES", 0)
    path = tmp_path / "state.db"
    _history(path, sessions=4)
    _damage(path, "lost")
    url: URL = to_url(path)
    checks = health.run_doctor(url)
    index = next(check for check in checks if check.name == "full-text index")
    assert index.status == "error"
    assert "leaf page(s) its segments list are missing" in index.detail
    assert "doctor --rebuild-index" in index.detail


# -- a backup onto a dangling symbolic link ------------------------------------------------------


def test_a_backup_onto_a_dangling_symlink_is_refused_as_a_link(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    _history(path, sessions=2)
    absent = tmp_path / "absent.db"
    link = tmp_path / "dangling"
    link.symlink_to(absent)
    with SessionDB(path) as store, pytest.raises(InvalidInputError, match="dangling symbolic"):
        backup.backup(store.engine, link)
    result = _run(runner, path, "backup", str(link))
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == (
        f"Error: {link} is a dangling symbolic link: {absent} does not exist "
        "(use --force to replace the link itself)"
    )
    assert link.is_symlink() and not absent.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no copy left
    # --force replaces the link itself, as for a link to anything else: nothing is created
    # where it pointed.
    forced = _run(runner, path, "backup", str(link), "--force")
    assert forced.exit_code == 0, forced.output
    assert not link.is_symlink() and link.is_file() and not absent.exists()
    with SessionDB(link) as copy:
        assert copy.get_session("s0") is not None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_what_a_killed_backup_left_is_removed_by_the_next_backup_there(
    tmp_path: Path, signum: int
) -> None:
    """A backup killed in its copy left ``.copy.db.partial-HEX`` (and its ``-journal``) beside
    the target for good: the name said nothing of whose it was, so nothing removed it. The copy
    is now ``.copy.db.PID.HEX.backup``: the next backup to that target removes what a process
    that no longer exists left, and never the copy of one still running."""
    state, out = tmp_path / "state.db", tmp_path / "out"
    out.mkdir()
    with SessionDB(state) as store:
        for n in range(40):
            store.create_session(f"s{n}", "cli")
            store.append_message(f"s{n}", "user", "x" * 3000)
    ctx = mp.get_context("spawn")
    reached, never = ctx.Event(), ctx.Event()
    backing_up = ctx.Process(
        target=back_up_until_killed, args=(str(state), str(out / "copy.db"), reached, never)
    )
    backing_up.start()
    try:
        assert reached.wait(GUARD), "the backup never reported progress"
        assert backing_up.pid is not None
        left = sorted(os.listdir(out))
        assert len(left) == 1 and left[0].startswith(f".copy.db.{backing_up.pid}.")
        os.kill(backing_up.pid, signum)
    finally:
        backing_up.join(GUARD)
    assert backing_up.exitcode == -signum
    assert os.listdir(out) == left  # nobody else removes it
    running = out / f".copy.db.{os.getpid()}.{'cd' * 8}.backup"  # a live process's copy
    running.write_bytes(b"")
    with SessionDB(state) as store:
        report = store.backup(out / "copy.db", verify=True)
    assert report.verified
    assert sorted(os.listdir(out)) == sorted(["copy.db", running.name])
    with SessionDB(out / "copy.db") as copy:
        assert len(copy.list_sessions_rich(limit=100)) == 40
