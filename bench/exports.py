"""Export records of agent conversations, drawn deterministically from a seed: what the import
and scale benchmarks restore (as ``SessionDB.export_session`` writes them).

Two mixes: :func:`agent_export_lines` (sessions of 6-60 messages, back to back) for the import
rate, and :func:`year_export_lines` (a long-time user's year, sized by :func:`tool_share`) for
``bench/scale.py``'s file. Both draw their texts with one :class:`TextWriter`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

from bench import corpus

#: Bytes a message of each kind adds to a file (content, row, full-text index), measured on
#: this generator's output: what sets the tool-call share for a size.
CHAT_BYTES = 1_170
TOOL_BYTES = 40_000
DAY = 86400.0

_WORDS = corpus.ENGLISH_WORDS
_CJK = (*corpus.CJK_PHRASES, corpus.CJK_TARGET)
_LEVELS = ("INFO", "DEBUG", "WARN", "ERROR")


class TextWriter:
    """Draws the texts of one export, deterministically from ``seed``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        self.lines = [
            f"{rng.choice(_LEVELS)} /srv/app/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py:"
            f"{rng.randint(1, 999)} " + " ".join(rng.choices(_WORDS, k=rng.randint(4, 12)))
            for _ in range(3000)
        ]
        self.prompt = " ".join(rng.choices(_WORDS, k=600))

    def chat(self, low: int, high: int, cjk: bool) -> str:
        rng = self.rng
        size = rng.randint(low, high)
        if cjk:
            text = "，".join(rng.choice(_CJK) for _ in range(max(1, size // 24))) + "。"
            return text + " " + " ".join(rng.choices(_WORDS, k=3))
        words: list[str] = []
        length = 0
        while length < size:
            word = rng.choice(_WORDS)
            words.append(word)
            length += len(word) + 1
        return " ".join(words).capitalize() + "."

    def tool_output(self, cjk: bool) -> str:
        rng = self.rng
        size = rng.randint(5_000, 50_000)
        out: list[str] = []
        length = 0
        while length < size:
            line = f"{rng.choice(self.lines)} id={rng.getrandbits(32):08x} t={rng.random():.6f}"
            if cjk and rng.random() < 0.2:
                line += " " + rng.choice(_CJK)
            out.append(line)
            length += len(line) + 1
        return "\n".join(out)


def next_role(previous: dict[str, Any] | None) -> str:
    """user -> assistant; an assistant's tool call -> the tool's output -> assistant again."""
    if previous is None:
        return "user"
    if previous["role"] == "assistant":
        return "tool" if previous["tool_calls"] else "user"
    return "assistant"


def _conversation(
    w: TextWriter,
    sid: str,
    count: int,
    at: float,
    first_id: int,
    *,
    longest_gap: float,
    tool_calls_per_turn: float,
    reasoning: bool,
) -> tuple[list[dict[str, Any]], int, float]:
    """``count`` messages of session ``sid`` after ``at`` (ids from ``first_id``, up to
    ``longest_gap`` seconds apart; an assistant turn calls a tool with ``tool_calls_per_turn``
    and, with ``reasoning``, reasons in 3 of 10 turns): the rows, how many call a tool, and the
    last message's time."""
    rng = w.rng
    rows: list[dict[str, Any]] = []
    tool_calls = 0
    while len(rows) < count:
        at += rng.uniform(0.5, longest_gap)
        cjk = rng.random() < 0.05
        role = next_role(rows[-1] if rows else None)
        row: dict[str, Any] = {
            "id": first_id + len(rows),
            "session_id": sid,
            "role": role,
            "content": None,
            "tool_call_id": None,
            "tool_calls": None,
            "tool_name": None,
            "timestamp": at,
            "token_count": None,
            "finish_reason": None,
            "reasoning": None,
            "reasoning_details": None,
            "codex_reasoning_items": None,
        }
        if role == "user":
            row["content"] = w.chat(20, 400, cjk)
        elif role == "assistant":
            row["content"] = w.chat(50, 1500, cjk)
            row["token_count"] = rng.randint(20, 900)
            row["finish_reason"] = "stop"
            if reasoning and rng.random() < 0.3:
                row["reasoning"] = w.chat(100, 800, False)
            if rng.random() < tool_calls_per_turn and len(rows) + 1 < count:
                call = f"call_{rng.getrandbits(48):012x}"
                row["tool_calls"] = [
                    {
                        "id": call,
                        "type": "function",
                        "function": {"name": "terminal", "arguments": '{"command": "ls"}'},
                    }
                ]
                row["finish_reason"] = "tool_calls"
                tool_calls += 1
        else:
            row["content"] = w.tool_output(cjk)
            row["tool_call_id"] = rows[-1]["tool_calls"][0]["id"]
            row["tool_name"] = "terminal"
        rows.append(row)
    return rows, tool_calls, at


def agent_export_lines(
    messages: int, seed: int = 31, tool_calls_per_turn: float = 0.4
) -> Iterator[dict[str, Any]]:
    """Export records (as ``SessionDB.export_session`` writes them) holding ``messages``; an
    assistant turn calls a tool (whose output follows) with ``tool_calls_per_turn``."""
    w = TextWriter(seed)
    rng = w.rng
    made = 0
    index = 0
    ids: list[str] = []
    clock = 1_760_000_000.0
    next_id = 1
    while made < messages:
        sid = f"2026{index:07d}_{rng.getrandbits(32):08x}"
        started = clock + rng.random()
        clock += rng.uniform(30, 3600)
        count = min(messages - made, rng.randint(6, 60))
        rows, tool_calls, at = _conversation(
            w,
            sid,
            count,
            started,
            next_id,
            longest_gap=40,
            tool_calls_per_turn=tool_calls_per_turn,
            reasoning=True,
        )
        next_id += len(rows)
        made += len(rows)
        cost = round(rng.uniform(0, 2), 6) + rng.random() * 1e-9
        record: dict[str, Any] = {
            "id": sid,
            "source": rng.choice(("cli", "telegram", "discord")),
            "user_id": None,
            "model": rng.choice(("claude-sonnet-4", "gpt-5", "qwen3-coder")),
            "model_config": json.dumps({"temperature": 0.7, "max_tokens": 4096}),
            "system_prompt": w.prompt,
            "parent_session_id": (
                ids[rng.randrange(len(ids))] if ids and rng.random() < 0.1 else None
            ),
            "started_at": started,
            "ended_at": at + 1.25,
            "end_reason": rng.choice(("user_exit", "timeout", "compression")),
            "message_count": len(rows),
            "tool_call_count": tool_calls,
            "input_tokens": rng.randint(1_000, 2_000_000),
            "output_tokens": rng.randint(100, 200_000),
            "cache_read_tokens": rng.randint(0, 1_000_000),
            "cache_write_tokens": rng.randint(0, 100_000),
            "reasoning_tokens": rng.randint(0, 50_000),
            "billing_provider": "openrouter",
            "billing_base_url": "https://openrouter.ai/api/v1",
            "billing_mode": "official_docs_snapshot",
            "estimated_cost_usd": cost,
            "actual_cost_usd": cost * 0.97,
            "cost_status": "estimated",
            "cost_source": "official_docs_snapshot",
            "pricing_version": "2026-01",
            "title": (
                f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} {index}" if rng.random() < 0.3 else None
            ),
            "messages": rows,
        }
        ids.append(sid)
        index += 1
        yield record


def year_export_lines(
    sessions: int, messages: int, tool_calls_per_turn: float, end: float, seed: int = 31
) -> Iterator[dict[str, Any]]:
    """``sessions`` sessions holding ``messages`` in all, started evenly over the 365 days
    before ``end`` (ended, so a prune may select them), as ``export`` writes them."""
    w = TextWriter(seed)
    rng = w.rng
    per = messages / sessions
    ids: list[str] = []
    next_id = 1
    made = 0
    for index in range(sessions):
        sid = f"2026{index:07d}_{rng.getrandbits(32):08x}"
        started = end - 365 * DAY + (index + rng.random()) * (365 * DAY / sessions)
        left = sessions - index
        count = messages - made if left == 1 else max(2, round(per + rng.uniform(-30, 30)))
        count = min(count, messages - made - 2 * (left - 1)) if left > 1 else count
        rows, tool_calls, at = _conversation(
            w,
            sid,
            count,
            started,
            next_id,
            longest_gap=20,
            tool_calls_per_turn=tool_calls_per_turn,
            reasoning=False,
        )
        next_id += len(rows)
        made += len(rows)
        ids.append(sid)
        yield {
            "id": sid,
            "source": rng.choice(("cli", "telegram", "discord")),
            "user_id": None,
            "model": rng.choice(("claude-sonnet-4", "gpt-5", "qwen3-coder")),
            "model_config": None,
            "system_prompt": None,
            "parent_session_id": (
                ids[rng.randrange(len(ids) - 1)] if len(ids) > 1 and rng.random() < 0.1 else None
            ),
            "started_at": started,
            "ended_at": at + 1.25,
            "end_reason": rng.choice(("user_exit", "timeout", "compression")),
            "message_count": len(rows),
            "tool_call_count": tool_calls,
            "input_tokens": rng.randint(1_000, 2_000_000),
            "output_tokens": rng.randint(100, 200_000),
            "cache_read_tokens": 0,
            "cache_write_tokens": 0,
            "reasoning_tokens": 0,
            "billing_provider": None,
            "billing_base_url": None,
            "billing_mode": None,
            "estimated_cost_usd": round(rng.uniform(0, 2), 6),
            "actual_cost_usd": None,
            "cost_status": "estimated",
            "cost_source": None,
            "pricing_version": None,
            "title": (
                f"{rng.choice(('deploy', 'fix', 'review'))} {index}" if rng.random() < 0.3 else None
            ),
            "messages": rows,
        }


def tool_share(size_mb: int, messages: int) -> float:
    """The share of assistant turns calling a tool that makes ``messages`` fill ``size_mb``:
    a share p makes p/2 of the messages tool outputs (user -> assistant [-> tool ->
    assistant]...)."""
    tool_fraction = (size_mb * 2**20 / messages - CHAT_BYTES) / (TOOL_BYTES - CHAT_BYTES)
    return max(0.0, min(0.9, 2 * tool_fraction))
