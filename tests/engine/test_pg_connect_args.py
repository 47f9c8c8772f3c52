"""An Engine passed in keeps where it connects: a URL naming no host (or another database)
with the real target in ``connect_args`` sends every call, one-statement writes and small
reads on the autocommit twin included, to that target and never to the URL's default one."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import NullPool

from hermes_store import AsyncSessionDB, SessionDB, create_engine
from hermes_store.schema import migrate

THREADS = 4


@pytest.fixture
def two_databases(pg_worker_url: URL | None) -> Iterator[tuple[URL, str, str]]:
    """(server URL, decoy, target): two scratch databases on the test server, the decoy at
    head (a URL without connect_args reaches it), the target empty: the store opening it
    through connect_args migrates it."""
    if pg_worker_url is None:
        pytest.skip("PostgreSQL tests need HERMES_STORE_TEST_PG_URL")
    tag = uuid.uuid4().hex[:10]
    decoy, target = f"hermes_decoy_{tag}", f"hermes_target_{tag}"
    admin = sa.create_engine(pg_worker_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        for name in (decoy, target):
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        migrate.upgrade(pg_worker_url.set(database=decoy))
        yield pg_worker_url, decoy, target
    finally:
        with admin.connect() as conn:
            for name in (decoy, target):
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def _rows(server: URL, database: str) -> dict[str, int]:
    engine = sa.create_engine(server.set(database=database), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return {
                table: int(conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one())
                for table in ("sessions", "messages")
            }
    finally:
        engine.dispose()


def _connect_args(server: URL, target: str) -> dict[str, Any]:
    # The URL names the decoy and no host: only these arguments lead to the target.
    return {"host": server.host, "port": server.port, "user": server.username, "dbname": target}


def _exercise(db: SessionDB) -> None:
    """Every kind of call: plain and grouped one-statement writes, small reads, a search,
    a listing and a transaction."""
    db.create_session("s1", "cli", model="m")
    db.append_message("s1", "user", "hello quetzalcoatlus")
    db.update_token_counts("s1", input_tokens=3, output_tokens=4)
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            barrier.wait()
            for i in range(10):
                db.append_message("s1", "assistant", f"reply {n}-{i}")
                db.update_token_counts("s1", input_tokens=1)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    with db.transaction():
        db.create_session("s2", "cli")
        db.append_message("s2", "user", "inside a transaction")
    session = db.get_session("s1")
    assert session is not None and session["input_tokens"] == 3 + THREADS * 10
    assert len(db.get_messages("s1")) == 1 + THREADS * 10
    assert [hit["session_id"] for hit in db.search_messages("quetzalcoatlus")] == ["s1"]
    assert {row["id"] for row in db.list_sessions_rich()} == {"s1", "s2"}


EXPECTED = {"sessions": 2, "messages": 2 + THREADS * 10}

Builder = Callable[[str, dict[str, Any]], Engine]


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda url, args: sa.create_engine(url, connect_args=args), id="sqlalchemy"),
        pytest.param(
            lambda url, args: create_engine(url, pool_size=2, max_overflow=2, connect_args=args),
            id="hermes_store",
        ),
    ],
)
def test_every_call_of_a_sync_engine_lands_where_its_connect_args_point(
    two_databases: tuple[URL, str, str], build: Builder
) -> None:
    server, decoy, target = two_databases
    engine = build(f"postgresql+psycopg:///{decoy}", _connect_args(server, target))
    try:
        db = SessionDB(engine)
        try:
            _exercise(db)
        finally:
            db.close()
    finally:
        engine.dispose()
    assert _rows(server, decoy) == {"sessions": 0, "messages": 0}
    assert _rows(server, target) == EXPECTED


def test_every_call_of_an_async_engine_lands_where_its_connect_args_point(
    two_databases: tuple[URL, str, str],
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    server, decoy, target = two_databases

    async def main() -> None:
        engine = create_async_engine(
            f"postgresql+psycopg_async:///{decoy}", connect_args=_connect_args(server, target)
        )
        try:
            async with AsyncSessionDB(engine) as db:
                await db.create_session("s1", "cli", model="m")
                await db.append_message("s1", "user", "hello quetzalcoatlus")
                await db.update_token_counts("s1", input_tokens=3, output_tokens=4)
                await asyncio.gather(
                    *(db.append_message("s1", "assistant", f"reply {i}") for i in range(40))
                )
                async with db.transaction():
                    await db.create_session("s2", "cli")
                    await db.append_message("s2", "user", "inside a transaction")
                session = await db.get_session("s1")
                assert session is not None and session["input_tokens"] == 3
                assert len(await db.get_messages("s1")) == 41
                hits = await db.search_messages("quetzalcoatlus")
                assert [hit["session_id"] for hit in hits] == ["s1"]
                assert {row["id"] for row in await db.list_sessions_rich()} == {"s1", "s2"}
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert _rows(server, decoy) == {"sessions": 0, "messages": 0}
    assert _rows(server, target) == {"sessions": 2, "messages": 42}


def test_stores_on_one_url_reaching_two_databases_never_share_a_write_group(
    two_databases: tuple[URL, str, str],
) -> None:
    """Group commit sends the writes of every store of a process on the leader's connection:
    only stores that reach one database may share a group, whatever their URLs say."""
    server, decoy, target = two_databases
    url = f"postgresql+psycopg:///{decoy}"
    stores = {
        name: SessionDB(create_engine(url, connect_args=_connect_args(server, name)))
        for name in (decoy, target)
    }
    barrier = threading.Barrier(2 * THREADS)
    errors: list[BaseException] = []

    def writer(db: SessionDB) -> None:
        try:
            barrier.wait()
            for i in range(25):
                db.append_message("s", "user", f"m{i}")
        except BaseException as error:  # reported below
            errors.append(error)

    try:
        for db in stores.values():
            db.create_session("s", "cli")
        threads = [
            threading.Thread(target=writer, args=(db,))
            for db in stores.values()
            for _ in range(THREADS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for db in stores.values():
            db.close()
            db.engine.dispose()
    assert not errors, errors
    for name in (decoy, target):
        assert _rows(server, name) == {"sessions": 1, "messages": THREADS * 25}
