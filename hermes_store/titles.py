"""Session titles: sanitising, and the "title #N" lineage rules of the original store."""

from __future__ import annotations

import re

from hermes_store.errors import TitleTooLongError

MAX_TITLE_LENGTH = 100

# ASCII controls except TAB/LF/CR (those are whitespace and collapse to a space below).
_CONTROL = "\x00-\x08\x0b\x0c\x0e-\x1f\x7f"
# Zero-width, line/paragraph separators, direction embeddings/overrides/isolates, BOM,
# and the interlinear annotation and object replacement characters.
_INVISIBLE = "\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ufff9-\ufffc"
_STRIP = re.compile(f"[{_CONTROL}{_INVISIBLE}]")
_WHITESPACE = re.compile(r"\s+")
_NUMBERED = re.compile(r"^(.*?) #(\d+)$", re.DOTALL)


def sanitize_title(title: str | None) -> str | None:
    """The title as stored: invisible and control characters removed, whitespace collapsed.

    None or an empty result gives None; more than ``MAX_TITLE_LENGTH`` characters raises
    (no silent truncation).
    """
    if not title:
        return None
    if not isinstance(title, str):
        raise TypeError(f"a title must be a string, not {type(title).__name__}")
    cleaned = _WHITESPACE.sub(" ", _STRIP.sub("", title)).strip()
    if not cleaned:
        return None
    if len(cleaned) > MAX_TITLE_LENGTH:
        raise TitleTooLongError(f"Title too long ({len(cleaned)} chars, max {MAX_TITLE_LENGTH})")
    return cleaned


def lineage_base(title: str) -> str:
    """``"x #3"`` -> ``"x"``; a title without a number is its own base."""
    match = _NUMBERED.match(title)
    return match.group(1) if match else title


def lineage_number(base: str, title: str) -> int | None:
    """N when ``title`` is exactly ``"{base} #N"``, else None (``%`` and ``_`` are literal)."""
    prefix = f"{base} #"
    if title.startswith(prefix) and title[len(prefix) :].isdigit():
        return int(title[len(prefix) :])
    return None


def escape_like(value: str) -> str:
    """Escape LIKE's wildcards (and the escape character ``\\``) so they match literally."""
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
