"""Hostile sizes and numbers: what one call may cost is bounded, and every integer argument is
range-checked before any SQL, on SQLite and PostgreSQL.

A message's text (content, reasoning, tool calls together) is limited to
``max_message_bytes`` (16 MiB by default): indexing 100 MB of distinct words ran for minutes.
Integers must fit SQLite's INTEGER (64-bit): a caller gets ``InvalidInputError`` (or a result),
never a driver's ``OverflowError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.engine import URL

from hermes_store import HermesStoreError, InvalidInputError, SessionDB
from hermes_store.validate import DEFAULT_MAX_MESSAGE_BYTES
from tests.support.backends import url_string

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def _open(db_url: URL, **options: Any) -> SessionDB:
    db = SessionDB(url_string(db_url), **options)
    db.ensure_session("s", "cli")
    db.append_message("s", "user", "hello world")
    return db


@pytest.fixture
def db(db_url: URL) -> Iterator[SessionDB]:
    store = _open(db_url)
    yield store
    store.close()


def _count(db: SessionDB) -> tuple[int, int]:
    session = db.get_session("s")
    assert session is not None
    return int(session["message_count"] or 0), len(db.get_messages("s"))


def test_a_message_over_the_default_limit_is_refused_before_anything_is_written(
    db: SessionDB,
) -> None:
    assert db.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES == 16 * 1024 * 1024
    before = _count(db)
    too_big = "x" * (DEFAULT_MAX_MESSAGE_BYTES + 1)
    with pytest.raises(InvalidInputError, match="at most 16,777,216"):
        db.append_message("s", "user", too_big)
    with pytest.raises(InvalidInputError, match="bytes of text"):
        db.append_messages(
            "s", [{"role": "user", "content": "fine"}, {"role": "user", "content": too_big}]
        )
    assert _count(db) == before


def test_the_limit_counts_utf8_bytes_of_every_text_field_together(db_url: URL) -> None:
    db = _open(db_url, max_message_bytes=1000)
    try:
        before = _count(db)
        db.append_message("s", "user", "a" * 1000)  # exactly the limit
        db.append_message("s", "user", "中" * 333)  # 999 bytes in 333 characters
        db.append_message("s", "assistant", "a" * 400, reasoning="b" * 400, tool_calls=["c"])
        refused: list[dict[str, Any]] = [
            {"content": "a" * 1001},
            {"content": "中" * 334},  # 1002 bytes in 334 characters
            {"content": "a" * 400, "reasoning": "b" * 400, "tool_calls": ["c" * 200]},
            {"content": None, "reasoning_details": [{"text": "d" * 1000}]},
        ]
        for extra in refused:
            with pytest.raises(InvalidInputError, match="at most 1,000"):
                db.append_message("s", "assistant", **extra)
        assert _count(db) == (before[0] + 3, before[1] + 3)
    finally:
        db.close()
    unlimited = _open(db_url, max_message_bytes=None)
    try:
        unlimited.append_message("s", "user", "x" * (DEFAULT_MAX_MESSAGE_BYTES + 1))
    finally:
        unlimited.close()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8M", 2**63])
def test_max_message_bytes_must_be_a_positive_byte_count(db_url: URL, bad: object) -> None:
    with pytest.raises(InvalidInputError, match="max_message_bytes"):
        SessionDB(url_string(db_url), max_message_bytes=bad)  # type: ignore[arg-type]


def test_search_at_the_largest_offset_answers_instead_of_overflowing(db: SessionDB) -> None:
    assert db.search_messages("hello", offset=INT64_MAX) == []
    assert db.search_messages("hello", offset=INT64_MAX - 1, limit=INT64_MAX) == []
    assert len(db.search_messages("hello", limit=INT64_MAX)) == 1
    for sort in ("newest", "oldest"):
        assert db.search_messages("hello", offset=INT64_MAX, sort=sort) == []


#: Arguments the sweep leaves alone: destructive on purpose, or not a number.
_SKIP = {"close", "transaction", "connect", "session", "run_sync"}
_HOSTILE = (INT64_MAX, INT64_MIN, INT64_MAX + 1, INT64_MIN - 1, 2**31, -1, 2**100)
_FILL = {
    "session_id": "s",
    "query": "hello",
    "role": "user",
    "source": "cli",
    "title": "t",
    "content": "x",
    "messages": [],
    "new_session_id": "s2",
}


def _integer_arguments(db: SessionDB) -> Iterator[tuple[str, Any, str, inspect.Signature]]:
    for name, method in inspect.getmembers(db, predicate=inspect.ismethod):
        if name.startswith("_") or name in _SKIP:
            continue
        signature = inspect.signature(method)
        for parameter in signature.parameters.values():
            annotation = str(parameter.annotation)
            number = isinstance(parameter.default, int) and not isinstance(parameter.default, bool)
            if number or ("int" in annotation and "bool" not in annotation):
                yield name, method, parameter.name, signature


def test_every_integer_argument_is_range_checked_before_any_sql(db: SessionDB) -> None:
    """Each public method's integer arguments at and past the 64-bit bounds: a result or the
    package's error, never a driver's OverflowError (or any other exception)."""
    swept = set()
    escaped = []
    for name, method, argument, signature in _integer_arguments(db):
        swept.add(f"{name}({argument})")
        for value in _HOSTILE:
            kwargs: dict[str, Any] = {}
            for parameter in signature.parameters.values():
                if parameter.name == argument:
                    kwargs[argument] = value
                elif parameter.default is inspect.Parameter.empty and parameter.kind not in (
                    parameter.VAR_POSITIONAL,
                    parameter.VAR_KEYWORD,
                ):
                    kwargs[parameter.name] = _FILL.get(parameter.name, "s")
            try:
                result = method(**kwargs)
                if inspect.isgenerator(result):
                    list(result)
            except HermesStoreError as error:
                if "integer out of range" in str(error):  # a 32-bit bind: not checked first
                    escaped.append(f"{name}({argument}={value}): {error}")
            except Exception as error:
                escaped.append(f"{name}({argument}={value}): {type(error).__name__}: {error}")
    assert not escaped, escaped
    assert {"search_messages(offset)", "search_messages(limit)", "get_messages(limit)"} <= swept
