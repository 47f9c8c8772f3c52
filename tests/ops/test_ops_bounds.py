"""What the long-running operations hold while they run: a backup frozen mid-copy leaves the
write lock free, ``db optimize`` frozen inside a step makes writers wait for that step only,
no maintenance issues a blocking checkpoint, and every export format redacts.

Operations are frozen through test-only hooks around the library's own step functions (no
database is mocked); every wait is on an event or a join.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Engine

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.ops import backup, maintenance, pacing, retention

DEADLINE = 120.0  # a hang guard only


class _Freeze:
    """The first ``count`` calls each wait (in their own thread) until released."""

    def __init__(self, count: int) -> None:
        self.entered = [threading.Event() for _ in range(count)]
        self.release = [threading.Event() for _ in range(count)]
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            number = self.calls
            self.calls += 1
        if number < len(self.entered):
            self.entered[number].set()
            assert self.release[number].wait(DEADLINE)

    def thaw(self) -> None:
        for event in self.release:
            event.set()


def _fill(store: SessionDB, sessions: int, messages: int, words: int = 20) -> None:
    for number in range(sessions):
        sid = f"s{number:04d}"
        store.create_session(sid, "cli")
        store.append_messages(
            sid,
            [
                {"role": "user", "content": f"note {number} {i} " + "lorem ipsum dolor " * words}
                for i in range(messages)
            ],
        )
        store.end_session(sid, "done")


class _Thread(threading.Thread):
    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as error:  # kept for the assertions
            self.error = error
        finally:
            self.done.set()


# -- backup -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["backup", "vacuum"])
def test_a_backup_frozen_mid_copy_leaves_the_write_lock_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: backup.Method
) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        _fill(store, 40, 20, words=120)  # a few MB: more than SQLite's page cache holds
    freeze = _Freeze(1)
    flush = backup._Flusher.__call__

    def frozen_flush(self: backup._Flusher, *args: object) -> int:
        if os.fstat(self.fd).st_size > 0:  # mid-copy: part of the copy is in the file
            freeze()
        return flush(self, *args)

    monkeypatch.setattr(backup._Flusher, "__call__", frozen_flush)
    monkeypatch.setattr(backup, "VACUUM_CHECK_OPS", 100)  # a small file: look often
    copy = tmp_path / "copy.db"
    store = SessionDB(path)
    job = _Thread(
        lambda: backup.backup(store.engine, copy, method=method, pages_per_step=8, sync_bytes=4096)
    )
    try:
        job.start()
        assert freeze.entered[0].wait(DEADLINE)
        # timeout=0: no busy wait at all, so this commit proves the write lock is free.
        raw = sqlite3.connect(path, isolation_level=None, timeout=0)
        raw.execute("BEGIN IMMEDIATE")
        raw.execute(
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "VALUES ('s0000', 'user', 'written during the backup', 0)"
        )
        raw.execute("COMMIT")
        raw.close()
        freeze.thaw()
        assert job.done.wait(DEADLINE)
        assert job.error is None, job.error
    finally:
        freeze.thaw()
        job.join(DEADLINE)
        store.close()
    assert backup.check_snapshot(copy) == []
    with SessionDB(copy) as restored:
        # The snapshot was taken before that commit: it holds everything but it.
        assert restored.message_count("s0000") == 20
        assert restored.session_count() == 40
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600


def test_backup_refuses_bad_throttle_settings(tmp_path: Path) -> None:
    with SessionDB(tmp_path / "state.db") as store:
        for options in ({"sync_bytes": -1}, {"sync_bytes": 1.5}, {"pause": -0.1}, {"pause": 11}):
            with pytest.raises(backup.InvalidInputError):
                backup.backup(store.engine, tmp_path / "copy.db", **options)  # type: ignore[arg-type]
    assert not (tmp_path / "copy.db").exists()


# -- db optimize --------------------------------------------------------------------------------


def test_writers_wait_for_one_optimize_step_then_get_in_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        _fill(store, 30, 5)
    freeze = _Freeze(2)
    run_step = pacing.run_step

    def frozen_run_step(uow: Any, pace: Any, log: Any, body: Callable[..., Any]) -> Any:
        def frozen(conn: Any, size: int) -> Any:
            result = body(conn, size)
            freeze()  # inside the step's write unit, before it commits
            return result

        return run_step(uow, pace, log, frozen)

    monkeypatch.setattr(pacing, "run_step", frozen_run_step)
    job_store, writers = SessionDB(path), SessionDB(path)
    job = _Thread(lambda: maintenance.optimize(job_store.uow))
    writer = _Thread(lambda: writers.append_message("s0001", "user", "during optimize"))
    try:
        job.start()
        assert freeze.entered[0].wait(DEADLINE)  # step 1 holds the write lock
        writer.start()
        assert not writer.done.is_set()
        freeze.release[0].set()
        # Step 2 holds the lock again: the writer must have had its turn in between.
        assert freeze.entered[1].wait(DEADLINE)
        assert writer.done.wait(DEADLINE)
        assert writer.error is None and isinstance(writer.result, int), writer.error
        freeze.thaw()
        assert job.done.wait(DEADLINE)
        assert job.error is None, job.error
        report = job.result
        assert isinstance(report, maintenance.Report)
        assert report.merge_steps >= 1 and report.bytes_after > 0
    finally:
        freeze.thaw()
        job.join(DEADLINE)
        writer.join(DEADLINE)
        job_store.close()
        writers.close()


# -- checkpoints --------------------------------------------------------------------------------


@contextmanager
def _traced() -> Iterator[list[str]]:
    """Every SQL statement run on SQLite connections opened meanwhile."""
    statements: list[str] = []

    def trace(dbapi_connection: Any, _record: object) -> None:
        if isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.set_trace_callback(statements.append)

    sa.event.listen(Engine, "connect", trace)
    try:
        yield statements
    finally:
        sa.event.remove(Engine, "connect", trace)


def test_maintenance_only_ever_checkpoints_passive_while_others_have_the_file_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    SessionDB(path).close()
    other = sqlite3.connect(path, isolation_level=None)  # another process's connection
    try:
        with _traced() as statements, SessionDB(path) as store:
            _fill(store, 20, 3)
            store.set_session_title("s0001", "kept")
            retention.run(
                store.uow,
                retention.Policy(-1, keep_titled=True),
                chunk=5,
                secure_delete=True,
                merge_index=True,
            )
            maintenance.optimize(store.uow)
            assert store.uow.checkpoint()
            other.execute("SELECT count(*) FROM sessions").fetchone()
        checkpoints = [s for s in statements if re.search(r"wal_checkpoint", s, re.I)]
        assert checkpoints, "the trace saw no checkpoint at all"
        assert all(re.search(r"wal_checkpoint\s*\(\s*PASSIVE\s*\)", s, re.I) for s in checkpoints)
    finally:
        other.close()


# -- exports ------------------------------------------------------------------------------------

SECRETS = {
    "openai": "sk-proj-Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL",
    "github": "ghp_4fT8kLm2Qx9Rz7Vb3Nc6Wd1Ye5Ua0Ps8Hj2K",
    "url password": "postgres://admin:Sup3rS3cretPw@db.internal:5432/prod",
}


def test_every_export_format_masks_and_marks_a_redacted_export(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli", system_prompt=f"use {SECRETS['openai']}")
        store.set_session_title("s", "deploy notes")
        store.append_message("s", "user", f"my token is {SECRETS['github']}, keep it")
        store.append_message("s", "assistant", f"connect with {SECRETS['url password']}")
    runner = CliRunner()
    outputs = {
        "jsonl": ["--format", "jsonl", "-o", str(tmp_path / "all.jsonl")],
        "md": ["--format", "md", "-o", str(tmp_path / "all.md")],
        "md --split": ["--format", "md", "--split", "-o", str(tmp_path / "split")],
    }
    for name, options in outputs.items():
        result = runner.invoke(cli, ["--db", str(path), "export", "--redact", *options])
        assert result.exit_code == 0, (name, result.output)
    written = {
        "jsonl": (tmp_path / "all.jsonl").read_text(encoding="utf-8"),
        "md": (tmp_path / "all.md").read_text(encoding="utf-8"),
        "md --split": "".join(
            p.read_text(encoding="utf-8") for p in sorted((tmp_path / "split").iterdir())
        ),
    }
    for name, text in written.items():
        for kind, secret in SECRETS.items():
            assert secret not in text, (name, kind)
        assert "[REDACTED:" in text, name
        # The words around the secrets stay readable.
        assert "keep it" in text and "deploy notes" in text, name
    assert json.loads(written["jsonl"])["redacted"] is True
    assert "Redacted export" in written["md"]
    assert "Redacted export" in written["md --split"]
    # Unredacted, the same exports carry no marker.
    plain = runner.invoke(cli, ["--db", str(path), "export", "--format", "md", "--split", "-o",
                                str(tmp_path / "plain")])  # fmt: skip
    assert plain.exit_code == 0, plain.output
    text = "".join(p.read_text(encoding="utf-8") for p in (tmp_path / "plain").iterdir())
    assert SECRETS["github"] in text and "Redacted export" not in text
