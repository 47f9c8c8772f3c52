"""Conversations as Markdown, for reading and sharing (``hermes-store export --format md``).

Input is what :meth:`SessionDB.export_session` / ``iter_export`` yield (a session row with its
``messages``). Each session gets a title, a metadata table and its turns in order; reasoning,
tool calls and tool results are folded into ``<details>`` blocks, which GitHub, GitLab and most
editors render collapsed. Times are UTC, so the same database renders the same bytes anywhere.
No file access here: the CLI writes the text.

A file the original store wrote may hold any value in any column (SQLite's dynamic typing):
text where a number belongs is shown as the text, a blob as its size and bytes in hex
(:func:`plain`), a timestamp no date holds as the value itself.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from datetime import UTC
from typing import Any

from hermes_store import jsontext, timestamps

RowDict = dict[str, Any]

REDACTED_NOTE = (
    "> **Redacted export.** Secrets of known shapes (API keys, tokens, passwords, private keys) "
    "and values under keys that name a secret were replaced by `[REDACTED:kind]`; "
    "`hermes-store import` refuses redacted exports."
)


#: The most bytes of a blob shown in hex where a line is short (a listing, a folded turn).
BLOB_SHOWN = 64


def plain(value: object, *, limit: int | None = None) -> str:
    """``value`` as text for people: text as it is, a blob as ``[blob: N bytes, hex ...]``
    (the first ``limit`` bytes, all without one), any other value as Python prints it."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        shown = data if limit is None else data[:limit]
        more = "…" if len(shown) < len(data) else ""
        size = f"{len(data):,} byte{'' if len(data) == 1 else 's'}"
        return f"[blob: {size}, hex {shown.hex()}{more}]" if data else "[blob: 0 bytes]"
    return str(value)


def count(value: object) -> str:
    """A counter with thousands separators; a stored value that is no number as it is."""
    if value is None:
        return "0"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:,}"
    return plain(value, limit=BLOB_SHOWN)


def money(value: object) -> str:
    """A dollar amount to four places; a stored value that is no number as it is."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.4f}"
    return plain(value, limit=BLOB_SHOWN)


def _when(ts: object) -> str:
    if ts is None:
        return "—"
    return timestamps.shown(ts, "%Y-%m-%d %H:%M:%S UTC", UTC)


def _cell(value: object) -> str:
    """A table cell: one line, pipes escaped."""
    return " ".join(plain(value).split()).replace("|", "\\|")


def _fence(text: str, language: str = "") -> str:
    """``text`` in a code fence longer than any backtick run inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{language}\n{text}\n{ticks}"


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{_escape_html(summary)}</summary>\n\n{body}\n\n</details>"


def _escape_html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _pretty_json(raw: Any) -> str:
    """Tool arguments are a JSON string in the OpenAI format: shown indented when they parse."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return raw
        return jsontext.dumps(parsed, ensure_ascii=False, indent=2)
    return jsontext.dumps(raw, ensure_ascii=False, indent=2)


def _tool_calls(message: RowDict) -> list[str]:
    calls = message.get("tool_calls")
    if not calls:
        return []
    parts = []
    for call in calls if isinstance(calls, list) else [calls]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            name = str(function.get("name", "?"))
            call_id = call.get("id") if isinstance(call, dict) else None
            summary = f"Tool call: {name}" + (f" ({call_id})" if call_id else "")
            parts.append(_details(summary, _fence(_pretty_json(function.get("arguments")), "json")))
        else:
            parts.append(_details("Tool call", _fence(_pretty_json(call), "json")))
    return parts


def _heading(number: int, message: RowDict) -> str:
    role = str(message.get("role") or "?")
    label = {"user": "User", "assistant": "Assistant", "tool": "Tool result", "system": "System"}
    title = label.get(role, role.capitalize())
    if message.get("tool_name"):
        title += f" · {plain(message['tool_name'])}"
    return f"{number}. {title} · {_when(message.get('timestamp'))}"


def render_message(number: int, message: RowDict, level: int = 3) -> str:
    """One turn: a heading, folded reasoning and tool calls, then the content."""
    parts = [f"{'#' * level} {_heading(number, message)}"]
    reasoning = plain(message.get("reasoning") or "")
    if reasoning:
        parts.append(_details(f"Reasoning ({len(reasoning):,} chars)", reasoning))
    for key, label in (("reasoning_details", "Reasoning details"),
                       ("codex_reasoning_items", "Codex reasoning items")):  # fmt: skip
        if message.get(key):
            parts.append(_details(label, _fence(_pretty_json(message[key]), "json")))
    parts.extend(_tool_calls(message))
    content = plain(message["content"]) if message.get("content") is not None else ""
    if content:
        if message.get("role") == "tool":
            lines = content.count("\n") + 1
            tool = plain(message.get("tool_name") or "the tool")
            summary = f"Output of {tool} ({lines:,} line{'' if lines == 1 else 's'})"
            parts.append(_details(summary, _fence(content)))
        else:
            parts.append(content.strip("\n"))
    elif not message.get("tool_calls"):
        parts.append("*(empty)*")
    return "\n\n".join(parts)


def _metadata(session: RowDict) -> str:
    rows: list[tuple[str, str]] = [
        ("id", f"`{plain(session['id'])}`"),
        ("source", plain(session["source"])),
    ]
    if session.get("model"):
        rows.append(("model", plain(session["model"])))
    if session.get("parent_session_id"):
        rows.append(("continues", f"`{plain(session['parent_session_id'])}`"))
    rows.append(("started", _when(session.get("started_at"))))
    ended = _when(session.get("ended_at"))
    if session.get("end_reason"):
        ended += f" ({plain(session['end_reason'])})"
    rows.append(("ended", ended if session.get("ended_at") is not None else "still active"))
    rows.append(
        (
            "messages",
            f"{count(session.get('message_count'))} ({count(session.get('tool_call_count'))} "
            "tool calls)",
        )
    )
    tokens = f"{count(session.get('input_tokens'))} in / {count(session.get('output_tokens'))} out"
    extra = [
        f"{count(session.get(key))} {label}"
        for key, label in (
            ("cache_read_tokens", "cache read"),
            ("cache_write_tokens", "cache write"),
            ("reasoning_tokens", "reasoning"),
        )
        if session.get(key)
    ]
    rows.append(("tokens", tokens + (f" ({', '.join(extra)})" if extra else "")))
    if session.get("actual_cost_usd") is not None:
        rows.append(("cost", f"${money(session['actual_cost_usd'])}"))
    elif session.get("estimated_cost_usd"):
        rows.append(("cost", f"~${money(session['estimated_cost_usd'])} (estimated)"))
    table = ["| | |", "| --- | --- |"]
    table += [f"| {name} | {_cell(value)} |" for name, value in rows]
    return "\n".join(table)


def render_session(record: RowDict, *, level: int = 1) -> str:
    """One session as Markdown: ``#`` title, metadata, system prompt (folded), the turns."""
    title = plain(record.get("title") or f"Session {plain(record['id'])}")
    parts = [f"{'#' * level} {title}"]
    if record.get("redacted") and level == 1:
        parts.append(REDACTED_NOTE)
    parts.append(_metadata(record))
    if record.get("system_prompt"):
        parts.append(_details("System prompt", _fence(plain(record["system_prompt"]))))
    messages = record.get("messages") or []
    for number, message in enumerate(messages, 1):
        parts.append(render_message(number, message, level + 2))
    if not messages:
        parts.append("*No messages.*")
    return "\n\n".join(parts) + "\n"


def render_document(records: Iterable[RowDict], *, redacted: bool = False) -> Iterable[str]:
    """Many sessions as one document, streamed a session at a time."""
    yield "# Hermes conversations\n\n"
    if redacted:
        yield REDACTED_NOTE + "\n\n"
    first = True
    for record in records:
        if not first:
            yield "\n---\n\n"
        first = False
        yield render_session(record, level=2)


#: The longest title slug and readable id in a file name (characters; the slug also at most
#: ``_SLUG_BYTES`` in UTF-8): with the day, the digest and the temp file's prefix and suffix
#: (``export_writer``), a name stays well under the 255 bytes file systems allow.
_SLUG_CHARS = 60
_SLUG_BYTES = 120
_ID_CHARS = 36
#: Hex digits of the id's digest in a usual name, and all of them (for the rare export in
#: which two sessions' usual names meet).
SHORT_DIGEST = 8
FULL_DIGEST = 64


def file_name(record: RowDict, *, digest: int = SHORT_DIGEST) -> str:
    """A stable, portable file name for one session: date, title slug, the id as far as it is
    plain ASCII, and ``digest`` hex digits of the SHA-256 of the whole id.

    The readable part alone is not unique (ids that share their first characters, or differ
    only in what a portable name cannot hold, or a slug and an id that join the same way);
    the digest of the id makes the name the session's own, whichever other sessions the
    export holds, so the same database always exports to the same names. Only ``\\w``, ``-``
    and ``.md``: no path separator, no leading dot."""
    started = timestamps.moment(record.get("started_at") or 0, UTC)
    day = started.strftime("%Y-%m-%d") if started is not None else "undated"
    slug = re.sub(r"[^\w]+", "-", str(record.get("title") or ""), flags=re.UNICODE)
    slug = slug.strip("-").lower()[:_SLUG_CHARS]
    slug = slug.encode()[:_SLUG_BYTES].decode(errors="ignore").strip("-")
    raw_id = str(record["id"])
    readable_id = re.sub(r"[^A-Za-z0-9_-]+", "-", raw_id)[:_ID_CHARS].strip("-")
    hashed = hashlib.sha256(raw_id.encode("utf-8", "surrogatepass")).hexdigest()[:digest]
    return "-".join(part for part in (day, slug, readable_id, hashed) if part) + ".md"
