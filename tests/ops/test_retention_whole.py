"""A retention run deletes a session whole or not at all, whatever the pace of its steps.

A session with more text than a step's budget was deleted across several committed steps,
oldest messages first; when the policy stopped selecting it between two of them (the user
reopened it, titled it with ``keep_titled``), it was kept without its first messages, and the
report said no session was deleted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from hermes_store import SessionDB
from hermes_store.ops import retention

#: Text per message and messages: well over a first step's budget (256 KiB of text).
_WORDS = "word " * 2000
_MESSAGES = 300

#: What the user does between two of the job's steps, and the policy that then keeps it.
_KEEPERS: dict[str, tuple[Callable[[SessionDB], object], retention.Policy]] = {
    "reopened": (lambda db: db.reopen_session("old"), retention.Policy(30)),
    "titled": (
        lambda db: db.set_session_title("old", "Keep this one"),
        retention.Policy(30, keep_titled=True),
    ),
}


@pytest.mark.parametrize("keeper", sorted(_KEEPERS))
def test_a_session_is_deleted_whole_or_not_at_all_whatever_its_size(
    store: SessionDB, keeper: str
) -> None:
    keep, policy = _KEEPERS[keeper]
    store.create_session("old", "cli")
    store.append_messages(
        "old", [{"role": "user", "content": f"m{i} {_WORDS}"} for i in range(_MESSAGES)]
    )
    store.end_session("old", "done")
    seen: list[tuple[bool, int]] = []

    def between_steps(_sessions: int, _messages: int) -> None:
        found = store.get_session("old")
        seen.append((found is not None, store.message_count("old")))
        if found is not None and len(seen) == 1:
            keep(store)

    report = retention.run(
        store.uow, policy, now=time.time() + 31 * 86400, chunk=1, on_chunk=between_steps
    )
    # After every committed step the session is whole or gone with every message: here the
    # first step deleted it whole, over its budget, so the user's change came too late.
    for exists, count in seen:
        assert count == (_MESSAGES if exists else 0), seen
    assert seen[0] == (False, 0)
    assert store.get_session("old") is None and store.message_count("old") == 0
    assert (report.sessions, report.messages) == (1, _MESSAGES)
