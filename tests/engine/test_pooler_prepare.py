"""Behind a transaction pooler no statement is prepared: PgBouncer hands one server
connection to many clients, and psycopg's prepared-statement names collide there (raw
``prepared statement "_pg3_0" does not exist`` errors, "may or may not have landed" for a
refused bind, or another client's statement run with these values)."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest
from sqlalchemy.engine import URL

from hermes_store import AsyncSessionDB, SessionDB
from tests.support.backends import PGBOUNCER_ENV, through_pgbouncer, url_string

GATEWAYS = 4
ROUNDS = 40


@pytest.fixture
def bouncer_url(pg_url: URL) -> URL:
    """The worker's database through PgBouncer, without ``prepare_threshold=none``."""
    if not os.environ.get(PGBOUNCER_ENV):
        if os.environ.get("HERMES_STORE_REQUIRE_PG") == "1":
            pytest.fail(f"{PGBOUNCER_ENV} is not set but HERMES_STORE_REQUIRE_PG=1")
        pytest.skip(f"needs {PGBOUNCER_ENV}")
    url = through_pgbouncer(pg_url)
    return url.difference_update_query(["prepare_threshold"])


def _prepares(db: SessionDB) -> set[object]:
    with db.uow.connect(write=False) as conn:
        pooled = conn.connection.driver_connection
        assert pooled is not None
        return {pooled.prepare_threshold}


def test_gateways_behind_a_transaction_pooler_work_without_the_url_flag(
    bouncer_url: URL, pg_url: URL
) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(GATEWAYS)

    def gateway(number: int) -> None:
        try:
            with SessionDB(url_string(bouncer_url)) as db:
                session_id = f"gw{number}"
                db.create_session(session_id, "telegram")
                start.wait(timeout=60)
                for turn in range(ROUNDS):
                    db.append_message(session_id, "user", f"turn {turn}")
                    assert db.get_session(session_id) is not None
                    db.get_messages(session_id)
                    db.update_token_counts(session_id, input_tokens=1)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=gateway, args=(n,)) for n in range(GATEWAYS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == []
    with SessionDB(url_string(pg_url)) as direct:
        for number in range(GATEWAYS):
            row = direct.get_session(f"gw{number}")
            assert row is not None
            assert (row["message_count"], row["input_tokens"]) == (ROUNDS, ROUNDS)
        assert _prepares(direct) == {5}  # a direct connection still prepares
    with SessionDB(url_string(bouncer_url)) as pooled:
        assert _prepares(pooled) == {None}


def test_the_async_store_behind_a_pooler_prepares_nothing(bouncer_url: URL) -> None:
    async def main() -> None:
        async with AsyncSessionDB(url_string(bouncer_url)) as adb:
            await adb.create_session("async-gw", "cli")
            for turn in range(12):
                await adb.append_message("async-gw", "user", f"turn {turn}")
                await adb.get_session("async-gw")
            row = await adb.get_session("async-gw")
            assert row is not None and row["message_count"] == 12

    asyncio.run(main())


def test_doctor_says_whether_a_pooler_answers(bouncer_url: URL, pg_url: URL) -> None:
    from click.testing import CliRunner

    from hermes_store.cli import cli

    def detail(url: URL) -> str:
        done = CliRunner().invoke(cli, ["--db", url_string(url), "doctor", "--json"])
        checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
        assert checks["prepared statements"]["status"] == "ok"
        return str(checks["prepared statements"]["detail"])

    assert "connection pooler" in detail(bouncer_url)
    assert "direct connection" in detail(pg_url)
