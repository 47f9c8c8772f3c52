"""Two imports of the same file into one PostgreSQL database at once: an id the other import
took meanwhile is skipped like any known id, never a duplicate-key failure, and between them
every session and message of the file lands exactly once."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection

from hermes_store import SessionDB, transfer
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from tests.support.backends import url_string
from tests.support.import_workers import export_records
from tests.support.waiting import GUARD


def test_two_imports_of_one_file_at_once_skip_what_the_other_took(
    pg_url: URL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each importer, once it has looked up which ids are taken, waits for the other to have
    looked too (or, while the other waits for its turn, for a while) before it inserts: the
    interleaving that made the loser insert an id the winner had just taken."""
    records = export_records(sessions=12, per_session=3)
    looked = threading.Barrier(2, timeout=3.0)
    real_insert = transfer._insert

    def insert_after_both_looked(conn: Connection, table: sa.Table, rows: list[Any]) -> None:
        if table is S and rows:
            # the other import waiting for this one's batch: nothing to line up with
            with contextlib.suppress(threading.BrokenBarrierError):
                looked.wait()
        real_insert(conn, table, rows)

    monkeypatch.setattr(transfer, "_insert", insert_after_both_looked)
    reports: list[transfer.ImportReport] = []
    failures: list[BaseException] = []

    def importer() -> None:
        with SessionDB(url_string(pg_url)) as store:
            try:
                reports.append(
                    transfer.import_sessions(store, enumerate(records, 1), batch_size=100)
                )
            except BaseException as error:  # handed to the test's thread
                failures.append(error)

    threads = [threading.Thread(target=importer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD)
    assert not failures, failures
    assert len(reports) == 2
    assert sorted((r.sessions, r.sessions_skipped) for r in reports) == [(0, 12), (12, 0)]
    assert sum(r.messages for r in reports) == 36
    assert sum(r.messages_renumbered for r in reports) == 0
    with SessionDB(url_string(pg_url)) as store:
        counts = store.uow.run(
            lambda conn: (
                conn.scalar(sa.select(sa.func.count()).select_from(S)),
                conn.scalar(sa.select(sa.func.count()).select_from(M)),
            ),
            write=False,
        )
    assert counts == (12, 36)
