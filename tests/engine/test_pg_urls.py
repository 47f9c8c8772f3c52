"""Connection strings an operator writes: libpq's multi-host forms work, a libpq keyword string
is refused (never a SQLite file of that name), and no host can block opening for good."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import event
from sqlalchemy.engine import URL

from hermes_store import (
    AsyncSessionDB,
    DatabaseUnavailableError,
    InvalidInputError,
    RetryPolicy,
    SessionDB,
)
from hermes_store.cli import cli
from hermes_store.engine.factory import (
    CONNECT_TIMEOUT_S,
    TCP_KEEPALIVE_DEFAULTS,
    autocommit_engine,
    create_engine,
    to_url,
)
from tests.support.backends import url_string


@pytest.mark.parametrize(
    ("given", "hosts"),
    [
        ("postgresql://u@h1:5432,h2:5433/db", ["h1:5432", "h2:5433"]),
        ("postgresql://u@/db?host=h1,h2&port=5432,5433", ["h1:5432", "h2:5433"]),
        ("postgresql://u@/db?host=h1,h2&port=6432", ["h1:6432", "h2:6432"]),
        ("postgresql://u@/db?host=h1,h2", ["h1", "h2"]),
        ("postgresql://u@/db?host=h1:1&host=h2:2", ["h1:1", "h2:2"]),
    ],
)
def test_libpq_multi_host_forms_become_one_url(given: str, hosts: list[str]) -> None:
    url = to_url(given + ("&" if "?" in given else "?") + "target_session_attrs=read-write")
    found = url.query["host"]
    assert (list(found) if isinstance(found, tuple) else [found]) == hosts
    assert url.query["target_session_attrs"] == "read-write" and url.database == "db"


@pytest.mark.parametrize(
    "given",
    ["host=db1,db2 port=5432 dbname=hermes", "dbname=hermes user=u", "  host = h sslmode=require"],
)
def test_a_libpq_keyword_string_is_refused(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInputError, match="libpq keyword string"):
        SessionDB(given)
    done = CliRunner().invoke(cli, ["--db", given, "stats"])
    assert done.exit_code == 2 and "postgresql://" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no SQLite file named after it


def test_mismatched_hosts_and_ports_are_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="3 hosts but 2 ports"):
        to_url("postgresql://u@/db?host=a,b,c&port=1,2")


@pytest.fixture
def silent_host() -> Iterator[int]:
    """A TCP port that accepts connections (the kernel's backlog) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("query", "expected"), [("", CONNECT_TIMEOUT_S), ("?connect_timeout=3", "3")]
)
def test_every_connection_has_a_connect_timeout(pg_url: URL, query: str, expected: object) -> None:
    """Without one, a host that accepts and never answers blocks opening for good."""
    seen: list[dict[str, object]] = []
    target = url_string(pg_url).split("?")[0] + query
    engine = create_engine(target)
    event.listen(engine, "do_connect", lambda _d, _r, _a, params: seen.append(dict(params)))
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()
    assert str(seen[0]["connect_timeout"]) == str(expected)


def _tcp_settings(dbapi_connection: Any) -> dict[str, object]:
    """The keepalive settings libpq applied to a connection: its parameters and, on Linux,
    its socket's own options (what the kernel will do)."""
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    found: dict[str, object] = {
        key: value
        for key, value in driver.info.get_parameters().items()
        if key.startswith("keepalives") or key == "tcp_user_timeout"
    }
    if sys.platform == "linux":
        with socket.socket(fileno=os.dup(driver.pgconn.socket)) as sock:
            found["SO_KEEPALIVE"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
            found["TCP_KEEPIDLE"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            found["TCP_USER_TIMEOUT"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
    return found


def _expected_tcp(**given: int) -> dict[str, object]:
    settings = {**TCP_KEEPALIVE_DEFAULTS, **given}
    expected: dict[str, object] = {key: str(value) for key, value in settings.items()}
    if sys.platform == "linux":
        expected["SO_KEEPALIVE"] = 1
        expected["TCP_KEEPIDLE"] = settings["keepalives_idle"]
        expected["TCP_USER_TIMEOUT"] = settings["tcp_user_timeout"]
    return expected


def test_every_connection_has_tcp_keepalives_and_a_url_or_connect_args_win(pg_url: URL) -> None:
    """A host that vanishes without a word is noticed: the store's engine, its autocommit twin
    (one-statement calls) and the asyncio store's engine all connect with the keepalive
    defaults; a value in the URL or in connect_args is kept."""
    plain = url_string(pg_url).split("?")[0]
    engine = create_engine(plain)
    try:
        with engine.connect() as conn:
            assert _tcp_settings(conn.connection.dbapi_connection) == _expected_tcp()
        with autocommit_engine(engine).connect() as conn:
            assert _tcp_settings(conn.connection.dbapi_connection) == _expected_tcp()
    finally:
        engine.dispose()
    own = create_engine(
        f"{plain}?keepalives_idle=7&tcp_user_timeout=9000",
        connect_args={"keepalives_count": 9},
    )
    try:
        with own.connect() as conn:
            assert _tcp_settings(conn.connection.dbapi_connection) == _expected_tcp(
                keepalives_idle=7, tcp_user_timeout=9000, keepalives_count=9
            )
    finally:
        own.dispose()

    def settings_of(db: SessionDB) -> dict[str, object]:
        with db.uow.connect(write=False) as conn:
            return _tcp_settings(conn.connection.dbapi_connection)

    async def main() -> dict[str, object]:
        async with AsyncSessionDB(plain) as adb:
            return await adb.run_sync(settings_of)

    assert asyncio.run(main()) == _expected_tcp()


def test_a_host_that_never_answers_is_passed_over(silent_host: int, pg_url: URL) -> None:
    port = pg_url.port or 5432
    target = (
        f"postgresql://{pg_url.username}@/{pg_url.database}"
        f"?host=127.0.0.1,{pg_url.host}&port={silent_host},{port}&connect_timeout=2"
    )
    started = time.monotonic()
    with SessionDB(target, migrate="check") as db:
        db.create_session("multi-host", "cli")
        assert db.get_session("multi-host") is not None
    assert time.monotonic() - started < 120  # it moved on instead of waiting for good


@pytest.mark.parametrize(
    "given",
    [
        "postgresql://u@h:99999/db",
        "postgresql://u@h:0/db",
        "postgresql://u@/db?host=h1:5432,h2:70000",
        "postgresql://u@/db?host=h&port=65536",
    ],
)
def test_a_port_out_of_range_is_refused_when_the_url_is_read(given: str) -> None:
    """SQLAlchemy keeps any integer as the port; 1..65535 are checked as the URL is read."""
    with pytest.raises(InvalidInputError, match=r"port \d+ is out of range \(1-65535\)"):
        to_url(given)


def test_a_port_no_server_can_have_fails_at_once(pg_url: URL) -> None:
    """``invalid port number`` was retried as an unreachable server for the whole 30 s of
    the open's patience, then exit 3: a settings mistake now fails at once, naming the port
    (the CLI: one line, exit 2)."""
    wrong = pg_url.set(port=99999)
    started = time.monotonic()
    with pytest.raises(InvalidInputError, match="port 99999 is out of range"):
        SessionDB(wrong)
    done = CliRunner().invoke(cli, ["--db", url_string(wrong), "stats"])
    assert done.exit_code == 2, done.output
    assert "port 99999 is out of range (1-65535)" in done.stderr
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("part", "refused", "hint"),
    [
        ("username", 'role "hermes_no_such_role"', "`createuser NAME`"),
        ("database", 'database "hermes_no_such_db"', "`createdb NAME`"),
    ],
)
def test_a_missing_role_or_database_gets_the_command_that_creates_it(
    pg_url: URL, part: str, refused: str, hint: str
) -> None:
    """The hint fits what is missing: ``createdb`` creates no role."""
    name = refused.split('"')[1]
    wrong = pg_url.set(username=name) if part == "username" else pg_url.set(database=name)
    with pytest.raises(DatabaseUnavailableError, match=f"{refused} does not exist") as raised:
        SessionDB(url_string(wrong))
    assert str(raised.value).endswith(f"(create it first, e.g. {hint})")
    done = CliRunner().invoke(cli, ["--db", url_string(wrong), "stats"])
    assert done.exit_code == 3, done.output
    assert refused in done.stderr and hint in done.stderr
    other = {"`createuser NAME`", "`createdb NAME`"} - {hint}
    assert other.pop() not in done.stderr


@pytest.mark.parametrize("given", ["postgresql://postgres@127.0.0.1/", "postgresql://u@h:5432"])
def test_a_server_url_naming_no_database_is_refused(
    given: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no database named, libpq picked the role's namesake or ``postgres``, the server's
    maintenance database: an import created the store's tables there and said it succeeded.
    Named by ``?dbname=``, ``?service=`` or libpq's environment, it is a choice."""
    monkeypatch.delenv("PGDATABASE", raising=False)
    monkeypatch.delenv("PGSERVICE", raising=False)
    with pytest.raises(InvalidInputError, match="names no database"):
        SessionDB(given)
    result = CliRunner().invoke(cli, ["--db", given, "db", "upgrade"])
    assert result.exit_code == 2 and "names no database" in result.output, result.output
    assert to_url(f"{given.rstrip('/')}/?dbname=hermes").query["dbname"] == "hermes"
    monkeypatch.setenv("PGDATABASE", "hermes")
    assert to_url(given).database in (None, "")


def test_an_unencoded_at_sign_in_a_password_is_refused_without_showing_it() -> None:
    """``postgres:S3cret@PW@host``: the password's tail became the host, and "failed to
    resolve host 'PW@127.0.0.1'" showed it."""
    with pytest.raises(InvalidInputError, match="%40") as raised:
        to_url("postgresql://postgres:S3cret@PW@127.0.0.1/db")
    assert "PW" not in str(raised.value) and "S3cret" not in str(raised.value)


@pytest.mark.parametrize(
    "setting", ["sslmode=bogus", "target_session_attrs=xyz", "service=hermes_no_such_service"]
)
def test_a_url_setting_the_driver_refuses_fails_at_once_as_a_config_error(
    pg_url: URL, setting: str
) -> None:
    """libpq refuses these before it connects, with no SQLSTATE, as for an unreachable
    server: they were retried for the whole unavailable timeout, then called an outage."""
    import hermes_store

    target = f"{url_string(pg_url)}{'&' if pg_url.query else '?'}{setting}"
    with pytest.raises(hermes_store.StoreConfigError, match="a setting the driver refuses"):
        SessionDB(target, retry=RetryPolicy(unavailable_timeout=600))


def test_hermes_store_url_of_blanks_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--db "   "`` was refused while ``HERMES_STORE_URL="   "`` created a file named by
    three blanks and imported into it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HERMES_STORE_URL", "   ")
    result = CliRunner().invoke(cli, ["db", "upgrade"])
    assert result.exit_code == 2 and "HERMES_STORE_URL holds only blanks" in result.output
    assert list(tmp_path.iterdir()) == []
