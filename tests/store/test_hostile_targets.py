"""Misused query arguments and targets the driver refuses: the package's own errors, said
before anything runs, never a driver's TypeError, OverflowError or UnicodeEncodeError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

import hermes_store
from hermes_store import SessionDB
from hermes_store.errors import InvalidInputError
from hermes_store.query import read_only_query
from tests.support.backends import url_string

#: (sql, params, what the refusal names) of misused read_only_query calls.
MISUSES: list[tuple[Any, Any, str]] = [
    ("SELECT '\ud800'", None, "the query is not valid Unicode"),
    ("SELECT :a", {"a": "\ud800"}, "parameter 'a' is not valid Unicode"),
    ("SELECT :a", {"\udcff": 1}, "the parameter name '\\\\udcff' is not valid Unicode"),
    ("SELECT :a", {"a": 2**64}, "parameter 'a' must be within the 64-bit range"),
    ("SELECT :a", {"a": -(2**63) - 1}, "parameter 'a' must be within the 64-bit range"),
    ("SELECT :a", [1], "the parameters must be a mapping of names to values, not list"),
    ("SELECT :a", {1: 1}, "parameter names must be strings, not 1"),
    (b"SELECT 1", None, "the query must be a string, not bytes"),
]


@pytest.fixture
def sqlite_target(tmp_path: Path) -> str:
    path = tmp_path / "state.db"
    with SessionDB(path) as db:
        db.create_session("s", "cli")
    return str(path)


@pytest.mark.parametrize(("sql", "params", "named"), MISUSES)
def test_a_misused_query_argument_is_refused_by_name_on_sqlite(
    sqlite_target: str, sql: Any, params: Any, named: str
) -> None:
    with pytest.raises(InvalidInputError, match=named):
        read_only_query(sqlite_target, sql, params)


@pytest.mark.parametrize(("sql", "params", "named"), MISUSES)
def test_a_misused_query_argument_is_refused_by_name_on_postgresql(
    pg_url: URL, sql: Any, params: Any, named: str
) -> None:
    with pytest.raises(InvalidInputError, match=named):
        read_only_query(url_string(pg_url), sql, params)


def test_query_arguments_at_the_edges_still_run(sqlite_target: str) -> None:
    found = read_only_query(
        sqlite_target, "SELECT :a, :b, :c, :d", {"a": 2**63 - 1, "b": -(2**63), "c": "ü", "d": True}
    )
    assert found.rows == [(2**63 - 1, -(2**63), "ü", 1)]
    with pytest.raises(InvalidInputError, match="max_rows must be a whole number"):
        read_only_query(sqlite_target, "SELECT 1", max_rows="3")  # type: ignore[arg-type]


def test_a_connection_option_the_driver_refuses_is_a_config_error(pg_url: URL) -> None:
    """An unknown parameter in a PostgreSQL URL made ``upgrade`` raise psycopg's raw
    ``ProgrammingError: invalid connection option``: the target cannot be opened as given."""
    bogus = f"{url_string(pg_url)}{'&' if pg_url.query else '?'}no_such_option=1"
    with pytest.raises(hermes_store.StoreConfigError, match='invalid connection option "no_such'):
        hermes_store.upgrade(bogus)
