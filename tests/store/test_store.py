"""The contract's sessions, titles, tokens, messages and export sections, on both backends."""

from __future__ import annotations

import json
import logging
import time

import pytest
import sqlalchemy as sa

from hermes_store import (
    HermesStoreError,
    InvalidInputError,
    SessionDB,
    TitleInUseError,
    TitleTooLongError,
    UnknownSessionError,
)
from hermes_store.models import ChatSession, Message
from tests.support.backends import FLAVORS, NO_CJK_INDEX, SEARCH_BACKENDS
from tests.support.clock import FakeClock


@pytest.fixture(params=FLAVORS)
def flavor(request: pytest.FixtureRequest) -> str:
    """Through ``SessionDB`` and through ``AsyncSessionDB`` (tests/support/aio_driver.py)."""
    return str(request.param)


@pytest.fixture(params=SEARCH_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The contract runs on SQLite (with and without the CJK trigram index), PostgreSQL
    and PostgreSQL behind PgBouncer."""
    return str(request.param)


# -- sessions ---------------------------------------------------------------------------------


def test_create_session_stores_every_field(store: SessionDB, clock: FakeClock) -> None:
    before = clock.advance(5)
    assert (
        store.create_session(
            "s1",
            "cli",
            model="gpt",
            model_config={"temperature": 0.2},
            system_prompt="be brief",
            user_id="u1",
        )
        == "s1"
    )
    row = store.get_session("s1")
    assert row is not None
    assert row["source"] == "cli" and row["model"] == "gpt" and row["user_id"] == "u1"
    assert json.loads(row["model_config"]) == {"temperature": 0.2}
    assert row["system_prompt"] == "be brief"
    assert before < row["started_at"] <= clock.now
    assert row["message_count"] == 0 and row["tool_call_count"] == 0
    assert row["input_tokens"] == 0 and row["estimated_cost_usd"] is None
    assert set(row) == {c.name for c in ChatSession.__table__.columns}


def test_create_session_first_write_wins_and_empty_config_is_null(store: SessionDB) -> None:
    store.create_session("s1", "cli", model="first", model_config={})
    store.create_session("s1", "telegram", model="second", model_config={"a": 1})
    row = store.get_session("s1")
    assert row is not None
    assert (row["source"], row["model"], row["model_config"]) == ("cli", "first", None)


def test_create_session_with_unknown_parent_writes_nothing(store: SessionDB) -> None:
    with pytest.raises(UnknownSessionError):
        store.create_session("child", "cli", parent_session_id="missing")
    assert store.get_session("child") is None
    assert store.session_count() == 0


def test_unserialisable_model_config_writes_nothing(store: SessionDB) -> None:
    with pytest.raises(InvalidInputError, match="model_config"):
        store.create_session("s1", "cli", model_config={"bad": object()})
    assert store.get_session("s1") is None


def test_ensure_session_never_overwrites(store: SessionDB) -> None:
    store.ensure_session("s1")
    row = store.get_session("s1")
    assert row is not None and row["source"] == "unknown" and row["model"] is None
    store.ensure_session("s1", source="cli", model="m")
    row2 = store.get_session("s1")
    assert row2 == row


def test_end_session_first_end_wins_until_reopened(store: SessionDB) -> None:
    store.create_session("s1", "cli")
    store.end_session("s1", "user_exit")
    first = store.get_session("s1")
    assert first is not None and first["end_reason"] == "user_exit" and first["ended_at"]
    store.end_session("s1", "timeout")
    again = store.get_session("s1")
    assert again is not None
    assert (again["end_reason"], again["ended_at"]) == ("user_exit", first["ended_at"])
    store.reopen_session("s1")
    reopened = store.get_session("s1")
    assert reopened is not None and reopened["ended_at"] is None and reopened["end_reason"] is None
    store.end_session("s1", "compression")
    ended = store.get_session("s1")
    assert ended is not None and ended["end_reason"] == "compression"


def test_update_system_prompt(store: SessionDB) -> None:
    store.create_session("s1", "cli", system_prompt="old")
    store.update_system_prompt("s1", "new")
    row = store.get_session("s1")
    assert row is not None and row["system_prompt"] == "new"


def test_get_session_unknown_is_none(store: SessionDB) -> None:
    assert store.get_session("nope") is None


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("abc_1", "abc_1"),  # exact id wins even though it is also a prefix of abc_12
        ("abc_12", "abc_12"),
        ("abc_", None),  # ambiguous: abc_1, abc_12
        ("abcX", "abcX1"),
        ("q_", "q_1"),  # were `_` a wildcard, qZ2 would match too and make it ambiguous
        ("pct%", "pct%x"),
        ("pct", None),  # pct%x and pctz
        ("pctz", "pctz"),
        ("back\\", "back\\slash"),
        ("zzz", None),
    ],
)
def test_resolve_session_id_prefix_is_literal(
    store: SessionDB, prefix: str, expected: str | None
) -> None:
    for session_id in ("abc_1", "abc_12", "abcX1", "q_1", "qZ2", "pct%x", "pctz", "back\\slash"):
        store.create_session(session_id, "cli")
    assert store.resolve_session_id(prefix) == expected


def test_delete_session_orphans_children_and_keeps_grandchildren(store: SessionDB) -> None:
    store.create_session("root", "cli")
    store.create_session("child", "cli", parent_session_id="root")
    store.create_session("grandchild", "cli", parent_session_id="child")
    store.append_message("root", "user", "gone soon zebracorn")
    store.append_message("child", "user", "stays")
    assert store.delete_session("root") is True
    assert store.get_session("root") is None
    child, grandchild = store.get_session("child"), store.get_session("grandchild")
    assert child is not None and child["parent_session_id"] is None
    assert grandchild is not None and grandchild["parent_session_id"] == "child"
    assert store.message_count("root") == 0 and store.message_count("child") == 1
    assert store.delete_session("root") is False
    assert store.delete_session("never") is False


def _age(store: SessionDB, session_id: str, days: float) -> None:
    """Move a session's start into the past (the API always stamps `now`)."""
    with store.uow.session() as s:
        row = s.get(ChatSession, session_id)
        assert row is not None
        row.started_at = time.time() - days * 86400


def test_prune_sessions_only_old_ended_ones(store: SessionDB) -> None:
    for sid, source in (
        ("old_ended", "cli"),
        ("old_active", "cli"),
        ("new_ended", "cli"),
        ("old_ended_tg", "telegram"),
        ("kid", "cli"),
    ):
        store.create_session(sid, source)
    store.create_session("orphan_to_be", "cli", parent_session_id="old_ended")
    for sid in ("old_ended", "old_active", "old_ended_tg"):
        _age(store, sid, 100)
    for sid in ("old_ended", "new_ended", "old_ended_tg"):
        store.end_session(sid, "user_exit")
    store.append_message("old_ended", "user", "bye")

    assert store.prune_sessions(older_than_days=90, source="telegram") == 1
    assert store.get_session("old_ended_tg") is None and store.get_session("old_ended")
    assert store.prune_sessions() == 1
    assert store.get_session("old_ended") is None
    assert store.get_session("old_active") is not None  # active: never pruned, however old
    assert store.get_session("new_ended") is not None
    orphan = store.get_session("orphan_to_be")
    assert orphan is not None and orphan["parent_session_id"] is None
    assert store.message_count() == 0
    assert store.prune_sessions() == 0


def test_compression_tip_follows_only_continuations(store: SessionDB, clock: FakeClock) -> None:
    store.create_session("a", "cli")
    store.create_session("subagent", "cli", parent_session_id="a")  # before a ended: ignored
    clock.advance(1)
    store.end_session("a", "compression")
    clock.advance(1)
    store.create_session("b", "cli", parent_session_id="a")
    store.end_session("b", "compression")
    clock.advance(1)
    store.create_session("c", "cli", parent_session_id="b")
    assert store.get_compression_tip("a") == "c"
    assert store.get_compression_tip("b") == "c"
    assert store.get_compression_tip("c") == "c"
    assert store.get_compression_tip("subagent") == "subagent"
    assert store.get_compression_tip("missing") == "missing"


def test_compression_tip_ignores_children_started_before_the_end(
    store: SessionDB, clock: FakeClock
) -> None:
    store.create_session("a", "cli")
    store.create_session("early", "cli", parent_session_id="a")
    clock.advance(1)
    store.end_session("a", "compression")
    assert store.get_compression_tip("a") == "a"


# -- titles -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        (None, None),
        ("", None),
        ("   ", None),
        ("\x00\x07\x1f\x7f", None),
        ("  hello   world  ", "hello world"),
        ("tab\tnew\nline\r", "tab new line"),
        ("zero\u200bwidth\u200f", "zerowidth"),
        ("\u202eevil\u202c \u2066iso\u2069", "evil iso"),
        ("\ufeffbom\u2028sep\u2029", "bomsep"),
        ("obj\ufffcrepl\ufff9", "objrepl"),
        ("数据库重构 🚀 café, ¿qué?", "数据库重构 🚀 café, ¿qué?"),
        ("x" * 100, "x" * 100),
    ],
)
def test_sanitize_title(raw: str | None, clean: str | None) -> None:
    assert SessionDB.sanitize_title(raw) == clean


def test_sanitize_title_too_long_raises_value_error() -> None:
    with pytest.raises(ValueError, match="too long"):
        SessionDB.sanitize_title("x" * 101)
    with pytest.raises(TitleTooLongError):
        SessionDB.sanitize_title("y" * 500)
    assert SessionDB.MAX_TITLE_LENGTH == 100


def test_set_title_and_duplicate_writes_nothing(store: SessionDB) -> None:
    store.create_session("a", "cli")
    store.create_session("b", "cli")
    assert store.set_session_title("a", "  My   title ") is True
    assert store.get_session_title("a") == "My title"
    assert store.set_session_title("a", "My title") is True  # own title again: fine
    store.set_session_title("b", "B title")
    with pytest.raises(ValueError, match="already in use") as caught:
        store.set_session_title("b", "My title")
    assert isinstance(caught.value, TitleInUseError) and "a" in str(caught.value)
    assert store.get_session_title("b") == "B title"
    assert store.set_session_title("missing", "whatever") is False
    with pytest.raises(ValueError, match="too long"):
        store.set_session_title("b", "z" * 101)
    assert store.get_session_title("b") == "B title"
    assert store.set_session_title("b", "   ") is True
    assert store.get_session_title("b") is None


def test_null_titles_are_not_unique(store: SessionDB) -> None:
    for sid in ("a", "b", "c"):
        store.create_session(sid, "cli")
        store.set_session_title(sid, "")
    assert [store.get_session_title(s) for s in ("a", "b", "c")] == [None, None, None]


def test_get_session_by_title_is_exact(store: SessionDB) -> None:
    store.create_session("a", "cli")
    store.set_session_title("a", "50%_done")
    found = store.get_session_by_title("50%_done")
    assert found is not None and found["id"] == "a"
    assert store.get_session_by_title("50%") is None
    assert store.get_session_by_title("50x_done") is None


def test_resolve_session_by_title_prefers_newest_numbered(
    store: SessionDB, clock: FakeClock
) -> None:
    store.create_session("orig", "cli")
    store.set_session_title("orig", "proj")
    assert store.resolve_session_by_title("proj") == "orig"
    clock.advance(1)
    store.create_session("second", "cli")
    store.set_session_title("second", "proj #2")
    clock.advance(1)
    store.create_session("third", "cli")
    store.set_session_title("third", "proj #3")
    store.create_session("other", "cli")
    store.set_session_title("other", "proj #x")  # not a number: not a variant
    assert store.resolve_session_by_title("proj") == "third"
    assert store.resolve_session_by_title("nothing") is None


def test_resolve_by_title_wildcards_are_literal(store: SessionDB) -> None:
    store.create_session("a", "cli")
    store.set_session_title("a", "a_b #2")
    store.create_session("b", "cli")
    store.set_session_title("b", "100% #2")
    assert store.resolve_session_by_title("aXb") is None
    assert store.resolve_session_by_title("a_b") == "a"
    assert store.resolve_session_by_title("100%") == "b"
    assert store.resolve_session_by_title("100") is None


def test_next_title_in_lineage(store: SessionDB) -> None:
    assert store.get_next_title_in_lineage("x") == "x"
    store.create_session("1", "cli")
    store.set_session_title("1", "x")
    assert store.get_next_title_in_lineage("x") == "x #2"
    store.create_session("3", "cli")
    store.set_session_title("3", "x #3")
    assert store.get_next_title_in_lineage("x") == "x #4"
    assert store.get_next_title_in_lineage("x #3") == "x #4"


def test_next_title_from_numbered_variant(store: SessionDB) -> None:
    store.create_session("1", "cli")
    store.set_session_title("1", "x")
    store.create_session("2", "cli")
    store.set_session_title("2", "x #2")
    assert store.get_next_title_in_lineage("x #2") == "x #3"


def test_lineage_with_like_metacharacters(store: SessionDB) -> None:
    store.create_session("1", "cli")
    store.set_session_title("1", "50%_off #4")
    store.create_session("2", "cli")
    store.set_session_title("2", "50XXoff #9")  # would match if % or _ were wildcards
    assert store.get_next_title_in_lineage("50%_off") == "50%_off #5"
    assert store.get_next_title_in_lineage("50") == "50"


# -- tokens -----------------------------------------------------------------------------------


def test_incremental_tokens_and_costs(store: SessionDB) -> None:
    store.create_session("s", "cli")
    store.update_token_counts(
        "s",
        input_tokens=10,
        output_tokens=5,
        cache_read_tokens=1,
        cache_write_tokens=2,
        reasoning_tokens=3,
    )
    store.update_token_counts("s", input_tokens=1, output_tokens=1, estimated_cost_usd=0.25)
    row = store.get_session("s")
    assert row is not None
    assert [
        row[k]
        for k in (
            "input_tokens",
            "output_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "reasoning_tokens",
        )
    ] == [11, 6, 1, 2, 3]
    assert row["estimated_cost_usd"] == pytest.approx(0.25)
    assert row["actual_cost_usd"] is None  # untouched while None is passed
    store.update_token_counts("s", actual_cost_usd=0.5)
    store.update_token_counts("s", actual_cost_usd=0.25, estimated_cost_usd=None)
    row = store.get_session("s")
    assert row is not None
    assert row["actual_cost_usd"] == pytest.approx(0.75)
    assert row["estimated_cost_usd"] == pytest.approx(0.25)


def test_absolute_tokens_and_costs(store: SessionDB) -> None:
    store.create_session("s", "cli")
    store.update_token_counts("s", input_tokens=100, estimated_cost_usd=9.0, actual_cost_usd=3.0)
    store.update_token_counts("s", input_tokens=7, output_tokens=3, absolute=True)
    row = store.get_session("s")
    assert row is not None
    assert (row["input_tokens"], row["output_tokens"]) == (7, 3)
    assert row["estimated_cost_usd"] == 0  # COALESCE(None, 0)
    assert row["actual_cost_usd"] == pytest.approx(3.0)  # None leaves it
    store.update_token_counts("s", actual_cost_usd=1.5, estimated_cost_usd=2.0, absolute=True)
    row = store.get_session("s")
    assert row is not None
    assert row["actual_cost_usd"] == pytest.approx(1.5)
    assert row["estimated_cost_usd"] == pytest.approx(2.0)
    assert row["input_tokens"] == 0  # absolute sets every counter, default 0


def test_billing_fields_first_value_wins_status_overwrites(store: SessionDB) -> None:
    store.create_session("s", "cli")
    store.update_token_counts(
        "s",
        model="m1",
        billing_provider="openrouter",
        billing_base_url="https://a",
        billing_mode="x",
        cost_status="estimated",
        cost_source="table",
        pricing_version="v1",
    )
    store.update_token_counts(
        "s",
        model="m2",
        billing_provider="other",
        billing_base_url="https://b",
        billing_mode="y",
        cost_status="final",
        pricing_version=None,
    )
    row = store.get_session("s")
    assert row is not None
    assert (
        row["model"],
        row["billing_provider"],
        row["billing_base_url"],
        row["billing_mode"],
    ) == ("m1", "openrouter", "https://a", "x")
    assert (row["cost_status"], row["cost_source"], row["pricing_version"]) == (
        "final",
        "table",
        "v1",
    )


def test_model_backfilled_only_when_null(store: SessionDB) -> None:
    store.create_session("s", "cli", model="set")
    store.update_token_counts("s", model="other")
    row = store.get_session("s")
    assert row is not None and row["model"] == "set"


def test_update_tokens_unknown_session_is_a_no_op(store: SessionDB) -> None:
    store.update_token_counts("ghost", input_tokens=5)
    assert store.get_session("ghost") is None


def test_token_arguments_are_checked_before_writing(store: SessionDB) -> None:
    store.create_session("s", "cli")
    with pytest.raises(InvalidInputError):
        store.update_token_counts("s", input_tokens="10")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        store.update_token_counts("s", estimated_cost_usd="cheap")  # type: ignore[arg-type]
    row = store.get_session("s")
    assert row is not None and row["input_tokens"] == 0


# -- messages ---------------------------------------------------------------------------------


def test_append_message_counts_and_json(store: SessionDB) -> None:
    store.create_session("s", "cli")
    calls = [{"id": "c1", "function": {"name": "ls"}}, {"id": "c2", "function": {"name": "cat"}}]
    m1 = store.append_message("s", "user", "hello")
    m2 = store.append_message(
        "s",
        "assistant",
        None,
        tool_calls=calls,
        finish_reason="tool_calls",
        reasoning="think",
        reasoning_details=[{"k": 1}],
        codex_reasoning_items=[{"id": "r"}],
        token_count=12,
    )
    m3 = store.append_message(
        "s", "tool", "file.txt", tool_name="ls", tool_call_id="c1", tool_calls={"not": "a list"}
    )
    m4 = store.append_message("s", "assistant", "x", tool_calls={"single": True})
    m5 = store.append_message("s", "assistant", "y", tool_calls=[])
    assert m1 < m2 < m3 < m4 < m5
    row = store.get_session("s")
    assert row is not None and row["message_count"] == 5
    assert row["tool_call_count"] == 3  # 2 from the list + 1 other value; tool reply and [] count 0
    messages = store.get_messages("s")
    assert [m["id"] for m in messages] == [m1, m2, m3, m4, m5]
    assert messages[1]["tool_calls"] == calls
    assert messages[1]["reasoning_details"] == json.dumps([{"k": 1}])  # stays JSON text
    assert messages[1]["codex_reasoning_items"] == json.dumps([{"id": "r"}])
    assert messages[1]["finish_reason"] == "tool_calls" and messages[1]["token_count"] == 12
    assert messages[4]["tool_calls"] is None  # an empty list is stored as NULL
    assert set(messages[0]) == {c.name for c in Message.__table__.columns}


def test_append_message_unknown_session_writes_nothing(store: SessionDB) -> None:
    with pytest.raises(ValueError, match="does not exist") as caught:
        store.append_message("ghost", "user", "hi")
    assert isinstance(caught.value, UnknownSessionError)
    assert store.message_count() == 0


def test_unserialisable_payload_writes_nothing(store: SessionDB) -> None:
    store.create_session("s", "cli")
    with pytest.raises(InvalidInputError, match="tool_calls"):
        store.append_message("s", "assistant", "x", tool_calls=[{"f": {1, 2}}])
    with pytest.raises(InvalidInputError, match="reasoning_details"):
        store.append_message("s", "assistant", "x", reasoning_details=[object()])
    row = store.get_session("s")
    assert row is not None and row["message_count"] == 0 and store.message_count("s") == 0


def test_messages_ordered_by_timestamp_then_id(store: SessionDB) -> None:
    store.create_session("s", "cli")
    ids = store.append_messages(
        "s",
        [
            {"role": "user", "content": "late", "timestamp": 300.0},
            {"role": "user", "content": "early", "timestamp": 100.0},
            {"role": "user", "content": "tie-a", "timestamp": 200.0},
            {"role": "user", "content": "tie-b", "timestamp": 200.0},
        ],
    )
    assert [m["content"] for m in store.get_messages("s")] == ["early", "tie-a", "tie-b", "late"]
    assert len(ids) == 4 and ids == sorted(ids)


def test_keyset_paging(store: SessionDB) -> None:
    store.create_session("s", "cli")
    store.append_messages("s", [{"role": "user", "content": str(i)} for i in range(25)])
    pages, after = [], None
    while True:
        page = store.get_messages("s", limit=10, after_id=after)
        if not page:
            break
        pages.append([m["content"] for m in page])
        after = page[-1]["id"]
    assert [len(p) for p in pages] == [10, 10, 5]
    assert [content for page in pages for content in page] == [str(i) for i in range(25)]
    assert [m["content"] for m in store.iter_messages("s", page_size=7)] == [
        str(i) for i in range(25)
    ]


def test_append_messages_is_all_or_nothing(store: SessionDB) -> None:
    store.create_session("s", "cli")
    ids = store.append_messages(
        "s",
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "tool_calls": [{"id": 1}, {"id": 2}]},
            {"role": "tool", "content": "r", "tool_calls": [{"id": 3}]},
        ],
    )
    row = store.get_session("s")
    assert row is not None and (row["message_count"], row["tool_call_count"]) == (3, 2)
    assert [m["id"] for m in store.get_messages("s")] == ids
    with pytest.raises(InvalidInputError):
        store.append_messages("s", [{"role": "user", "content": "ok"}, {"content": "no role"}])
    with pytest.raises(InvalidInputError):
        store.append_messages("s", [{"role": "user", "colour": "blue"}])
    with pytest.raises(UnknownSessionError):
        store.append_messages("ghost", [{"role": "user", "content": "x"}])
    assert store.message_count() == 3
    assert store.append_messages("s", []) == []


def test_corrupted_json_is_decoded_defensively(
    store: SessionDB, caplog: pytest.LogCaptureFixture
) -> None:
    store.create_session("s", "cli")
    mid = store.append_message(
        "s",
        "assistant",
        "x",
        tool_calls=[{"id": 1}],
        reasoning_details=[1],
        codex_reasoning_items=[2],
    )
    with store.uow.connect() as conn:
        conn.execute(
            sa.update(Message.__table__)
            .where(Message.__table__.c.id == mid)
            .values(tool_calls="{broken", reasoning_details="[oops", codex_reasoning_items="nope")
        )
    with caplog.at_level(logging.WARNING, logger="hermes_store"):
        messages = store.get_messages("s")
        conversation = store.get_messages_as_conversation("s")
    assert messages[0]["tool_calls"] == []
    assert "tool_calls" not in conversation[0]  # [] is falsy: left out
    assert conversation[0]["reasoning_details"] is None
    assert conversation[0]["codex_reasoning_items"] is None
    assert any("not valid JSON" in r.message for r in caplog.records)


def test_conversation_format(store: SessionDB) -> None:
    store.create_session("s", "cli")
    calls = [{"id": "c1", "type": "function"}]
    store.append_message("s", "system", "sys")
    store.append_message("s", "user", "hi", reasoning="user reasoning is never shown")
    store.append_message(
        "s",
        "assistant",
        "calling",
        tool_calls=calls,
        reasoning="because",
        reasoning_details=[{"t": "r"}],
        codex_reasoning_items=[{"i": 1}],
    )
    store.append_message("s", "tool", "result", tool_name="ls", tool_call_id="c1")
    store.append_message("s", "assistant", "done", reasoning="")
    assert store.get_messages_as_conversation("s") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": calls,
            "reasoning": "because",
            "reasoning_details": [{"t": "r"}],
            "codex_reasoning_items": [{"i": 1}],
        },
        {"role": "tool", "content": "result", "tool_call_id": "c1", "tool_name": "ls"},
        {"role": "assistant", "content": "done"},
    ]


def test_clear_messages_keeps_session_and_tokens(store: SessionDB) -> None:
    store.create_session("s", "cli")
    store.create_session("other", "cli")
    store.append_message("s", "assistant", "a", tool_calls=[{"id": 1}])
    store.append_message("other", "user", "keep me")
    store.update_token_counts("s", input_tokens=42, estimated_cost_usd=1.25)
    store.clear_messages("s")
    row = store.get_session("s")
    assert row is not None
    assert (row["message_count"], row["tool_call_count"]) == (0, 0)
    assert row["input_tokens"] == 42 and row["estimated_cost_usd"] == pytest.approx(1.25)
    assert store.get_messages("s") == [] and store.message_count("other") == 1


def test_counts(store: SessionDB) -> None:
    store.create_session("a", "cli")
    store.create_session("b", "telegram")
    store.create_session("c", "telegram")
    store.append_message("a", "user", "1")
    store.append_message("b", "user", "2")
    store.append_message("b", "user", "3")
    assert store.message_count() == 3 and store.message_count("b") == 2
    assert store.message_count("nope") == 0
    assert store.session_count() == 3 and store.session_count("telegram") == 2
    assert store.session_count("discord") == 0


# -- export -----------------------------------------------------------------------------------


def test_export_session_and_all(store: SessionDB, clock: FakeClock) -> None:
    store.create_session("old", "cli")
    clock.advance(1)
    store.create_session("kid", "telegram", parent_session_id="old")
    store.append_message("old", "assistant", "x", tool_calls=[{"id": 1}])
    exported = store.export_session("old")
    assert exported is not None
    assert exported["id"] == "old" and exported["messages"][0]["tool_calls"] == [{"id": 1}]
    assert store.export_session("ghost") is None
    everything = store.export_all()
    assert [s["id"] for s in everything] == ["kid", "old"]  # newest first, children included
    assert [s["id"] for s in store.export_all(source="cli")] == ["old"]
    assert list(store.iter_export(page_size=1)) == everything


def test_search_sessions_newest_first_with_children(store: SessionDB, clock: FakeClock) -> None:
    for i, sid in enumerate(("a", "b", "c")):
        store.create_session(
            sid, "cli" if i < 2 else "tg", parent_session_id="a" if sid == "b" else None
        )
        clock.advance(1)
    assert [s["id"] for s in store.search_sessions()] == ["c", "b", "a"]
    assert [s["id"] for s in store.search_sessions(source="cli")] == ["b", "a"]
    assert [s["id"] for s in store.search_sessions(limit=1, offset=1)] == ["b"]
    assert "preview" not in store.search_sessions()[0]


# -- the ORM surface --------------------------------------------------------------------------


def test_orm_relationships(store: SessionDB) -> None:
    store.create_session("p", "cli")
    store.create_session("k", "cli", parent_session_id="p")
    store.append_messages(
        "p",
        [
            {"role": "user", "content": "b", "timestamp": 2.0},
            {"role": "user", "content": "a", "timestamp": 1.0},
        ],
    )
    with store.uow.session(write=False) as s:
        parent = s.get(ChatSession, "p")
        assert parent is not None
        assert [m.content for m in parent.messages] == ["a", "b"]
        assert [c.id for c in parent.children] == ["k"]
        assert parent.children[0].parent is parent
        assert parent.messages[0].session is parent
        count = s.scalar(
            sa.select(sa.func.count()).select_from(Message).where(Message.session_id == "p")
        )
        assert count == 2


def test_uow_session_rolls_back_on_error(store: SessionDB) -> None:
    with pytest.raises(RuntimeError), store.uow.session() as s:
        s.add(ChatSession(id="x", source="cli", started_at=1.0))
        s.flush()
        raise RuntimeError("boom")
    assert store.get_session("x") is None


def test_errors_share_one_root() -> None:
    for cls in (UnknownSessionError, TitleInUseError, TitleTooLongError, InvalidInputError):
        assert issubclass(cls, HermesStoreError) and issubclass(cls, ValueError)


def test_close_twice_and_context_manager(db_url: sa.URL) -> None:
    with SessionDB(db_url.render_as_string(hide_password=False)) as db:
        db.create_session("s", "cli")
    db.close()
    db.close()


def test_search_index_maintenance(store: SessionDB, backend: str) -> None:
    store.create_session("s", "cli")
    mid = store.append_message("s", "user", "the quokka jumped")
    # A CJK index missing where SQLite could have one is damage the check reports.
    assert store.check_search_index() is (backend != NO_CJK_INDEX)
    store.optimize_search_index()
    store.rebuild_search_index()
    assert store.check_search_index() is True
    assert [hit["id"] for hit in store.search_messages("quokka")] == [mid]
    if store.is_sqlite:  # break the index behind the triggers' back, then repair it
        with store.uow.connect() as conn:
            conn.exec_driver_sql("DROP TRIGGER messages_fts_update")
            conn.exec_driver_sql("UPDATE messages SET content = 'the wombat sat'")
        assert store.check_search_index() is False
        store.rebuild_search_index()
        assert store.check_search_index() is True
        assert [hit["id"] for hit in store.search_messages("wombat")] == [mid]
        assert store.search_messages("quokka") == []


def test_counters_pass_two_to_the_31_on_every_backend(store: SessionDB) -> None:
    """A long-lived session's cache reads pass 2,147,483,647: the counters keep counting
    (64-bit on PostgreSQL since h8_pg_bigint_counters; SQLite's INTEGER always was)."""
    big = 2**31 + 10
    store.create_session("long", "gateway")
    store.update_token_counts("long", cache_read_tokens=big, input_tokens=big)
    store.update_token_counts("long", cache_read_tokens=big, input_tokens=1)
    store.append_message("long", "user", "a huge prompt", token_count=big)
    row = store.get_session("long")
    assert row is not None
    assert (row["cache_read_tokens"], row["input_tokens"]) == (2 * big, big + 1)
    assert store.get_messages("long")[0]["token_count"] == big
