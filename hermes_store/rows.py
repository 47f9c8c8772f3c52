"""The shapes of the dicts the store returns, for type checkers (they are still plain dicts).

The original store's callers index rows by column name, so the store keeps returning ``dict``
objects; these ``TypedDict``\\ s only tell mypy and pyright which keys exist and what they hold.
Timestamps are float epoch seconds; counters are ints; optional columns may be ``None``.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class SessionRow(TypedDict):
    """Every column of ``sessions`` (``get_session``, ``search_sessions``, ...)."""

    id: str
    source: str
    user_id: str | None
    model: str | None
    model_config: str | None
    system_prompt: str | None
    parent_session_id: str | None
    started_at: float
    ended_at: float | None
    end_reason: str | None
    message_count: int | None
    tool_call_count: int | None
    input_tokens: int | None
    output_tokens: int | None
    title: str | None
    cache_read_tokens: int | None
    cache_write_tokens: int | None
    reasoning_tokens: int | None
    billing_provider: str | None
    billing_base_url: str | None
    billing_mode: str | None
    estimated_cost_usd: float | None
    actual_cost_usd: float | None
    cost_status: str | None
    cost_source: str | None
    pricing_version: str | None


class SessionListRow(SessionRow):
    """A ``list_sessions_rich`` row: the session plus its preview and last activity."""

    preview: str
    last_active: float
    #: Present when a compression chain was projected onto its tip: the root's id.
    _lineage_root_id: NotRequired[str]


class MessageRow(TypedDict):
    """Every column of ``messages``, ``tool_calls`` decoded from JSON (``get_messages``)."""

    id: int
    session_id: str
    role: str
    content: str | None
    tool_call_id: str | None
    tool_calls: Any
    tool_name: str | None
    timestamp: float
    token_count: int | None
    finish_reason: str | None
    reasoning: str | None
    reasoning_details: str | None
    codex_reasoning_items: str | None


class ContextLine(TypedDict):
    role: str
    content: str


class SearchHit(TypedDict):
    """One ``search_messages`` result: exactly these keys."""

    id: int
    session_id: str
    role: str
    snippet: str | None
    timestamp: float
    tool_name: str | None
    source: str
    model: str | None
    session_started: float
    context: list[ContextLine]


class ExportRecord(SessionRow):
    """``export_session`` / ``iter_export``: the session row plus its messages."""

    messages: list[MessageRow]


class ConversationTurn(TypedDict):
    """``get_messages_as_conversation``: OpenAI chat format, optional keys only when truthy."""

    role: str
    content: str | None
    tool_call_id: NotRequired[str]
    tool_name: NotRequired[str]
    tool_calls: NotRequired[list[Any]]
    reasoning: NotRequired[str]
    reasoning_details: NotRequired[Any]
    codex_reasoning_items: NotRequired[Any]
