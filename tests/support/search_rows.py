"""Messages for the search tests: appended at known times, found by id."""

from __future__ import annotations

from typing import Any

from hermes_store import SessionDB

#: The search tests' clock: messages are appended a second apart from here.
T0 = 1_700_000_000.0


def add(
    store: SessionDB, session_id: str, *messages: tuple[str, str | None], t: float
) -> list[int]:
    """Append (role, content) messages one second apart from ``t``; returns their ids."""
    rows = [
        {"role": role, "content": content, "timestamp": t + i}
        for i, (role, content) in enumerate(messages)
    ]
    return store.append_messages(session_id, rows)


def ids(results: list[dict[str, Any]]) -> list[int]:
    return [row["id"] for row in results]
