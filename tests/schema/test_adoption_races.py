"""A new path opened by hermes_store while the original store creates the same file.

hermes_store builds a new database under a private name and links it into place; when the
original store created the path first, the link fails and the file that won (the original
store's v6 file, with no Alembic row, perhaps not even finished) is opened as any existing
file is: adopted and brought to head under the write lock, never used as it is.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.schema import migrate
from tests.support import adoption_race_workers as workers
from tests.support.migration_checks import (
    CJK_OBJECTS,
    HEAD,
    alembic_revision,
    cjk_objects,
    fts_integrity_check,
    schema_version,
    table_names,
)
from tests.support.seed_store import SeedSessionDB
from tests.support.waiting import GUARD


def _after_build(monkeypatch: pytest.MonkeyPatch, start: Any) -> list[int]:
    """Run ``start()`` (the original store creating the path) once this process has built
    its new file and before it links it into place; returns the list it appends to."""
    real = migrate._close_wal
    ran: list[int] = []

    def then_the_other_process(temp: Path) -> None:
        real(temp)
        start()
        ran.append(1)

    monkeypatch.setattr(migrate, "_close_wal", then_the_other_process)
    return ran


def _assert_adopted_and_shared(path: Path) -> None:
    """At head with this package's own tables, and still the original store's file."""
    url = URL.create("sqlite", database=str(path))
    assert alembic_revision(url) == HEAD and schema_version(url) == 6
    assert "write_keys" in table_names(url)
    assert cjk_objects(path) == CJK_OBJECTS
    fts_integrity_check(path)
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".new")] == []
    seed = SeedSessionDB(path)
    try:
        assert [m["content"] for m in seed.get_messages(workers.SEED_SESSION)] == [
            workers.SEED_WORDS
        ]
        assert len(seed.search_messages("okapi")) == 1
    finally:
        seed.close()


def _use_own_tables(db: SessionDB) -> None:
    """The writes that need the revisions past the original store's version 6."""
    db.create_session("h", "cli")
    keyed = db.append_message("h", "user", "数据库迁移 hermes", idempotency_key="k")
    assert db.append_message("h", "user", "数据库迁移 hermes", idempotency_key="k") == keyed
    assert [hit["id"] for hit in db.search_messages("迁移")] == [keyed]
    assert db.delete_session("h")
    assert [m["content"] for m in db.get_messages(workers.SEED_SESSION)] == [workers.SEED_WORDS]


def test_the_original_store_creates_the_path_while_hermes_builds_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The original store (another process) creates state.db between hermes_store's build
    and its link: its v6 file is adopted, not used as if it were at head (the keyed write and
    delete_session failed on "no such table: write_keys")."""
    path = tmp_path / "state.db"
    ctx = multiprocessing.get_context("spawn")

    def seed_creates() -> None:
        done = ctx.Event()
        proc = ctx.Process(target=workers.seed_creates, args=(str(path), done))
        proc.start()
        assert done.wait(timeout=120), "the original store never created the file"
        proc.join(timeout=60)
        assert proc.exitcode == 0

    ran = _after_build(monkeypatch, seed_creates)
    with SessionDB(path) as db:
        assert ran == [1]
        _use_own_tables(db)
    _assert_adopted_and_shared(path)


def test_a_file_the_original_store_is_still_creating_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The original store is half-way through creating state.db when hermes_store's link
    fails (schema_version without its row, sessions, no messages yet): hermes_store looks
    again until it is done, then adopts it, instead of refusing it as unknown."""
    path = tmp_path / "state.db"
    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []

    def seed_starts() -> None:
        started = ctx.Event()
        proc = ctx.Process(target=workers.seed_creates_slowly, args=(str(path), 0.5, started))
        proc.start()
        procs.append(proc)
        assert started.wait(timeout=120), "the original store never started"

    _after_build(monkeypatch, seed_starts)
    try:
        with SessionDB(path) as db:
            _use_own_tables(db)
    finally:
        for proc in procs:
            proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0]
    _assert_adopted_and_shared(path)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2])
def test_hermes_and_the_original_store_open_a_new_path_at_once(
    tmp_path: Path, delay: float
) -> None:
    """Real processes, no hook: hermes_store and the original store open one new path at the
    same moment (the original store ``delay`` seconds later); whichever creates it, hermes_store's
    writes that need its own tables work and the file ends at head."""
    path = tmp_path / "state.db"
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    hermes = ctx.Process(target=workers.open_and_delete, args=(str(path), barrier, out))
    seed = ctx.Process(target=workers.seed_races, args=(str(path), barrier, delay))
    for proc in (hermes, seed):
        proc.start()
    try:
        assert out.get(timeout=120) == ""
    finally:
        for proc in (hermes, seed):
            proc.join(timeout=60)
    assert [hermes.exitcode, seed.exitcode] == [0, 0]
    _assert_adopted_and_shared(path)


@pytest.mark.parametrize("threads", [2, 16])
def test_threads_opening_a_new_path_at_once_share_one_file_at_head(
    tmp_path: Path, threads: int
) -> None:
    """Threads of one process opening one new path at once: Alembic keeps a running
    migration's context in module globals, so each thread's migration ran on another's
    connection (raw KeyError 'config', "table schema_version already exists", and one sqlite3
    connection used by two threads at once: a segfault). In a process of its own, so a crash
    fails this test rather than the test run."""
    path = tmp_path / "state.db"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    opening = ctx.Process(target=workers.threads_open_a_new_path, args=(str(path), threads, out))
    opening.start()
    try:
        errors = out.get(timeout=GUARD)
    finally:
        opening.join(GUARD)
    assert opening.exitcode == 0
    assert errors == [""] * threads
    url = URL.create("sqlite", database=str(path))
    assert alembic_revision(url) == HEAD and schema_version(url) == 6
    with SessionDB(path) as db:
        assert sorted(s["id"] for s in db.list_sessions_rich(limit=100)) == sorted(
            f"t{n}" for n in range(threads)
        )
