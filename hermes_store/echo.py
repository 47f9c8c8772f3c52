"""Quoting what a caller gave in a message, within reason (imports nothing heavy: the CLI
uses it before SQLAlchemy loads)."""

from __future__ import annotations

import reprlib

__all__ = ["echoed"]

_ECHO = reprlib.Repr()
_ECHO.maxstring = _ECHO.maxother = 160


def echoed(value: object) -> str:
    """``repr(value)`` for a message, its middle elided past 160 characters: an error that
    quotes what the caller gave stays readable when that was 60,000 characters long."""
    return _ECHO.repr(value)
