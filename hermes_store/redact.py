"""Mask the common shapes of secrets in exported text: API keys, bearer tokens, passwords in
URLs and assignments, private keys.

Used by every export format (``export --redact``). Each secret becomes ``[REDACTED:<kind>]``;
the words around it stay, so a conversation still reads. The patterns are tuned on two
corpora (``tests/test_redact.py``): realistic secrets, all of which must be masked, and
look-alikes (``max_tokens=2048``, ``sk-learn``, ``Bearer of bad news``, public keys, git hashes,
``https://user@host``) that must be left alone. Redaction is a safety net for sharing, not a
guarantee: a secret of no recognisable shape (a bare password in prose) passes.

A JSON string inside a value (``tool_calls[].function.arguments``) is parsed, redacted
string by string and written back, so escapes cannot hide a secret from the patterns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

#: The marker written in place of each secret.
MASK = "[REDACTED:{kind}]"
#: Export records carry this key (true) when they were redacted; ``import`` refuses them.
MARKER_KEY = "redacted"

_KEY_NAMES = (
    r"(?:[A-Za-z0-9]+[_.-])*(?:password|passwd|passphrase|secret|api[_-]?key|apikey|"
    r"access[_-]?key|access[_-]?token|auth[_-]?token|refresh[_-]?token|client[_-]?secret|"
    r"private[_-]?key|secret[_-]?key|session[_-]?token|token)"
)
_PLACEHOLDERS = frozenset(
    [
        "string",
        "str",
        "int",
        "integer",
        "number",
        "bool",
        "boolean",
        "null",
        "none",
        "nil",
        "true",
        "false",
        "undefined",
        "required",
        "optional",
        "any",
        "redacted",
        "hidden",
        "changeme_later",
        "example",
        "your_token",
        "your_key",
    ]
)


def _looks_random(value: str) -> bool:
    """A token rather than a word: it mixes digits with letters, or cases, or is long."""
    has_digit = any(c.isdigit() for c in value)
    has_alpha = any(c.isalpha() for c in value)
    mixed_case = any(c.isupper() for c in value) and any(c.islower() for c in value)
    return (has_digit and has_alpha) or mixed_case or len(value) >= 32


def _is_placeholder(value: str) -> bool:
    stripped = value.strip("\"'`")
    if not stripped or stripped.lower() in _PLACEHOLDERS:
        return True
    if set(stripped) <= set("*x.X•-_#"):  # ****, xxxx, ...
        return True
    starts = (
        "<",
        "${",
        "{{",
        "%(",
        "$",
        "os.environ",
        "process.env",
        "getenv",
        "env(",
        "[REDACTED",
    )
    return stripped.startswith(starts)


# (kind, compiled pattern, group holding the secret, predicate on the secret or None)
_RULES: list[tuple[str, re.Pattern[str], int, Callable[[str], bool] | None]] = [
    (
        "private-key",
        re.compile(
            r"(-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|[A-Za-z0-9+/=\s\\]*))",
            re.DOTALL,
        ),
        1,
        None,
    ),
    (
        "url-password",
        re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@\"'<>]*:([^\s@/\"'<>]+)@[^\s\"'<>]"),
        1,
        lambda v: not _is_placeholder(v),
    ),
    ("anthropic-key", re.compile(r"(?<![\w-])(sk-ant-[A-Za-z0-9_-]{20,})"), 1, None),
    (
        "openai-key",
        re.compile(r"(?<![\w-])(sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,})"),
        1,
        _looks_random,
    ),
    ("github-token", re.compile(r"(?<![\w-])(gh[pousr]_[A-Za-z0-9]{36,})"), 1, None),
    ("github-token", re.compile(r"(?<![\w-])(github_pat_[A-Za-z0-9_]{40,})"), 1, None),
    (
        "aws-access-key",
        re.compile(r"(?<![A-Za-z0-9])((?:AKIA|ASIA)[0-9A-Z]{16})(?![A-Za-z0-9])"),
        1,
        None,
    ),
    ("slack-token", re.compile(r"(?<![\w-])(xox[abposr]-[A-Za-z0-9-]{10,})"), 1, None),
    (
        "slack-webhook",
        re.compile(r"(https://hooks\.slack\.com/services/[A-Za-z0-9/_-]{20,})"),
        1,
        None,
    ),
    ("google-api-key", re.compile(r"(?<![\w-])(AIza[0-9A-Za-z_-]{35})"), 1, None),
    ("stripe-key", re.compile(r"(?<![\w-])((?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,})"), 1, None),
    ("huggingface-token", re.compile(r"(?<![\w-])(hf_[A-Za-z0-9]{30,})"), 1, _looks_random),
    ("gitlab-token", re.compile(r"(?<![\w-])(glpat-[A-Za-z0-9_-]{20,})"), 1, None),
    ("npm-token", re.compile(r"(?<![\w-])(npm_[A-Za-z0-9]{36})"), 1, None),
    (
        "jwt",
        re.compile(r"(?<![\w-])(eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"),
        1,
        None,
    ),
    (
        "bearer-token",
        re.compile(
            r"(?i)(?:\bauthorization\b[\"']?\s*[:=]\s*[\"']?(?:bearer|basic|token)?\s*|\bbearer\s+)"
            r"([A-Za-z0-9._~+/-]{12,}=*)"
        ),
        1,
        _looks_random,
    ),
    (
        "secret-assignment",
        re.compile(
            rf"(?i)(?<![A-Za-z0-9]){_KEY_NAMES}[\"']?\s*[:=]\s*"
            r"(?:\"([^\"\n]{4,})\"|'([^'\n]{4,})'|([^\s\"',;&)}\]]{4,}))"
        ),
        0,  # the first group that matched
        lambda v: not _is_placeholder(v),
    ),
]


def redact_text(text: str) -> str:
    """``text`` with every recognised secret replaced by ``[REDACTED:<kind>]``."""
    for kind, pattern, group, accept in _RULES:

        def replace(match: re.Match[str], kind: str = kind, group: int = group,
                    accept: Callable[[str], bool] | None = accept) -> str:  # fmt: skip
            index = group or next(i for i in range(1, 4) if match.group(i) is not None)
            secret = match.group(index)
            if accept is not None and not accept(secret):
                return match.group(0)
            start, end = match.span(index)
            whole = match.group(0)
            offset = match.start()
            return whole[: start - offset] + MASK.format(kind=kind) + whole[end - offset :]

        text = pattern.sub(replace, text)
    return text


def redact_value(value: Any) -> Any:
    """Redact every string inside ``value`` (dicts, lists, and JSON held in strings)."""
    if isinstance(value, str):
        stripped = value.lstrip()
        if stripped[:1] in ("{", "[") and len(stripped) > 1:
            try:
                parsed = json.loads(value)
            except ValueError:
                return redact_text(value)
            cleaned = redact_value(parsed)
            return value if cleaned == parsed else json.dumps(cleaned, ensure_ascii=False)
        return redact_text(value)
    if isinstance(value, dict):
        return {key: redact_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [redact_value(item) for item in value]
    return value


#: Columns that identify or classify rather than hold free text: never rewritten, so a
#: redacted export still links messages to sessions and imports (with --force) consistently.
STRUCTURAL_KEYS = frozenset(
    {"id", "session_id", "parent_session_id", "source", "role", "model", "tool_call_id",
     "tool_name", "finish_reason", "end_reason", "cost_status", "cost_source",
     "pricing_version", "billing_mode", "billing_provider"}
)  # fmt: skip


def redact_record(record: dict[str, Any]) -> dict[str, Any]:
    """An exported session (row and ``messages``) with its free text redacted and marked."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "messages" and isinstance(value, list):
            out[key] = [
                {k: v if k in STRUCTURAL_KEYS else redact_value(v) for k, v in m.items()}
                for m in value
            ]
        elif key in STRUCTURAL_KEYS:
            out[key] = value
        else:
            out[key] = redact_value(value)
    out[MARKER_KEY] = True
    return out
