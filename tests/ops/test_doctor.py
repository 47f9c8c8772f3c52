"""``doctor`` never takes the write lock and stays bounded, at any size, and still finds damage.

A file up to ``SMALL_FILE_BYTES`` has its full-text indexes checked whole by FTS5 on a snapshot
copy; a larger one (here: the limit set to 0) by reads only (document counts and sampled
look-ups), with ``full`` adding every check on a snapshot copy. Both ways are run on small
scratch files: "large" is the limit, not the bytes. That no write lock is taken is shown by
another connection holding it from before the doctor starts until after it ends (a doctor
that asked for it would wait its busy timeout, then fail); the writer beside it (slow tier)
is a process appending one message after another.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.engine.factory import to_url
from hermes_store.ops import health, maintenance
from tests.support import fts_damage_workers as workers
from tests.support.read_only import read_only_folder

#: A hang guard only: every wait is on an event or a pipe.
DEADLINE = 120.0
SIZES = ("small", "large")


def _url(path: Path) -> URL:
    return to_url(path)


def _sized(monkeypatch: pytest.MonkeyPatch, size: str) -> None:
    """Every file is "large" when the limit is 0."""
    if size == "large":
        monkeypatch.setattr(health, "SMALL_FILE_BYTES", 0)


def _statuses(checks: list[health.Check]) -> dict[str, str]:
    return {check.name: check.status for check in checks}


def _detail(checks: list[health.Check], name: str) -> str:
    return next(check.detail for check in checks if check.name == name)


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """25 sessions of 10 messages (every fifth a tool output, 5% CJK): fewer than the sample,
    so the sampled check of a "large" file looks at every one of them."""
    path = tmp_path_factory.mktemp("doctor") / "history.db"
    workers.build_history(path, sessions=25, per_session=10)
    return path


@pytest.fixture
def state(history: Path, tmp_path: Path) -> Path:
    path = tmp_path / "state.db"
    shutil.copy(history, path)
    return path


@contextmanager
def write_lock_held(path: Path) -> Iterator[None]:
    """Another connection holds the write lock (an uncommitted append) throughout."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "VALUES ('old-000000', 'user', 'not yet committed', 1.0)"
        )
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("full", [False, True])
def test_doctor_runs_while_another_connection_holds_the_write_lock(
    state: Path, size: str, full: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: FTS5's 'integrity-check' (an INSERT) and the CJK index's comparison with
    ``messages`` ran in a write transaction on the live file (minutes at 2 GB)."""
    _sized(monkeypatch, size)
    with write_lock_held(state):
        checks = health.run_doctor(_url(state), full=full)
    statuses = _statuses(checks)
    assert all(status in ("ok", "info") for status in statuses.values()), checks
    assert statuses["full-text index"] == "ok"
    assert statuses["integrity_check"] == "ok"
    if full:
        assert statuses["full check (snapshot)"] == "ok"
    assert not list(state.parent.glob(".hermes-doctor-*"))  # the snapshots are removed


@pytest.mark.parametrize("size", SIZES)
def test_doctor_reads_a_database_in_a_read_only_folder(
    history: Path, tmp_path: Path, size: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As every read command reads it: ``immutable``, since SQLite cannot create the ``-shm``
    a WAL read needs there. Every check still runs (damage is still found), the folder is
    reported, and nothing is created in it. Before, the doctor opened it as a writable file
    and failed (exit 3) where the other read commands worked."""
    _sized(monkeypatch, size)
    folder = tmp_path / "archive"
    folder.mkdir()
    sound, damaged = folder / "state.db", folder / "damaged.db"
    shutil.copy(history, sound)
    shutil.copy(history, damaged)
    _unindex(damaged, "messages_fts", _latin_message(damaged))
    before = sorted(folder.iterdir())
    with read_only_folder(folder):
        checks = health.run_doctor(_url(sound), full=True)
        found = health.run_doctor(_url(damaged))
        shown = CliRunner().invoke(cli, ["--db", str(sound), "doctor", "--format", "tsv"])
    statuses = _statuses(checks)
    assert statuses["folder"] == "warn" and "read-only" in _detail(checks, "folder"), checks
    assert "error" not in statuses.values(), checks
    for name in ("integrity_check", "full-text index", "orphan messages", "WAL file"):
        assert statuses[name] == "ok", checks
    assert statuses["full check (snapshot)"] == "ok", checks
    assert _statuses(found)["full-text index"] == "error", found
    assert shown.exit_code == 0, shown.output
    assert "folder\twarn" in shown.stdout and "Traceback" not in shown.output
    assert sorted(folder.iterdir()) == before  # no -wal, -shm, lock file or snapshot folder


def _unindex(path: Path, table: str, message_id: int) -> None:
    """One message removed from the full-text ``table`` behind the triggers' back."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        content = conn.execute("SELECT content FROM messages WHERE id = ?", (message_id,))
        conn.execute(
            f"INSERT INTO {table}({table}, rowid, content) VALUES ('delete', ?, ?)",
            (message_id, content.fetchone()[0]),
        )


def _swap_in_index(path: Path, message_id: int) -> None:
    """One message indexed with other words (counts stay equal, look-ups fail)."""
    _unindex(path, "messages_fts", message_id)
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "INSERT INTO messages_fts(rowid, content) VALUES (?, 'zzzunrelated zzzwords')",
            (message_id,),
        )


def _first_id(path: Path, query: str) -> int:
    with closing(sqlite3.connect(path)) as conn:
        return int(conn.execute(query).fetchone()[0])


def _cjk_message(path: Path) -> int:
    return _first_id(path, "SELECT min(id) FROM messages_cjk_docsize")


def _latin_message(path: Path) -> int:
    """A message of Latin words (the CJK ones have no whole word to look up)."""
    return _first_id(
        path,
        "SELECT min(id) FROM messages WHERE id > 5 "
        "AND id NOT IN (SELECT id FROM messages_cjk_docsize)",
    )


DAMAGE = {
    "a message missing": lambda path: _unindex(path, "messages_fts", _latin_message(path)),
    "a message indexed with other words": lambda path: _swap_in_index(path, _latin_message(path)),
    "a CJK message missing from the trigram index": lambda path: _unindex(
        path, "messages_cjk", _cjk_message(path)
    ),
    "the structure record damaged": workers.damage_structure_record,
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_doctor_finds_a_damaged_index_and_rebuild_index_repairs_it(
    state: Path, size: str, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways: FTS5's check on a snapshot (small), counts and look-ups (large)."""
    _sized(monkeypatch, size)
    DAMAGE[damage](state)
    checks = health.run_doctor(_url(state))
    assert _statuses(checks)["full-text index"] == "error", checks
    assert "--rebuild-index" in _detail(checks, "full-text index")
    health.rebuild_index(_url(state))
    assert _statuses(health.run_doctor(_url(state)))["full-text index"] == "ok"
    with SessionDB(state) as store:
        store.append_message("old-000001", "user", "the agent writes again")


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_full_finds_every_damage_on_a_large_file(
    state: Path, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--full``: FTS5's own check of every entry, on a snapshot copy."""
    _sized(monkeypatch, "large")
    monkeypatch.setattr(health, "SAMPLES", 0)  # the sample sees nothing: the copy must
    DAMAGE[damage](state)
    checks = health.run_doctor(_url(state), full=True)
    assert _statuses(checks)["full check (snapshot)"] == "error", checks


def _merge_settings(path: Path) -> dict[str, dict[str, int]]:
    with closing(sqlite3.connect(path)) as conn:
        return {
            table: dict(conn.execute(f"SELECT k, v FROM {table}_config WHERE k LIKE '%merge'"))
            for table in ("messages_fts", "messages_cjk")
        }


@pytest.mark.parametrize("size", SIZES)
def test_merge_settings_a_killed_job_left_are_reported_and_optimize_puts_them_back(
    state: Path, size: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prune, optimize or import killed mid-run leaves FTS5's automerge off (its settings
    are the table's, stored in the file): the doctor says so and names the fix."""
    _sized(monkeypatch, size)
    with closing(sqlite3.connect(state, isolation_level=None)) as conn:
        for key, value in maintenance.JOB_FTS5_SETTINGS.items():  # as a job starting writes
            conn.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES (?, ?)", (key, value))
    checks = health.run_doctor(_url(state))
    assert _statuses(checks)["full-text index"] == "warn", checks
    detail = _detail(checks, "full-text index")
    assert "automatic merging is off for messages_fts" in detail
    assert "messages_cjk" not in detail
    assert "db optimize" in detail
    with SessionDB(state) as store:
        maintenance.optimize(store.uow)
    assert _merge_settings(state)["messages_fts"] == {"automerge": 4, "crisismerge": 16}
    assert _statuses(health.run_doctor(_url(state)))["full-text index"] == "ok"


@pytest.mark.parametrize("size", SIZES)
def test_a_spent_budget_warns_and_never_passes_silently(
    state: Path, size: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sized(monkeypatch, size)
    monkeypatch.setattr(health, "CLOCK_EVERY_OPS", 1)
    checks = health.run_doctor(_url(state), budget_s=1e-9)
    statuses = _statuses(checks)
    assert statuses["full-text index"] == "warn", checks
    assert "time budget" in _detail(checks, "full-text index")
    assert "error" not in statuses.values()


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_a_writer_beside_the_doctor_never_fails(
    state: Path, size: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process appends one message after another through SessionDB while every
    check runs (``full`` included); it never fails and the file stays sound."""
    _sized(monkeypatch, size)
    context = mp.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    receiver, sender = context.Pipe(duplex=False)
    writer = context.Process(
        target=workers.append_until_stopped, args=(str(state), ready, stop, sender)
    )
    writer.start()
    try:
        assert ready.wait(DEADLINE)
        for _ in range(3):
            checks = health.run_doctor(_url(state), full=True)
            assert "error" not in _statuses(checks).values(), checks
    finally:
        stop.set()
        assert receiver.poll(DEADLINE)
        appended, failure = receiver.recv()
        writer.join(DEADLINE)
    assert failure is None
    assert appended > 0
    assert "error" not in _statuses(health.run_doctor(_url(state), full=True)).values()


def test_doctor_warns_of_synchronous_commit_off(pg_url: URL) -> None:
    """A commit acknowledged before it is on disk: a server crash loses the last ones. It was
    listed as plain information ("a failover has nothing to promote")."""
    url = pg_url.update_query_dict({"options": "-c synchronous_commit=off"})
    [replication] = [check for check in health.run_doctor(url) if check.name == "replication"]
    assert replication.status == "warn", replication
    assert "synchronous_commit = off" in replication.detail
    [normal] = [check for check in health.run_doctor(pg_url) if check.name == "replication"]
    assert normal.status == "info", normal
