"""Argument checks that every public method of ``SessionDB`` runs before it touches a database.

One rule for the whole API: an argument of the wrong type, or a value no backend can store as
given, is refused with :class:`~hermes_store.errors.InvalidInputError` (a ``ValueError``), so
callers never see a driver's ``OverflowError``, ``TypeError`` or ``ProgrammingError`` and
nothing is written. The rules:

- ids, titles, queries and other text: ``str`` (``bytes`` are refused, not decoded);
- integers (token counts, ``limit``, ``offset``, ids): ``int`` but not ``bool``, within
  SQLite's 64-bit range (-2**63 .. 2**63 - 1); ``limit`` and page sizes where noted are >= 0/1;
- real numbers (costs, timestamps, day counts): ``int`` or ``float`` but not ``bool``, finite
  (NaN and infinities are refused on both backends: PostgreSQL would store them, SQLite would
  turn NaN into NULL); an ``int`` also within the 64-bit range (no driver binds a larger one);
  timestamps are seconds since 1970 that a date holds (years 1 to 9999), costs at most
  :data:`MAX_COST_USD` either way (a running total then never overflows to infinity);
- lists of names (``exclude_sources``, ``source_filter``, ``role_filter``): a ``str`` (one name)
  or an iterable of ``str``;
- flags: ``bool`` (or ``int``);
- messages for ``append_messages``: mappings with ``str`` keys;
- one message's text (content, reasoning, tool calls ... together): at most the store's
  ``max_message_bytes`` of UTF-8 (:data:`DEFAULT_MAX_MESSAGE_BYTES`): indexing costs time and
  memory in proportion to it.

A counter that would overflow 64 bits in the database is refused by the statement itself
(see ``repo.statements.token_statement``): the check must be atomic with the increment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, overload

from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import ArgumentError

from hermes_store import timestamps
from hermes_store.echo import echoed
from hermes_store.engine.factory import to_url
from hermes_store.errors import InvalidInputError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: The largest cost one call may give, either way (a trillion dollars): added up ever after,
#: such costs stay below a float's range for far longer than any store lives.
MAX_COST_USD = 1e12
#: The most UTF-8 bytes of text one message may hold (content, reasoning, tool calls ...
#: together). Indexing is linear but not cheap: 16 MiB of distinct words cost about 10 s and
#: 700 MB of memory in SQLite's full-text index, 16 MiB of CJK about 35 s and 1.1 GB in its
#: trigram index (100 MB ran for minutes); a 10 MB message still fits, as before.
#: ``SessionDB(max_message_bytes=None)``: no limit.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: A message's text columns (the JSON ones serialised).
_MESSAGE_TEXT = (
    "content",
    "reasoning",
    "tool_calls",
    "reasoning_details",
    "codex_reasoning_items",
    "tool_name",
    "tool_call_id",
    "finish_reason",
)
#: SQLite's busy timeout is a 32-bit count of milliseconds.
_MAX_BUSY_S = (2**31 - 1) // 1000


def _kind(value: object) -> str:
    return type(value).__name__


def text(name: str, value: object, *, optional: bool = False) -> None:
    """A ``str`` (or ``None`` when ``optional``). Encoding and NUL are checked by the store."""
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string, not {_kind(value)}")


#: The longest idempotency key accepted (characters): room for a UUID with a prefix, far
#: below what would make its index entry costly.
MAX_IDEMPOTENCY_KEY_LENGTH = 200


def idempotency_key(value: object) -> None:
    """``None`` or a non-empty ``str`` of at most :data:`MAX_IDEMPOTENCY_KEY_LENGTH`
    characters, without NUL or lone surrogates (every backend stores it as given)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidInputError(f"idempotency_key must be a string or None, not {_kind(value)}")
    if not value:
        raise InvalidInputError("idempotency_key must not be empty (pass None for no key)")
    if len(value) > MAX_IDEMPOTENCY_KEY_LENGTH:
        raise InvalidInputError(
            f"idempotency_key is {len(value)} characters; at most "
            f"{MAX_IDEMPOTENCY_KEY_LENGTH} are accepted"
        )
    if "\x00" in value:
        raise InvalidInputError("idempotency_key contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidInputError(f"idempotency_key is not valid Unicode: {error.reason}") from None


@overload
def integer(
    name: str,
    value: object,
    *,
    optional: Literal[False] = False,
    minimum: int = INT64_MIN,
    maximum: int = INT64_MAX,
) -> int: ...
@overload
def integer(
    name: str, value: object, *, optional: bool, minimum: int = INT64_MIN, maximum: int = INT64_MAX
) -> int | None: ...
def integer(
    name: str,
    value: object,
    *,
    optional: bool = False,
    minimum: int = INT64_MIN,
    maximum: int = INT64_MAX,
) -> int | None:
    """An ``int`` (not ``bool``) within ``minimum .. maximum`` (64-bit by default), returned as
    a plain ``int``: a subclass's own comparisons (which may say anything) neither decide the
    range check nor reach the caller's arithmetic."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an integer, not {_kind(value)}")
    number = int.__index__(value)  # int's own slot: the value itself, whatever the subclass says
    if not minimum <= number <= maximum:
        raise InvalidInputError(
            f"{name} must be between {minimum} and {maximum}, not {echoed(number)}"
        )
    return number


def real(name: str, value: object, *, optional: bool = False, scale: float = 1.0) -> None:
    """A finite ``int`` or ``float`` (not ``bool``); ``value * scale`` must stay finite too."""
    if value is None and optional:
        return
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidInputError(f"{name} must be a number, not {_kind(value)}")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise InvalidInputError(
            f"{name} must be a float or an integer within the 64-bit range, not {value}"
        )
    if not math.isfinite(float(value) * scale):
        raise InvalidInputError(f"{name} must be a finite number, not {value!r}")


def cost(name: str, value: object) -> None:
    """A cost in US dollars, None, or a finite number of at most :data:`MAX_COST_USD` either
    way: the store adds costs up, and a running total must stay a number."""
    real(name, value, optional=True)
    if value is not None and not -MAX_COST_USD <= float(value) <= MAX_COST_USD:  # type: ignore[arg-type]
        raise InvalidInputError(f"{name} must be at most {MAX_COST_USD:.0e} USD, not {value!r}")


def flag(name: str, value: object) -> None:
    if not isinstance(value, int):  # bool is an int
        raise InvalidInputError(f"{name} must be True or False, not {_kind(value)}")


def names(name: str, value: object) -> list[str] | None:
    """``None``, or a list of names from one ``str`` or an iterable of ``str``."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise InvalidInputError(f"{name} must be a list of strings, not {_kind(value)}")
    listed = list(value)
    for item in listed:
        if not isinstance(item, str):
            raise InvalidInputError(f"{name} must hold strings only, not {_kind(item)}")
    return listed


def page(limit: object, offset: object) -> tuple[int, int]:
    """``limit`` and ``offset`` of a page: integers >= 0 (as plain ints)."""
    return integer("limit", limit, minimum=0), integer("offset", offset, minimum=0)


def lenient_page(limit: object, offset: object) -> tuple[int, int]:
    """For the calls that always read a negative ``limit``/``offset`` as 0: integers only (as
    plain ints)."""
    return integer("limit", limit), integer("offset", offset)


def messages(value: object) -> list[Mapping[str, Any]]:
    """``append_messages``' batch: an iterable (not a mapping or text) of mappings with
    ``str`` keys, materialised once so a generator is read only once."""
    if isinstance(value, str | bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise InvalidInputError(f"messages must be a list of mappings, not {_kind(value)}")
    batch = list(value)
    for index, message in enumerate(batch):
        if not isinstance(message, Mapping):
            raise InvalidInputError(f"message {index} must be a mapping, not {_kind(message)}")
        for key in message:
            if not isinstance(key, str):
                raise InvalidInputError(f"message {index}: keys must be strings, not {echoed(key)}")
    return batch


def moment(name: str, value: object, *, optional: bool = False) -> None:
    """Seconds since 1970 that a date holds (years 1 to 9999: :mod:`hermes_store.timestamps`);
    one in milliseconds, the usual slip, is named as such."""
    real(name, value, optional=optional)
    if value is None:
        return
    seconds = float(value)  # type: ignore[arg-type]  # real() let only an int or a float by
    if timestamps.fits(seconds):
        return
    slip = seconds > timestamps.LATEST and timestamps.fits(seconds / 1000)
    raise InvalidInputError(
        f"{name} must be seconds since 1970 within the years 1 to 9999, not {value!r}"
        + (" (it looks like milliseconds)" if slip else "")
    )


def message_numbers(token_count: object, timestamp: object) -> None:
    integer("token_count", token_count, optional=True)
    if timestamp is not None:
        moment("timestamp", timestamp)


def token_counts(
    names: Sequence[str], counts: Sequence[object], estimated: object, actual: object
) -> None:
    """``update_token_counts``' numbers: ``counts`` (named by ``names``) 64-bit integers, the
    costs finite numbers or None. The usual call (plain ints, no costs) is settled in one
    pass without a call per value."""
    if estimated is None and actual is None and len(counts) == 5:
        a, b, c, d, e = counts  # the usual call, settled in plain bytecode: no loop, no call
        if (
            type(a) is int
            and type(b) is int
            and type(c) is int
            and type(d) is int
            and type(e) is int
            and INT64_MIN <= a <= INT64_MAX
            and INT64_MIN <= b <= INT64_MAX
            and INT64_MIN <= c <= INT64_MAX
            and INT64_MIN <= d <= INT64_MAX
            and INT64_MIN <= e <= INT64_MAX
        ):
            return
    for name, value in zip(names, counts, strict=True):
        integer(name, value)
    cost("estimated_cost_usd", estimated)
    cost("actual_cost_usd", actual)


def target(value: object) -> None:
    """What ``SessionDB`` opens: a path (``str``/``PathLike`` of ``str``), a URL or an Engine."""
    if value is None or isinstance(value, URL | Engine):
        return
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise InvalidInputError(f"db_path must be a path, a URL or an Engine, not {_kind(value)}")
    if "\x00" in value or not value.strip():
        raise InvalidInputError(f"db_path is not a usable path: {echoed(value)}")
    if "://" in value:
        try:
            to_url(value).get_dialect()
        except ArgumentError as error:  # a malformed URL, or no such backend installed
            raise InvalidInputError(f"db_path is not a usable database URL: {error}") from None


def open_options(retry: object, checkpoint_every: object, writer_busy_timeout: object) -> None:
    from hermes_store.uow.unit import RetryPolicy  # the store imports this module first

    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidInputError(f"retry must be a RetryPolicy, not {_kind(retry)}")
    if retry is not None:
        real("retry.unavailable_timeout", retry.unavailable_timeout)
        if retry.unavailable_timeout < 0:
            raise InvalidInputError("retry.unavailable_timeout must be >= 0 seconds")
    integer("checkpoint_every", checkpoint_every, minimum=0)
    real("writer_busy_timeout", writer_busy_timeout, optional=True)
    if writer_busy_timeout is not None and not 0 <= writer_busy_timeout <= _MAX_BUSY_S:  # type: ignore[operator]
        raise InvalidInputError(f"writer_busy_timeout must be between 0 and {_MAX_BUSY_S} s")


def max_message_bytes(value: object) -> int | None:
    """The store's per-message text limit: a positive byte count, or ``None`` (no limit)."""
    return integer("max_message_bytes", value, optional=True, minimum=1)


def message_size(row: Mapping[str, Any], limit: int | None) -> None:
    """One message's text columns together within ``limit`` UTF-8 bytes. Counting characters
    first (O(1) each) settles every message under a quarter of the limit without encoding."""
    if limit is None:
        return
    chars = 0
    for key in _MESSAGE_TEXT:
        value = row[key]
        if value is not None:
            chars += len(value)
    if chars * 4 <= limit:  # a UTF-8 character is at most 4 bytes
        return
    texts = [row[key] for key in _MESSAGE_TEXT if row[key]]
    size = sum(len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > limit:
        raise InvalidInputError(
            f"the message holds {size:,} bytes of text (content, reasoning and tool calls "
            f"together); a message may hold at most {limit:,} (SessionDB(max_message_bytes=...))"
        )
