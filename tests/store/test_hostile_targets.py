"""Misused query arguments and targets the driver refuses: the package's own errors, said
before anything runs, never a driver's TypeError, OverflowError or UnicodeEncodeError."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

import hermes_store
from hermes_store import SessionDB
from hermes_store.errors import InvalidInputError
from hermes_store.query import read_only_query
from tests.support.backends import analyst_url, run_sql, url_string
from tests.support.waiting import GUARD, in_thread

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


#: Statements a role reaching past the database runs inside a read-only transaction: a
#: server file written, or written from a DO block that first undoes a narrowing SET ROLE.
_SERVER_FILE_WRITES = [
    "COPY (SELECT id FROM sessions) TO '{path}'",
    "DO $$ BEGIN RESET ROLE; EXECUTE 'COPY (SELECT 1) TO ''{path}'''; END $$",
]


@pytest.fixture
def server_file() -> Iterator[Path]:
    """A path the PostgreSQL server (on this machine) could write, absent before and after."""
    path = Path(f"/tmp/hermes-query-{uuid.uuid4().hex}")
    yield path
    assert not path.exists(), "the query wrote a file on the server"


@pytest.mark.parametrize("statement", _SERVER_FILE_WRITES)
def test_a_query_as_a_superuser_is_refused_before_its_statement_is_sent(
    pg_url: URL, server_file: Path, statement: str
) -> None:
    """Connected as a superuser, ``COPY ... TO`` a server file ran in the read-only
    transaction (and ``TO PROGRAM`` would have run a program): such a role is refused."""
    with SessionDB(url_string(pg_url)) as db:
        db.create_session("s", "cli")
    sql = statement.format(path=server_file)
    with pytest.raises(hermes_store.StoreConfigError, match="queries are refused to the Post"):
        read_only_query(url_string(pg_url), sql)
    with pytest.raises(hermes_store.StoreConfigError, match="connect as a role that may only"):
        read_only_query(url_string(pg_url), "SELECT count(*) FROM sessions")


def test_a_query_as_a_member_of_pg_write_server_files_is_refused(
    pg_url: URL, server_file: Path
) -> None:
    """Not a superuser, but granted the server's files: refused the same way."""
    role = f"hermes_files_{uuid.uuid4().hex[:12]}"
    run_sql(pg_url, f"CREATE ROLE {role} LOGIN", f"GRANT pg_write_server_files TO {role}")
    try:
        as_role = url_string(pg_url.set(username=role))
        with pytest.raises(hermes_store.StoreConfigError, match=f"role '{role}'"):
            read_only_query(as_role, f"COPY (SELECT 1) TO '{server_file}'")
    finally:
        run_sql(pg_url, f"DROP ROLE {role}")


@pytest.mark.parametrize("statement", _SERVER_FILE_WRITES)
def test_an_ordinary_role_queries_and_the_server_refuses_its_file_writes(
    pg_url: URL, server_file: Path, statement: str
) -> None:
    with SessionDB(url_string(pg_url)) as db:
        db.create_session("s", "cli")
    analyst = analyst_url(pg_url)
    assert read_only_query(analyst, "SELECT id FROM sessions").rows == [("s",)]
    with pytest.raises(InvalidInputError, match="the database refused the query"):
        read_only_query(analyst, statement.format(path=server_file))


# -- a query is stopped after its timeout; what the server refuses is the query's fault --------

_ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


def _stopped(call: Callable[[], object]) -> BaseException:
    """What ``call`` raised, in a thread joined with a hang guard (only a bug reaches it)."""
    outcome, thread = in_thread(call)
    thread.join(GUARD)
    assert not thread.is_alive(), "the query was not stopped"
    [(kind, value)] = outcome
    assert kind == "error", value
    assert isinstance(value, BaseException)
    return value


def test_an_endless_query_on_sqlite_stops_at_its_timeout(sqlite_target: str) -> None:
    raised = _stopped(lambda: read_only_query(sqlite_target, _ENDLESS, timeout=0.3))
    assert isinstance(raised, InvalidInputError), raised
    assert "ran past its timeout of 0.3 s" in str(raised)


def test_a_query_holding_a_lock_on_postgresql_lets_go_at_its_timeout(pg_url: URL) -> None:
    """A ``DO`` block may ``LOCK TABLE`` in any mode inside a read-only transaction: with no
    time limit, a query that locked the messages and slept stopped every gateway's writes for
    as long as it liked. It is stopped at its timeout, and the writes go on."""
    with SessionDB(url_string(pg_url)) as db:
        db.create_session("s", "cli")
    analyst = analyst_url(pg_url)
    for sql in (
        "SELECT pg_sleep(1000)",
        "DO $$ BEGIN LOCK TABLE messages IN ACCESS EXCLUSIVE MODE; PERFORM pg_sleep(1000); END $$",
    ):
        raised = _stopped(lambda sql=sql: read_only_query(analyst, sql, timeout=0.5))
        assert isinstance(raised, InvalidInputError), raised
        assert "ran past its timeout of 0.5 s" in str(raised)
    with SessionDB(url_string(pg_url)) as db:
        db.append_message("s", "user", "the lock was let go")
        assert db.message_count("s") == 1


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), True, "3", 10**9])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(
    sqlite_target: str, timeout: Any
) -> None:
    with pytest.raises(InvalidInputError, match="timeout must be a number of seconds"):
        read_only_query(sqlite_target, "SELECT 1", timeout=timeout)


@pytest.mark.parametrize(
    "sql", ["SELECT $1", "EXECUTE nosuch", "DISCARD ALL", "VACUUM", "SELECT 1/0"]
)
def test_what_postgresql_refuses_of_a_query_is_the_querys_fault(pg_url: URL, sql: str) -> None:
    """``SELECT $1`` (a protocol violation) was called a lost connection, and statements a
    transaction cannot run a database error (exit 3: "the database could not be used")."""
    with pytest.raises(InvalidInputError, match="the database refused the query"):
        read_only_query(analyst_url(pg_url), sql)


@pytest.mark.parametrize(
    "sql", ["SELECT fts3_tokenizer('simple')", "SELECT FTS3_TOKENIZER('simple', x'41')"]
)
def test_fts3_tokenizer_is_refused_on_sqlite(sqlite_target: str, sql: str) -> None:
    """It returned a tokenizer's address in memory, and with two arguments replaced it."""
    with pytest.raises(InvalidInputError, match="fts3_tokenizer is refused"):
        read_only_query(sqlite_target, sql)
