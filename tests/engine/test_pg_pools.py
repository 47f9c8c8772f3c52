"""PostgreSQL connections as the store opens them: custom plans while statements are prepared
(a generic plan made a rare-word search 3-5x slower after its fifth run), none of that behind
PgBouncer, options given in the URL kept, and an autocommit pool that a burst of calls does
not churn (an overflow connection closed on return, reopened by the next waiter)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine

from hermes_store import AsyncSessionDB, SessionDB
from hermes_store.engine.factory import AUTOCOMMIT_POOL_SIZE, autocommit_engine
from tests.support.backends import url_string

RARE = "quetzalcoatlus"


@pytest.fixture
def store(pg_url: URL) -> Iterator[SessionDB]:
    db = SessionDB(url_string(pg_url))
    try:
        db.create_session("s", "cli")
        db.append_messages(
            "s", [{"role": "user", "content": f"common words {i}"} for i in range(300)]
        )
        db.append_message("s", "user", f"one {RARE} here")
        yield db
    finally:
        db.close()


def _setting(conn: Connection, name: str) -> str:
    return str(conn.exec_driver_sql(f"SHOW {name}").scalar_one())


def test_every_pool_asks_for_custom_plans(store: SessionDB) -> None:
    assert store.uow.read(lambda conn: _setting(conn, "plan_cache_mode")) == "force_custom_plan"
    with store.uow.connect() as conn:  # the transactional pool
        assert _setting(conn, "plan_cache_mode") == "force_custom_plan"


def test_a_search_run_many_times_is_never_planned_generically(store: SessionDB) -> None:
    for _ in range(12):  # psycopg prepares it at its 5th run; the server would go generic next
        assert [hit["id"] for hit in store.search_messages(RARE)]

    def plans(conn: Connection) -> list[tuple[int, int]]:
        rows = conn.exec_driver_sql(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE '%%to_tsquery%%'"
        )
        return [(int(generic), int(custom)) for generic, custom in rows]

    seen = store.uow.read(plans)  # one caller at a time: the pool hands back the same connection
    assert seen, "the search statement was not prepared"
    assert all(generic == 0 for generic, _ in seen)
    assert max(custom for _, custom in seen) >= 5


def test_no_custom_plan_option_without_prepared_statements(pg_url: URL) -> None:
    url = url_string(pg_url.update_query_dict({"prepare_threshold": "none"}))
    with SessionDB(url) as db:
        assert db.uow.read(lambda conn: _setting(conn, "plan_cache_mode")) == "auto"


def test_options_given_in_the_url_are_kept(pg_url: URL) -> None:
    url = url_string(pg_url.update_query_dict({"options": "-c statement_timeout=4321"}))
    with SessionDB(url) as db:
        settings = db.uow.read(
            lambda conn: (_setting(conn, "statement_timeout"), _setting(conn, "plan_cache_mode"))
        )
    assert settings == ("4321ms", "force_custom_plan")


def _count_connects(engine: Engine) -> list[int]:
    opened = [0]
    lock = threading.Lock()

    def on_connect(*_: object) -> None:
        with lock:
            opened[0] += 1

    event.listen(engine, "connect", on_connect)
    return opened


def test_a_burst_of_threads_reuses_the_autocommit_pool(store: SessionDB) -> None:
    opened = _count_connects(autocommit_engine(store.engine))
    start = threading.Barrier(32)

    def work() -> None:
        start.wait()
        for i in range(20):
            store.append_message("s", "assistant", f"burst {i}")

    threads = [threading.Thread(target=work) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.message_count("s") == 301 + 32 * 20
    assert opened[0] <= AUTOCOMMIT_POOL_SIZE  # never closed and reopened under the burst


def test_a_burst_of_tasks_reuses_the_autocommit_pool(pg_url: URL, store: SessionDB) -> None:
    async def main() -> int:
        async with AsyncSessionDB(url_string(pg_url)) as db:
            await db.message_count("s")
            opened = _count_connects(autocommit_engine(db.sync.engine))

            async def task(n: int) -> None:
                for i in range(10):
                    await db.append_message("s", "assistant", f"task {n} {i}")

            await asyncio.gather(*(task(n) for n in range(100)))
            assert await db.message_count("s") == 301 + 100 * 10
            return opened[0]

    assert asyncio.run(main()) <= AUTOCOMMIT_POOL_SIZE
