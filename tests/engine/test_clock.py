"""The store's injectable clock: every timestamp it writes comes from it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hermes_store import InvalidInputError, SessionDB
from tests.support.clock import FakeClock


def test_every_written_timestamp_comes_from_the_clock(store: SessionDB, clock: FakeClock) -> None:
    started = clock.advance(100)
    store.create_session("a", "cli")
    store.ensure_session("b", "cli")
    clock.advance(10)
    store.append_message("a", "user", "hello")
    store.append_messages("a", [{"role": "assistant", "content": "hi"}])
    clock.advance(10)
    store.end_session("a", "user_exit")
    a, b = store.get_session("a"), store.get_session("b")
    assert a is not None and b is not None
    assert started < a["started_at"] < b["started_at"] < started + 1
    first, second = store.get_messages("a")
    assert started + 10 < first["timestamp"] < second["timestamp"] < started + 11
    assert started + 20 < a["ended_at"] <= clock.now
    store.append_messages("a", [{"role": "user", "content": "imported", "timestamp": 5.0}])
    assert store.get_messages("a")[0]["timestamp"] == 5.0  # an explicit timestamp wins


def test_prune_cutoff_reads_the_clock(store: SessionDB, clock: FakeClock) -> None:
    store.create_session("old", "cli")
    store.end_session("old", "done")
    clock.advance(9 * 86400)
    store.create_session("new", "cli")
    store.end_session("new", "done")
    assert store.prune_sessions(older_than_days=10) == 0
    clock.advance(2 * 86400)  # "old" is now 11 days old, "new" 2
    assert store.prune_sessions(older_than_days=10) == 1
    assert store.get_session("old") is None and store.get_session("new") is not None


def test_default_clock_is_the_wall_clock(tmp_path: Path) -> None:
    before = time.time()
    with SessionDB(tmp_path / "state.db") as db:
        db.create_session("s", "cli")
        row = db.get_session("s")
    assert row is not None and before <= row["started_at"] <= time.time()


def test_a_clock_that_is_not_callable_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="clock"):
        SessionDB(tmp_path / "state.db", clock=12.0)  # type: ignore[arg-type]
    assert not (tmp_path / "state.db").exists()
