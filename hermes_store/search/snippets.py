"""Snippets computed here rather than by the engines: FTS5's ``snippet()`` and PostgreSQL's
``ts_headline()`` walk every occurrence (quadratic in FTS5: a 256 KB log repeating the word
took 50 s), so a long content gets its snippet from a bounded window around the first match;
substring matches, which no engine marks, get theirs around the earliest fragment. Pure text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hermes_store.search.query import Item

SUBSTRING_SNIPPET_CHARS = 120
#: Longer contents get their snippet from a bounded window around the first match, computed
#: here; shorter ones get the engine's own.
SNIPPET_INLINE_CHARS = 2_000
SNIPPET_TOKENS = 40
#: How far around the first match the bounded snippet looks (characters).
SNIPPET_REACH = 1_000
#: Past this much text without a match (one the tokenizer folded, say), the snippet shows the
#: beginning of the content instead of reading on.
SNIPPET_SEARCH_CHARS = 1 << 20
#: A token as the tokenizers see one: a run of letters and digits.
TOKEN = re.compile(r"[^\W_]+")


def substring_snippet(content: str, pieces: Sequence[str]) -> str:
    """About 120 characters centred on the earliest fragment, marked ``>>>...<<<``."""
    found = [m for p in pieces if (m := re.search(re.escape(p), content, re.IGNORECASE))]
    if not found:
        return content[:SUBSTRING_SNIPPET_CHARS]
    match = min(found, key=lambda m: m.start())
    start, end = match.span()
    room = max(0, SUBSTRING_SNIPPET_CHARS - (end - start))
    left = max(0, start - room // 2)
    right = min(len(content), end + room - (start - left))
    left = max(0, min(left, right - SUBSTRING_SNIPPET_CHARS))
    return (
        ("..." if left > 0 else "")
        + content[left:start]
        + ">>>"
        + content[start:end]
        + "<<<"
        + content[end:right]
        + ("..." if right < len(content) else "")
    )


def term_patterns(items: Sequence[Item]) -> list[re.Pattern[str]]:
    """A case-insensitive pattern per positive term: its words in order, separated by anything
    that is not a letter or digit (as the tokenizers see them), a prefix term open at its end."""
    patterns = []
    negated = False
    for item in items:
        if isinstance(item, str):
            negated = item == "NOT"
            continue
        words = TOKEN.findall(item.words)
        if words and not negated:
            body = r"[\W_]+".join(re.escape(w) for w in words)
            end = r"[^\W_]*" if item.prefix else r"(?![^\W_])"  # FTS5 marks whole tokens
            patterns.append(re.compile(r"(?<![^\W_])" + body + end, re.IGNORECASE))
        negated = False
    return patterns


def bounded_snippet(
    content: str, patterns: Sequence[re.Pattern[str]], *, complete: bool = True
) -> str:
    """FTS5's snippet shape (``>>>match<<<`` in about SNIPPET_TOKENS tokens, ``...`` where cut)
    from a window around the FIRST match: the cost is the search for that match plus a window
    of a few kilobytes, however long or repetitive the content."""
    found = [m for p in patterns if (m := p.search(content))]
    start = min((m.start() for m in found), default=0)
    lo = max(0, start - SNIPPET_REACH)
    hi = min(len(content), start + SNIPPET_REACH * 2)
    window = content[lo:hi]
    tokens = list(TOKEN.finditer(window))
    if not tokens:
        return window[:SUBSTRING_SNIPPET_CHARS]
    first = next((i for i, t in enumerate(tokens) if t.start() + lo >= start), 0)
    begin = max(0, first - SNIPPET_TOKENS // 4)
    end = min(len(tokens), begin + SNIPPET_TOKENS)
    begin = max(0, end - SNIPPET_TOKENS)
    cut_lo = lo + tokens[begin].start() if begin > 0 or lo > 0 else 0
    cut_hi = lo + tokens[end - 1].end()
    whole_end = complete and end == len(tokens) and hi == len(content)
    if whole_end:
        cut_hi = len(content)
    text = content[cut_lo:cut_hi]
    marks = sorted(
        {(m.start(), m.end()) for p in patterns for m in p.finditer(text)}, key=lambda s: s[0]
    )
    out, at = [], 0
    for a, b in marks:
        if a < at:
            continue
        out += [text[at:a], ">>>", text[a:b], "<<<"]
        at = b
    out.append(text[at:])
    return ("..." if cut_lo > 0 else "") + "".join(out) + ("" if whole_end else "...")
