"""``get_child_sessions``: the sessions a session spawned (subagents, continuations)."""

from __future__ import annotations

import pytest

from hermes_store import InvalidInputError, SessionDB
from tests.support.backends import FLAVORS
from tests.support.clock import FakeClock


@pytest.fixture(params=FLAVORS)
def flavor(request: pytest.FixtureRequest) -> str:
    """Through ``SessionDB`` and through ``AsyncSessionDB`` (its derived coroutine)."""
    return str(request.param)


def test_children_oldest_first_and_only_direct_ones(store: SessionDB, clock: FakeClock) -> None:
    store.create_session("root", "cli")
    store.create_session("b-second", "cli", parent_session_id="root")
    clock.advance(-10)  # started before its sibling, whatever the ids say
    store.create_session("z-first", "subagent", parent_session_id="root")
    clock.advance(20)
    store.create_session("grandchild", "cli", parent_session_id="z-first")
    store.set_session_title("z-first", "Research")

    children = store.get_child_sessions("root")
    assert [c["id"] for c in children] == ["z-first", "b-second"]
    assert children[0]["title"] == "Research" and children[0]["source"] == "subagent"
    assert set(children[0]) == {"id", "title", "source", "started_at"}
    assert [c["id"] for c in store.get_child_sessions("z-first")] == ["grandchild"]
    assert store.get_child_sessions("grandchild") == []
    assert store.get_child_sessions("no-such-session") == []


def test_a_deleted_parent_leaves_no_children(store: SessionDB) -> None:
    store.create_session("root", "cli")
    store.create_session("child", "cli", parent_session_id="root")
    store.delete_session("root")  # the child is kept, unparented
    assert store.get_child_sessions("root") == []
    assert store.get_session("child") is not None


def test_a_bad_id_is_refused(store: SessionDB) -> None:
    with pytest.raises(InvalidInputError):
        store.get_child_sessions(None)  # type: ignore[arg-type]
