"""Round trips per call on PostgreSQL, counted by a TCP proxy between the store and the server:
a one-statement write outside a ``transaction()`` block, and a one-statement read, is ONE round
trip (no ping, no BEGIN, no COMMIT)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from tests.support.backends import url_string
from tests.support.latency_proxy import LatencyProxy

Call = Callable[[SessionDB, int], object]

#: Each call and its round trips once warm (connections open, statements prepared).
CALLS: dict[str, tuple[Call, int]] = {
    "append_message": (lambda db, i: db.append_message("s", "user", f"message {i}"), 1),
    "append_message_keyed": (
        lambda db, i: db.append_message("s", "user", f"keyed {i}", idempotency_key=f"k{i}"),
        1,
    ),
    "append_message_resent": (  # a key already recorded: the recorded id, same one trip
        lambda db, i: db.append_message("s", "user", "again", idempotency_key="resent"),
        1,
    ),
    "update_token_counts": (lambda db, i: db.update_token_counts("s", input_tokens=i), 1),
    "update_token_counts_keyed": (
        lambda db, i: db.update_token_counts("s", input_tokens=i, idempotency_key=f"t{i}"),
        1,
    ),
    "update_token_counts_absolute": (
        lambda db, i: db.update_token_counts("s", input_tokens=i, absolute=True),
        1,
    ),
    "create_session": (lambda db, i: db.create_session(f"new {i}", "cli"), 1),
    "create_child_session": (
        lambda db, i: db.create_session(f"child {i}", "cli", parent_session_id="s"),
        1,
    ),
    "ensure_session": (lambda db, i: db.ensure_session(f"ensured {i}"), 1),
    "end_session": (lambda db, i: db.end_session("s", f"done {i}"), 1),
    "reopen_session": (lambda db, i: db.reopen_session("s"), 1),
    "update_system_prompt": (lambda db, i: db.update_system_prompt("s", f"prompt {i}"), 1),
    "set_session_title": (lambda db, i: db.set_session_title("s", f"title {i}"), 1),
    "get_session": (lambda db, i: db.get_session("s"), 1),
    "get_messages": (lambda db, i: db.get_messages("s"), 1),
    "get_session_title": (lambda db, i: db.get_session_title("s"), 1),
    "message_count": (lambda db, i: db.message_count("s"), 1),
}
WARM = 8  # psycopg prepares a statement on its 5th run (one extra round trip, once)
COUNTED = 5


@pytest.fixture
def proxied(pg_url: URL) -> Iterator[tuple[SessionDB, LatencyProxy]]:
    with LatencyProxy((pg_url.host or "127.0.0.1", pg_url.port or 5432), delay=0.0) as proxy:
        store = SessionDB(url_string(pg_url.set(host="127.0.0.1", port=proxy.port)))
        try:
            store.create_session("s", "cli")
            store.append_message("s", "user", "hello")
            yield store, proxy
        finally:
            store.close()


@pytest.mark.parametrize("name", list(CALLS))
def test_one_round_trip_per_call(proxied: tuple[SessionDB, LatencyProxy], name: str) -> None:
    store, proxy = proxied
    call, expected = CALLS[name]
    for number in range(WARM):
        call(store, number)
    proxy.reset()
    for number in range(WARM, WARM + COUNTED):
        call(store, number)
    assert proxy.reset() == COUNTED * expected


def test_calls_inside_a_block_share_its_transaction(
    proxied: tuple[SessionDB, LatencyProxy],
) -> None:
    """Inside ``transaction()`` the writes join the block: BEGIN, one trip per statement,
    COMMIT, and nothing else."""
    store, proxy = proxied
    for _ in range(2):  # warm: the block's pool opens its connection
        with store.transaction():
            store.update_token_counts("s", input_tokens=1)
            store.end_session("s", "done")
    proxy.reset()
    with store.transaction():
        store.update_token_counts("s", input_tokens=1)
        store.end_session("s", "done")
    # BEGIN, the two statements, COMMIT: no ping on checkout.
    assert proxy.reset() == 4
    session = store.get_session("s")
    assert session is not None and session["input_tokens"] == 3
