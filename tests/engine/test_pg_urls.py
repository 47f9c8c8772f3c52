"""Connection strings an operator writes: libpq's multi-host forms work, a libpq keyword string
is refused (never a SQLite file of that name), and no host can block opening for good."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import event
from sqlalchemy.engine import URL

from hermes_store import InvalidInputError, SessionDB
from hermes_store.cli import cli
from hermes_store.engine.factory import CONNECT_TIMEOUT_S, create_engine, to_url
from tests.conftest import url_string


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
