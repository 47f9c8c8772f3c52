"""A deterministic, realistic-looking corpus of agent conversations for the benchmarks.

Messages are drawn from a Zipf-distributed vocabulary, so search meets the shapes it meets in
real files: a very common word, a rare word (a handful of hits), a planted phrase, and Chinese
messages written without spaces (one FTS5 token per run, so CJK search needs its fallback).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: The four searches reported: one query of each kind.
COMMON_WORD = "server"
RARE_WORD = "quasarite"
PHRASE = '"rollback the migration"'
CJK_QUERY = "数据库"

_PHRASE_TEXT = "rollback the migration"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


#: The agent conversations' English words and Chinese phrases (``bench/exports.py`` draws
#: its texts from them too).
ENGLISH_WORDS = _words(
    "the a to of and in is it that for on with this be as you are we can not was but file "
    "error code run test build config function value line return data user request output "
    "change update fix check need should will use model call token session message tool "
    "result python install version path import module class method list string type null "
    "deploy service cache query index table database log debug issue branch commit merge "
    "review script shell command network timeout retry lock thread process memory disk agent "
    "prompt context reply stream chunk image upload parse json yaml schema field"
)
_SYLLABLES = _words(
    "ka lo mi ne ru sa ti vo ze qu ba de fi go hu ji ky la mo nu pe ri so tu wa xe yo"
)
CJK_PHRASES = (
    "我们需要检查一下",
    "连接超时了",
    "请帮我看看这个错误",
    "服务器重启之后",
    "日志里面显示",
    "配置文件有问题",
    "这个函数返回空值",
    "部署到生产环境",
    "测试全部通过了",
    "缓存没有刷新",
)
CJK_TARGET = "数据库连接失败"
SOURCES = (("cli", 0.5), ("telegram", 0.3), ("discord", 0.2))


def _vocabulary(rng: random.Random, size: int = 4000) -> list[str]:
    words = list(ENGLISH_WORDS)
    seen = set(words) | {COMMON_WORD, RARE_WORD}
    while len(words) < size:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


@dataclass
class SessionPlan:
    """One session to build: its row arguments, messages and lifecycle."""

    session_id: str
    source: str
    model: str
    messages: list[dict[str, Any]]
    parent_id: str | None = None
    end_reason: str | None = None
    title: str | None = None
    tokens: tuple[int, int] = (0, 0)


@dataclass
class Corpus:
    """``sessions`` sessions holding ``messages`` messages in total, reproducible from ``seed``."""

    messages: int
    seed: int = 42
    per_session: int = 20
    rare_hits: int = 12
    plans: list[SessionPlan] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        vocabulary = _vocabulary(rng)
        weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(vocabulary))]
        # choices() accumulates plain weights on every call (4,000 of them per message): the
        # same cumulative weights, computed once, draw the same words 20x faster.
        cumulative = list(itertools.accumulate(weights))
        sessions = max(1, self.messages // self.per_session)
        rare_every = max(1, self.messages // self.rare_hits)
        made = 0
        for index in range(sessions):
            count = self.messages - made if index == sessions - 1 else self.per_session
            texts = []
            for _ in range(count):
                texts.append(self._content(rng, vocabulary, cumulative, made % rare_every == 0))
                made += 1
            source = rng.choices([s for s, _ in SOURCES], [w for _, w in SOURCES])[0]
            plan = SessionPlan(
                session_id=f"{20260101 + index // 500:08d}_{index:07d}_{rng.getrandbits(24):06x}",
                source=source,
                model=rng.choice(("claude-sonnet-4", "gpt-5", "qwen3-coder")),
                messages=[_message(i, text, rng) for i, text in enumerate(texts)],
                tokens=(rng.randint(100, 50_000), rng.randint(50, 20_000)),
            )
            roll = rng.random()
            if index and roll < 0.10:  # a delegated child of an earlier session
                plan.parent_id = self.plans[rng.randrange(len(self.plans))].session_id
            elif index and roll < 0.15 and self.plans[-1].end_reason is None:
                # the previous session was compressed into this one (a compression chain)
                self.plans[-1].end_reason = "compression"
                plan.parent_id = self.plans[-1].session_id
            if rng.random() < 0.3:
                plan.title = f"{rng.choice(vocabulary)} {rng.choice(vocabulary)} {index}"
            if rng.random() < 0.6 and plan.end_reason is None:
                plan.end_reason = rng.choice(("user_exit", "timeout", "reset"))
            self.plans.append(plan)

    @staticmethod
    def _content(
        rng: random.Random, vocabulary: list[str], cumulative: list[float], rare: bool
    ) -> str:
        if rng.random() < 0.05:  # a Chinese message, no spaces between words
            parts = rng.sample(CJK_PHRASES, 3)
            if rng.random() < 0.3:
                parts.insert(1, CJK_TARGET)
            return "，".join(parts) + "。"
        words = rng.choices(vocabulary, cum_weights=cumulative, k=rng.randint(8, 90))
        if rng.random() < 0.25:
            words.insert(rng.randrange(len(words) + 1), COMMON_WORD)
        if rng.random() < 0.01:
            words.insert(rng.randrange(len(words) + 1), _PHRASE_TEXT)
        if rare:
            words.insert(rng.randrange(len(words) + 1), RARE_WORD)
        return " ".join(words).capitalize() + "."

    def iter_plans(self) -> Iterator[SessionPlan]:
        return iter(self.plans)


def _message(index: int, text: str, rng: random.Random) -> dict[str, Any]:
    """A user/assistant/tool turn; assistants sometimes call a tool."""
    turn = index % 3
    if turn == 0:
        return {"role": "user", "content": text}
    if turn == 1:
        message: dict[str, Any] = {"role": "assistant", "content": text, "token_count": len(text)}
        if rng.random() < 0.3:
            message["tool_calls"] = [
                {
                    "id": f"call_{index}",
                    "type": "function",
                    "function": {"name": "terminal", "arguments": '{"command": "ls"}'},
                }
            ]
            message["finish_reason"] = "tool_calls"
        return message
    return {
        "role": "tool",
        "content": text,
        "tool_name": "terminal",
        "tool_call_id": f"call_{index}",
    }


def bulk_batch(start: int, size: int, seed: int = 7) -> list[dict[str, Any]]:
    """``size`` messages for a bulk import (deterministic per ``start``)."""
    rng = random.Random(seed * 1_000_003 + start)
    vocabulary = ENGLISH_WORDS
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": " ".join(rng.choices(vocabulary, k=rng.randint(8, 60))),
        }
        for i in range(size)
    ]
