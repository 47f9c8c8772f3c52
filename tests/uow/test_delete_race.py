"""Deleting or pruning a session while another connection appends to it: the append lands
before the delete (and is deleted with it) or fails with UnknownSessionError; never a raw
foreign-key error, never a message left without its session."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from hermes_store import SessionDB, UnknownSessionError
from tests.support.backends import url_string
from tests.support.waiting import GUARD

ROUNDS = 40


def _append(
    store: SessionDB, session: str, start: threading.Barrier, unexpected: list[BaseException]
) -> None:
    start.wait()
    try:
        for _ in range(50):
            store.append_message(session, "user", "racing")
    except UnknownSessionError:
        pass  # the delete won: nothing more may land
    except BaseException as error:
        unexpected.append(error)


def _race(url: str, delete: str) -> None:
    appender, deleter = SessionDB(url), SessionDB(url)
    try:
        for number in range(ROUNDS):
            session = f"s{number}"
            appender.create_session(session, "gateway")
            appender.append_message(session, "user", "first")
            deleter.end_session(session, "done")
            start = threading.Barrier(2, timeout=GUARD)
            unexpected: list[BaseException] = []
            thread = threading.Thread(target=_append, args=(appender, session, start, unexpected))
            thread.start()
            start.wait()
            if delete == "delete":
                assert deleter.delete_session(session) is True
            else:
                assert deleter.prune_sessions(older_than_days=-1, source="gateway") == 1
            thread.join(GUARD)
            assert not thread.is_alive()
            assert unexpected == [], unexpected
            assert deleter.get_session(session) is None
            assert deleter.message_count(session) == 0, f"round {number}: orphan messages"
    finally:
        appender.close()
        deleter.close()


@pytest.mark.slow
@pytest.mark.parametrize("delete", ["delete", "prune"])
def test_delete_racing_an_append_is_consistent(db_url: URL, delete: str) -> None:
    _race(url_string(db_url), delete)
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            orphans = conn.execute(
                sa.text(
                    "SELECT count(*) FROM messages m "
                    "WHERE NOT EXISTS (SELECT 1 FROM sessions s WHERE s.id = m.session_id)"
                )
            ).scalar()
    finally:
        engine.dispose()
    assert orphans == 0
