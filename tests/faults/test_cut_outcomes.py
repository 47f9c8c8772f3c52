"""Truthful outcomes when the connection is cut right after the server ran a write.

A proxy (tests/support/cut_proxy.py) between the store and PostgreSQL (directly, or PgBouncer
in transaction mode) forwards each kind of write, lets the server run and commit it, and drops
both sockets instead of relaying the answer. No caller is told "did not land" for a write that
landed: idempotent writes report success (run again, landed once), an append without a key
reports WriteOutcomeUnknownError (and did land), keyed appends and increments land exactly once
and a re-sent keyed append returns the same id.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy.engine import URL

from hermes_store import (
    AsyncSessionDB,
    DatabaseUnavailableError,
    RetryPolicy,
    SessionDB,
    WriteNotLandedError,
    WriteOutcomeUnknownError,
)
from tests.support.backends import PGBOUNCER_ENV, through_pgbouncer, url_string
from tests.support.cut_proxy import CutProxy


@dataclass
class Scene:
    """A store whose every connection goes through ``proxy``."""

    store: SessionDB
    proxy: CutProxy

    def cut(self, marker: bytes, call: Callable[[], Any]) -> Any:
        """``call()`` with the request containing ``marker`` cut after the server ran it."""
        self.proxy.arm(marker)
        try:
            return call()
        finally:
            assert self.proxy.fired.is_set(), f"no request contained {marker!r}"


@pytest.fixture(params=["postgresql", "pgbouncer"])
def scene(request: pytest.FixtureRequest, pg_url: URL) -> Iterator[Scene]:
    target = pg_url
    if request.param == "pgbouncer":
        if not os.environ.get(PGBOUNCER_ENV):
            pytest.skip(f"needs {PGBOUNCER_ENV}")
        target = through_pgbouncer(pg_url)
    assert target.host is not None and target.port is not None
    with CutProxy((target.host, target.port)) as proxy:
        query = {**target.query, "prepare_threshold": "none", "sslmode": "disable"}
        url = target.set(host="127.0.0.1", port=proxy.port, query=query)
        store = SessionDB(url_string(url))
        try:
            store.create_session("s", "cli")
            yield Scene(store, proxy)
        finally:
            store.close()


def test_idempotent_writes_cut_after_landing_report_success(scene: Scene) -> None:
    """Each idempotent write landed, lost its answer, ran again: success, landed once."""
    db = scene.store
    scene.cut(
        b"INSERT INTO sessions", lambda: db.create_session("child", "cli", parent_session_id="s")
    )
    scene.cut(b"INSERT INTO sessions", lambda: db.create_session("plain", "cli"))
    assert scene.cut(b"UPDATE sessions SET title", lambda: db.set_session_title("s", "named"))
    scene.cut(
        b"UPDATE sessions SET model=",
        lambda: db.update_token_counts("s", input_tokens=40, absolute=True),
    )
    scene.cut(b"UPDATE sessions SET ended_at", lambda: db.end_session("s", "done"))
    session = db.get_session("s")
    assert session is not None
    assert (session["title"], session["input_tokens"], session["end_reason"]) == (
        "named",
        40,
        "done",
    )
    assert db.get_session("child")["parent_session_id"] == "s"  # type: ignore[index]
    assert db.get_session("plain") is not None
    assert db.session_count() == 3


def test_an_append_without_a_key_cut_after_landing_is_unknown_never_not_landed(
    scene: Scene,
) -> None:
    db = scene.store
    with pytest.raises(WriteOutcomeUnknownError, match="may have landed"):
        scene.cut(b"INSERT INTO messages", lambda: db.append_message("s", "user", "lost answer"))
    # It did land (once): "did not land" would have been a lie.
    assert [m["content"] for m in db.get_messages("s")] == ["lost answer"]
    with pytest.raises(WriteOutcomeUnknownError):
        scene.cut(b"UPDATE sessions SET model=", lambda: db.update_token_counts("s", 5))
    assert db.get_session("s")["input_tokens"] == 5  # type: ignore[index]


def test_keyed_writes_cut_after_landing_land_exactly_once(scene: Scene) -> None:
    db = scene.store
    first = scene.cut(
        b"INSERT INTO messages",
        lambda: db.append_message("s", "user", "keyed", idempotency_key="turn-1"),
    )
    # The store ran it again by itself (a keyed append is idempotent) and got the first id.
    assert [m["id"] for m in db.get_messages("s")] == [first]
    assert db.append_message("s", "user", "keyed", idempotency_key="turn-1") == first
    for _ in range(2):
        scene.cut(
            b"INSERT INTO write_keys",
            lambda: db.update_token_counts("s", input_tokens=7, idempotency_key="usage-1"),
        )
    assert db.get_session("s")["input_tokens"] == 7  # type: ignore[index]
    assert db.get_session("s")["message_count"] == 1  # type: ignore[index]


def test_a_transaction_cut_before_its_commit_did_not_land(scene: Scene) -> None:
    """A unit whose connection is cut after a statement ran but before its COMMIT was sent:
    the server rolled it back, and the caller is told so."""
    db = scene.store
    db.append_message("s", "user", "kept")
    with pytest.raises(WriteNotLandedError, match="nothing of it landed"):
        scene.cut(b"DELETE FROM messages", lambda: db.delete_session("s"))
    assert db.message_count("s") == 1


def test_a_transaction_cut_after_its_commit_ran_is_unknown(scene: Scene) -> None:
    db = scene.store
    db.append_message("s", "user", "gone")
    with pytest.raises(WriteOutcomeUnknownError, match="COMMIT"):
        scene.cut(b"COMMIT", lambda: db.delete_session("s"))
    assert db.get_session("s") is None  # it had landed


def test_an_unreachable_server_means_the_write_did_not_land(scene: Scene) -> None:
    """No connection can be made at all: after the store's patience, a write says it did not
    land (nothing was sent), a read only that the server is unavailable."""
    url = scene.store.engine.url
    with SessionDB(url_string(url), retry=RetryPolicy(unavailable_timeout=0.3)) as brief:
        brief.append_message("s", "user", "before")
        scene.proxy.refuse()
        try:
            with pytest.raises(WriteNotLandedError, match="did not land"):
                brief.append_message("s", "user", "never sent")
            with pytest.raises(WriteNotLandedError, match="did not land"):
                brief.delete_session("s")
            with pytest.raises(WriteNotLandedError):
                brief.update_token_counts("s", input_tokens=1, idempotency_key="k")
            with pytest.raises(DatabaseUnavailableError) as read:
                brief.get_messages("s")
            assert not isinstance(read.value, WriteNotLandedError | WriteOutcomeUnknownError)
        finally:
            scene.proxy.restore()
        assert [m["content"] for m in brief.get_messages("s")] == ["before"]
        assert brief.get_session("s")["input_tokens"] == 0  # type: ignore[index]


@pytest.mark.parametrize(
    ("marker", "write"),
    [
        (b"UPDATE sessions SET ended_at", "end_session"),
        (b"UPDATE sessions SET model=", "absolute_tokens"),
        (b"INSERT INTO messages", "keyed_append"),
    ],
)
def test_an_idempotent_write_that_landed_is_never_reported_not_landed(
    scene: Scene, marker: bytes, write: str
) -> None:
    """The cut is followed by an outage longer than the store's patience: the write (which
    landed) runs again until the deadline, then is reported as maybe landed, never as "did not
    land" (a grouped write keeps what its lost group told it)."""
    url = scene.store.engine.url
    with SessionDB(url_string(url), retry=RetryPolicy(unavailable_timeout=0.3)) as brief:
        calls: dict[str, Callable[[], object]] = {
            "end_session": lambda: brief.end_session("s", "done"),
            "absolute_tokens": lambda: brief.update_token_counts("s", 40, absolute=True),
            "keyed_append": lambda: brief.append_message("s", "user", "x", idempotency_key="k"),
        }
        scene.proxy.arm(marker, refuse_after=True)
        try:
            with pytest.raises(WriteOutcomeUnknownError, match="may have landed"):
                calls[write]()
            assert scene.proxy.fired.is_set()
        finally:
            scene.proxy.restore()
        session = brief.get_session("s")
        assert session is not None
        landed = {
            "end_session": session["end_reason"] == "done",
            "absolute_tokens": session["input_tokens"] == 40,
            "keyed_append": session["message_count"] == 1,
        }
        assert landed[write]
        if write == "keyed_append":  # re-sent by the caller: the same message, once
            first = brief.get_messages("s")[0]["id"]
            assert brief.append_message("s", "user", "x", idempotency_key="k") == first
            assert brief.message_count("s") == 1


def test_async_store_cut_after_landing(scene: Scene) -> None:
    """The same outcomes through AsyncSessionDB (its own asyncio engine and pools)."""
    url = url_string(scene.store.engine.url)

    async def scenario() -> None:
        adb = AsyncSessionDB(url)
        try:
            scene.proxy.arm(b"INSERT INTO messages")
            with pytest.raises(WriteOutcomeUnknownError, match="may have landed"):
                await adb.append_message("s", "user", "unkeyed")
            assert scene.proxy.fired.is_set()
            scene.proxy.arm(b"INSERT INTO messages")
            first = await adb.append_message("s", "user", "keyed", idempotency_key="a-1")
            assert scene.proxy.fired.is_set()
            assert await adb.append_message("s", "user", "keyed", idempotency_key="a-1") == first
            scene.proxy.arm(b"UPDATE sessions SET ended_at")
            await adb.end_session("s", "done")
            assert scene.proxy.fired.is_set()
            messages = await adb.get_messages("s")
            assert [m["content"] for m in messages] == ["unkeyed", "keyed"]
            assert messages[1]["id"] == first
            assert (await adb.get_session("s"))["end_reason"] == "done"  # type: ignore[index]
        finally:
            await adb.close()

    asyncio.run(scenario())
