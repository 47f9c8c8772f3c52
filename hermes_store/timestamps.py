"""Timestamps: float seconds since 1970 (``time.time()``), as the original store writes them.

The store takes only those a ``datetime`` can show (years 1 to 9999): a timestamp in
milliseconds, the usual slip, is refused where it comes in. A file the original store wrote may
hold any number, though, so what shows a stored timestamp turns one that no ``datetime`` holds
into text instead of failing, and so is one that is no number at all (SQLite lets text or a
blob sit in a REAL column).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, tzinfo

__all__ = ["EARLIEST", "LATEST", "fits", "moment", "shown"]

#: The first and last seconds the store takes: a day inside ``datetime``'s range at each end,
#: so the time in any time zone still fits.
EARLIEST = datetime(1, 1, 2, tzinfo=UTC).timestamp()
LATEST = datetime(9999, 12, 30, tzinfo=UTC).timestamp()


def fits(seconds: float) -> bool:
    """Whether ``seconds`` since 1970 is a moment the store takes."""
    return EARLIEST <= seconds <= LATEST


def moment(seconds: object, tz: tzinfo | None = None) -> datetime | None:
    """``seconds`` since 1970 as a ``datetime`` (local time without ``tz``), None when no
    ``datetime`` holds it (out of range, NaN, beyond the platform's ``time_t``, or not a
    number: text or a blob a file the original store wrote holds there)."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return None
    if isinstance(seconds, float) and not math.isfinite(seconds):
        return None
    try:
        return datetime.fromtimestamp(seconds, tz)
    except (OverflowError, OSError, ValueError):
        return None


def shown(seconds: object, fmt: str, tz: tzinfo | None = None) -> str:
    """``seconds`` formatted with ``fmt``, or the value itself (its ``repr``: text shows its
    quotes, a blob its bytes) when no date holds it."""
    when = moment(seconds, tz)
    return when.strftime(fmt) if when is not None else f"{seconds!r} (not a date)"
