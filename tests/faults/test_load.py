"""Load: 8 writer processes appending and incrementing shared counters while 2 processes search
and list, on SQLite and PostgreSQL. Exact totals, zero errors, and (SQLite) ``integrity_check``
and the FTS5 ``integrity-check`` clean afterwards. Bounded in operations, not in time.
"""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.engine.factory import sqlite_file
from hermes_store.search.pipeline import check_index
from tests.conftest import url_string
from tests.support import proc_workers
from tests.support.proc_workers import MARK, Shape

pytestmark = pytest.mark.slow

WRITERS = 8
READERS = 2
SHAPE = Shape(threads=3, ops=8)  # per writer: 48 appends + 48 increments
HISTORY = 10


def test_writers_and_readers_at_once(db_url: URL) -> None:
    url = url_string(db_url)
    store = SessionDB(url)
    try:
        store.create_session("shared", "load")
        for worker in range(WRITERS):
            store.create_session(f"w{worker}", "load")
        # Some history for the readers to find from the first moment.
        store.append_messages(
            "shared", [{"role": "user", "content": f"{MARK} history {i}"} for i in range(HISTORY)]
        )
    finally:
        store.close()

    errors, reads = proc_workers.run(url, writers=WRITERS, readers=READERS, shape=SHAPE)
    assert errors == []
    assert len(reads) == READERS and all(count > 0 for count in reads.values())

    per_worker = SHAPE.threads * SHAPE.ops
    total = WRITERS * per_worker
    store = SessionDB(url)
    try:
        shared = store.get_session("shared")
        assert shared is not None
        assert shared["message_count"] == store.message_count("shared") == total + HISTORY
        assert shared["input_tokens"] == total and shared["output_tokens"] == 2 * total
        assert shared["estimated_cost_usd"] == pytest.approx(0.5 * total)
        contents = [m["content"] for m in store.get_messages("shared")]
        assert len(set(contents)) == total + HISTORY  # no unit applied twice
        for worker in range(WRITERS):
            own = store.get_session(f"w{worker}")
            assert own is not None
            assert own["message_count"] == store.message_count(f"w{worker}") == per_worker
            assert own["input_tokens"] == 5 * per_worker
            assert own["estimated_cost_usd"] == pytest.approx(0.25 * per_worker)
        assert store.message_count() == 2 * total + HISTORY
        # The full-text index followed every write: a unique tag of each writer is found twice
        # (its message in the shared session and the one in its own session).
        last = f"w{WRITERS - 1}t{SHAPE.threads - 1}o{SHAPE.ops - 1}"
        for tag in ("w0t0o0", last):
            assert {hit["session_id"] for hit in store.search_messages(tag)} == {
                "shared",
                tag.split("t")[0],
            }
        with store.uow.connect(write=True) as conn:
            assert check_index(conn)
    finally:
        store.close()

    path = sqlite_file(db_url)
    if path is not None:
        raw = sqlite3.connect(path)
        try:
            assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            # Raises (SQLITE_CORRUPT_VTAB) when the index and the content table disagree.
            raw.execute(
                "INSERT INTO messages_fts(messages_fts, rank) VALUES ('integrity-check', 1)"
            )
            assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
        finally:
            raw.close()
