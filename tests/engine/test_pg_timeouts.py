"""A server-side bound on waiting (the role's ``lock_timeout`` or ``statement_timeout``, the
way an operator keeps a stalled peer from stopping the fleet) and an administrator's
``pg_cancel_backend`` end a call with a package error, not SQLAlchemy's raw one; the
statement was rolled back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import DatabaseLockedError, DatabaseUnavailableError, SessionDB
from tests.support.backends import url_string
from tests.support.waiting import GUARD, in_thread, wait_until

_WAITING = sa.text(
    "SELECT pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
    "WHERE NOT l.granted AND a.datname = current_database()"
)


def _with_options(url: URL, options: str) -> str:
    return url_string(url.update_query_dict({"options": options}))


@contextmanager
def _row_held(url: URL) -> Iterator[None]:
    """Another writer holding session ``s``'s row (a stalled gateway, say) for the block."""
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as holder:
            holder.execute(sa.text("SELECT id FROM sessions WHERE id = 's' FOR UPDATE"))
            yield
    finally:
        engine.dispose()


def test_a_lock_timeout_is_a_database_locked_error(pg_url: URL) -> None:
    with SessionDB(_with_options(pg_url, "-c lock_timeout=200")) as db:
        db.create_session("s", "cli")
        with _row_held(pg_url):
            for call in (
                lambda: db.append_message("s", "user", "waits"),
                lambda: db.update_token_counts("s", input_tokens=1),
                lambda: db.set_session_title("s", "waits too"),
            ):
                with pytest.raises(DatabaseLockedError, match="lock_timeout"):
                    call()
        assert db.message_count("s") == 0


def test_a_statement_timeout_is_named(pg_url: URL) -> None:
    with SessionDB(_with_options(pg_url, "-c statement_timeout=200")) as db:
        db.create_session("s", "cli")
        with (
            _row_held(pg_url),
            pytest.raises(DatabaseUnavailableError, match="canceled the statement"),
        ):
            db.append_message("s", "user", "waits")


def test_an_administrators_cancel_is_named(pg_url: URL) -> None:
    admin = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with SessionDB(url_string(pg_url)) as db, admin.connect() as watcher:
        db.create_session("s", "cli")
        with _row_held(pg_url):
            outcome, thread = in_thread(lambda: db.update_token_counts("s", input_tokens=1))
            wait_until(lambda: watcher.scalar(_WAITING) is not None, "the update waits")
            watcher.execute(
                sa.text("SELECT pg_cancel_backend(:pid)"), {"pid": watcher.scalar(_WAITING)}
            )
            thread.join(GUARD)
            assert not thread.is_alive()
        [(kind, error)] = outcome
        assert kind == "error" and isinstance(error, DatabaseUnavailableError), error
        assert "canceled the statement" in str(error)
    admin.dispose()
