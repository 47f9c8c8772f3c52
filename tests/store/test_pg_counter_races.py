"""A session's counters stay the count of its messages when writers race on PostgreSQL.

An append is one statement that inserts its message and then bumps its session's row. A
``clear_messages`` that deleted the messages before locking that row missed an append still
waiting for the row (its message not yet committed), then reset the counter the append had
just bumped: the message stayed, counted nowhere, for good.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB
from tests.support.backends import url_string
from tests.support.waiting import GUARD, in_thread, wait_until

_WAITING = sa.text(
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
    "WHERE NOT l.granted AND a.datname = current_database()"
)


def test_clear_messages_racing_an_append_keeps_the_count_true(pg_url: URL) -> None:
    engine = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with SessionDB(url_string(pg_url)) as db, engine.connect() as watcher:
        db.ensure_session("cm", "cli")
        db.append_message("cm", "user", "old message")
        with engine.connect().execution_options(isolation_level="READ COMMITTED") as locker:
            locker.begin()
            # Another writer holds the session's row (a title being set, say).
            locker.execute(sa.text("UPDATE sessions SET title = title WHERE id = 'cm'"))
            appended, append = in_thread(lambda: db.append_message("cm", "user", "new message"))
            wait_until(lambda: watcher.scalar(_WAITING) >= 1, "the append waits for the row")
            cleared, clear = in_thread(lambda: db.clear_messages("cm"))
            wait_until(lambda: watcher.scalar(_WAITING) >= 2, "the clear waits too")
            locker.commit()
        for thread in (append, clear):
            thread.join(GUARD)
            assert not thread.is_alive()
        assert [kind for kind, _ in appended + cleared] == ["ok", "ok"], appended + cleared
        rows = db.get_messages("cm")
        session = db.get_session("cm")
        assert session is not None
        assert session["message_count"] == len(rows), ([m["content"] for m in rows], session)
    engine.dispose()
