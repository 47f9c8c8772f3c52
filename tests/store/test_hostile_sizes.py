"""Hostile sizes and numbers: what one call may cost is bounded, and every integer argument is
range-checked before any SQL, on SQLite and PostgreSQL.

A message's text (content, reasoning, tool calls together) is limited to
``max_message_bytes`` (16 MiB by default): indexing 100 MB of distinct words ran for minutes.
Integers must fit SQLite's INTEGER (64-bit): a caller gets ``InvalidInputError`` (or a result),
never a driver's ``OverflowError``. Lookups by id prefix or title take text of any length:
SQLite refuses a LIKE pattern over 50,000 bytes, and shortening an id costs a few statements
however long it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import URL

from hermes_store import HermesStoreError, InvalidInputError, RetryPolicy, SessionDB
from hermes_store.cli import cli
from hermes_store.repo import listing
from hermes_store.validate import DEFAULT_MAX_MESSAGE_BYTES
from tests.support.backends import url_string
from tests.support.query_plans import captured_selects
from tests.support.waiting import GUARD, in_thread

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


# -- lookups by prefix and title of any length ---------------------------------------------------

#: Past SQLite's default limit on a LIKE pattern (50,000 bytes).
OVER_LIKE_LIMIT = 60_000


def test_lookups_longer_than_a_like_pattern_may_be_are_not_found(db_url: URL) -> None:
    """Text no session's id or title starts with is a miss however long it is, on both
    backends (SQLite raised "LIKE or GLOB pattern too complex" once any session existed)."""
    db = _open(db_url)
    try:
        db.set_session_title("s", "hello")
        for size in (OVER_LIKE_LIMIT, 1_000_000):
            text = "x" * size
            assert db.resolve_session_id(text) is None
            assert db.resolve_session_by_title(text) is None
            assert db.get_session_by_title(text) is None
            assert db.get_next_title_in_lineage(text) == text  # no lineage: the base itself
    finally:
        db.close()
    text = "x" * OVER_LIKE_LIMIT
    shown = CliRunner().invoke(cli, ["--db", url_string(db_url), "sessions", "show", text])
    assert shown.exit_code == 1, shown.output  # not found, not a database error (3)
    assert "no single session matches" in shown.output
    assert len(shown.output) < 400, len(shown.output)  # the reference quoted, its middle elided
    assert "..." in shown.output


def _nested(depth: int) -> object:
    value: object = "x" * 1000
    for _ in range(depth):
        value = (value,) * 6
    return value


#: A tuple of tuples five deep, a 1,000-character string at the bottom: its repr is 8 MB.
_NESTED = _nested(5)


@pytest.mark.parametrize(
    "call",
    [
        lambda db: db.append_messages("s", [{b"k" * 60_000: "user"}]),
        lambda db: db.search_messages("hello", sort="s" * 60_000),
        lambda db: db.append_messages("s", [{_NESTED: "user"}]),
        lambda db: db.get_messages("s", limit=10**5000),
        lambda db: db.append_messages("s", [{10**5000: "user"}]),
    ],
    ids=[
        "a huge non-text key",
        "a huge sort",
        "a key nested five deep",
        "an int past Python's digit limit",
        "a key past Python's digit limit",
    ],
)
def test_an_error_quotes_a_huge_argument_elided(db: SessionDB, call: Any) -> None:
    """A huge value, a deep one, or an int Python will not print (past 4,300 digits, where
    ``str()`` raises ValueError): the error is the package's, and a line long."""
    with pytest.raises(InvalidInputError) as refused:
        call(db)
    assert len(str(refused.value)) < 400, len(str(refused.value))


def test_long_ids_resolve_by_long_literal_prefixes(db: SessionDB) -> None:
    """Ids longer than a LIKE pattern may be (the API does not limit them) resolve by such
    prefixes, with ``%`` and ``_`` literal past the pattern's part too, on both backends."""
    common = "x" * OVER_LIKE_LIMIT
    ids = {"pct": common + "%a" + "y" * 10, "z": common + "Za", "pct_b": common + "%b"}
    for session_id in ids.values():
        db.create_session(session_id, "cli")
    assert db.resolve_session_id(common + "%a") == ids["pct"]
    assert db.resolve_session_id(common + "Z") == ids["z"]
    assert db.resolve_session_id(common + "%") is None  # pct and pct_b
    assert db.resolve_session_id(common + "_a") is None  # `_` is no wildcard
    assert db.resolve_session_id(common) is None
    assert db.resolve_session_id(ids["pct_b"]) == ids["pct_b"]
    shortened = db.unique_id_prefixes(list(ids.values()))
    assert shortened == {
        ids["pct"]: common + "%a",
        ids["z"]: common + "Z",
        ids["pct_b"]: ids["pct_b"],
    }
    for session_id, prefix in shortened.items():
        assert db.resolve_session_id(prefix) == session_id


def test_shortening_an_id_not_in_the_database_costs_a_few_statements(db: SessionDB) -> None:
    """An unknown id is answered whole after one count (one count per character took 32 s
    for 60,000 characters on PostgreSQL, and a 1 MB id never returned)."""
    for size in (2_000, 1_000_000):
        unknown = "z" * size
        with captured_selects(db) as statements:
            assert db.unique_id_prefixes([unknown]) == {unknown: unknown}
        assert len(statements) <= 3, len(statements)  # two neighbours, one count


def test_a_short_first_guess_is_corrected_by_bisection(
    db: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where neighbours in index order share nothing with the id (a collation that does not
    sort by bytes), the prefix still comes out as one count per length finds it, in a
    logarithmic number of counts."""
    ids = ["x" * 3000 + "a" + "tail", "x" * 3000 + "b", "x" * 1500 + "c", "y" * 3100]
    for session_id in ids:
        db.create_session(session_id, "cli")
    monkeypatch.setattr(listing, "_common_prefix", lambda a, b: 0)
    asked = [*ids, "x" * 2000 + "q" * 1000, "x" * 4000]  # two not in the database
    with captured_selects(db) as statements:
        shortened = db.unique_id_prefixes(asked)
    assert shortened == {
        ids[0]: "x" * 3000 + "a",
        ids[1]: ids[1],  # each shorter prefix is ids[0]'s too
        ids[2]: ids[2],  # likewise
        ids[3]: "y" * 8,
        asked[4]: asked[4],  # not in the database: whole
        asked[5]: asked[5],
    }
    assert len(statements) <= len(asked) * (2 + 14), len(statements)  # 2 + log2(4000) each


@pytest.mark.parametrize("argument", ["source_filter", "exclude_sources", "role_filter"])
def test_more_filter_values_than_a_statement_carries_are_refused_at_once(
    db_url: URL, argument: str
) -> None:
    """70,000 filter values: SQLite searches; PostgreSQL's protocol carries at most 65,535
    parameters, and psycopg's refusal (no SQLSTATE, as a lost connection's) was retried as an
    unreachable server for the whole unavailable timeout."""
    values = [f"v{index}" for index in range(70_000)]
    if argument == "source_filter":
        values.append("cli")
    if argument == "role_filter":
        values.append("user")
    with SessionDB(url_string(db_url), retry=RetryPolicy(unavailable_timeout=600)) as db:
        db.ensure_session("s", "cli")
        db.append_message("s", "user", "hello world")

        def search() -> object:
            return db.search_messages("hello", **{argument: values})

        outcome, thread = in_thread(search)
        thread.join(GUARD)
        assert not thread.is_alive(), "the search was retried as an outage"
        [(kind, value)] = outcome
        if db_url.get_backend_name() == "sqlite":
            assert kind == "ok" and len(value) == 1
        else:
            assert kind == "error" and isinstance(value, InvalidInputError), value
            assert "at most 65535 parameters" in str(value)
