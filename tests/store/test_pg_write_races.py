"""Writes racing on PostgreSQL keep a serial order's outcome.

An append is one statement that inserts its message and then bumps its session's row. A
``clear_messages`` that deleted the messages before locking that row missed an append still
waiting for the row (its message not yet committed), then reset the counter the append had
just bumped: the message stayed, counted nowhere, for good. A ``delete_session`` of a session
created while it ran deleted a row its lock never saw, and failed on the new message.
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


def test_delete_session_racing_its_creation_leaves_the_new_session(pg_url: URL) -> None:
    """``delete_session`` of a session not yet there, while another store creates it and
    appends: the delete's row lock found nothing, its later statements met the committed
    message, and it failed with a ``WriteRefusedError`` naming the messages' foreign key.
    The delete came first (the session did not exist): it deletes nothing, and says so."""
    engine = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with SessionDB(url_string(pg_url)) as db, engine.connect() as watcher:
        # A stray idempotency key of the id, held by another writer: the delete waits there,
        # between its messages' DELETE and its sessions' DELETE.
        watcher.execute(
            sa.text("INSERT INTO write_keys (key, session_id, created_at) VALUES ('k', 'dx', 0)")
        )
        with engine.connect().execution_options(isolation_level="READ COMMITTED") as locker:
            locker.begin()
            locker.execute(sa.text("SELECT key FROM write_keys WHERE key = 'k' FOR UPDATE"))
            deleted, delete = in_thread(lambda: db.delete_session("dx"))
            # Without the fix the delete waits on the key's row; with it, it ends at once.
            wait_until(
                lambda: bool(deleted) or watcher.scalar(_WAITING) >= 1,
                "the delete ended or waits on the key",
            )
            with SessionDB(url_string(pg_url)) as other:
                other.create_session("dx", "cli")
                other.append_message("dx", "user", "written as the delete ran")
            locker.commit()
        delete.join(GUARD)
        assert not delete.is_alive()
        assert deleted == [("ok", False)], deleted
        assert db.message_count("dx") == 1
    engine.dispose()
