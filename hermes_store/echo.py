"""Quoting what a caller gave in a message, within reason, and an error's message on one line
(imports nothing heavy: the CLI uses it before SQLAlchemy loads)."""

from __future__ import annotations

import reprlib

__all__ = ["echoed", "one_line"]

#: Past this, a quote keeps its start and its end.
LIMIT = 240
_ECHO = reprlib.Repr()
_ECHO.maxstring = _ECHO.maxother = 160
_ECHO.maxlevel = 2


def echoed(value: object) -> str:
    """``repr(value)`` for a message, within :data:`LIMIT` characters (a long string keeps its
    start and end, a container its first items two levels deep): an error that quotes what the
    caller gave stays readable when that was 60,000 characters long. Never raises: a
    ``__repr__`` that does, or an int too long to print, is named instead."""
    try:
        shown = _ECHO.repr(value)
    except Exception:  # a __repr__ that raises; an int past Python's digit limit
        if isinstance(value, int):
            shown = f"<an integer of {int.__index__(value).bit_length()} bits>"
        else:
            shown = f"<a {type(value).__name__} that cannot be shown>"
    if len(shown) > LIMIT:
        shown = f"{shown[: LIMIT - 80]}...{shown[-77:]}"
    return shown


def one_line(error: object) -> str:
    """The first line of an error's message (at most 500 characters): a server's or a
    driver's error goes on with its context, hints and SQLAlchemy's background link."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return first if len(first) <= 500 else first[:497] + "..."
