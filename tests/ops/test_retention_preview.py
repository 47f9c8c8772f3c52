"""``retention.would_delete``: what a prune would delete, read through a unit of work, and
exactly what the prune then deletes."""

from __future__ import annotations

from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.ops import retention
from tests.support.backends import url_string
from tests.support.clock import FakeClock

DAY = 86400.0


def _seed(db: SessionDB, clock: FakeClock) -> None:
    """200 days ago: an ended session, an ended titled one (two messages) and an active
    one; then, now, an ended session."""
    clock.advance(-200 * DAY)
    db.create_session("old-ended", "cli")
    db.end_session("old-ended", "done")
    db.create_session("old-titled", "telegram")
    db.set_session_title("old-titled", "Kept by --keep-titled")
    db.append_message("old-titled", "user", "one")
    db.append_message("old-titled", "assistant", "two")
    db.end_session("old-titled", "done")
    db.create_session("old-active", "cli")
    clock.advance(200 * DAY)
    db.create_session("recent", "cli")
    db.end_session("recent", "done")


def test_the_preview_is_what_the_prune_deletes(db_url: URL, clock: FakeClock) -> None:
    with SessionDB(url_string(db_url), clock=clock) as db:
        _seed(db, clock)
        policy = retention.Policy(90)
        rows = retention.would_delete(db.uow, policy, now=clock.now)
        assert [row["id"] for row in rows] == ["old-ended", "old-titled"]  # oldest first
        titled = rows[1]
        assert (titled["title"], titled["source"], titled["message_count"]) == (
            "Kept by --keep-titled",
            "telegram",
            2,
        )
        assert set(titled) == {"id", "title", "source", "started_at", "ended_at", "message_count"}
        assert db.session_count() == 4  # reading only
        kept_titled = retention.Policy(90, keep_titled=True)
        assert [r["id"] for r in retention.would_delete(db.uow, kept_titled)] == ["old-ended"]
        only_telegram = retention.Policy(90, ("telegram",))
        assert [r["id"] for r in retention.would_delete(db.uow, only_telegram)] == ["old-titled"]

        assert db.prune_sessions(90) == len(rows)
        assert db.get_session("old-active") is not None and db.get_session("recent") is not None
        assert retention.would_delete(db.uow, policy, now=clock.now) == []


def test_inside_a_transaction_the_preview_sees_its_writes(db_url: URL, clock: FakeClock) -> None:
    """The read unit joins the open block, as every read of the store does."""
    with SessionDB(url_string(db_url), clock=clock) as db:
        _seed(db, clock)
        with db.transaction():
            db.delete_session("old-ended")
            ids = [r["id"] for r in retention.would_delete(db.uow, retention.Policy(90))]
        assert ids == ["old-titled"]
