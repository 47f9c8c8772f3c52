"""AsyncSessionDB: event-loop lag under load and PostgreSQL append throughput
(``python -m bench.async_lag``; a few minutes; PostgreSQL from ``HERMES_STORE_BENCH_PG_URL``,
default ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``, in a scratch database).

Lag: 50 concurrent tasks append, update tokens, search and list on a 20k-message database
while a 1 ms ticker on the same loop records how late each tick wakes; contenders are
``AsyncSessionDB`` and the sync ``SessionDB`` called on the loop. Throughput: 200 tasks doing
``append_message`` through ``AsyncSessionDB`` on PostgreSQL against the sync store driven by
32 threads. Contenders alternate round by round (the order rotates); each figure is the
median over rounds with [min..max].
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from bench.timing import percentile, spread
from hermes_store import AsyncSessionDB, SessionDB

ROUNDS = 5
TASKS = 50
OPS_PER_TASK = 12
SESSIONS = 200
MESSAGES_PER_SESSION = 100  # 20k messages
APPEND_TASKS = 200
APPEND_THREADS = 32
APPENDS = 4000
WORDS = [
    "deploy", "kubernetes", "cluster", "database", "migration", "index", "query", "latency",
    "python", "asyncio", "gateway", "telegram", "discord", "slack", "memory", "token", "budget",
]  # fmt: skip
IDLE_SECONDS = 3.0
PG_ENV = "HERMES_STORE_BENCH_PG_URL"
SCRATCH = "aio_bench"


def _text(rng: random.Random, n: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _build(target: str) -> None:
    rng = random.Random(1)
    with SessionDB(target) as db:
        for s in range(SESSIONS):
            db.create_session(f"s{s}", "telegram" if s % 2 else "cli")
            db.append_messages(
                f"s{s}",
                [{"role": "user", "content": _text(rng)} for _ in range(MESSAGES_PER_SESSION)],
            )
        if db.engine.dialect.name == "postgresql":
            # Statistics, as autovacuum would have gathered on a live database: without them
            # the planner takes a word in half the messages for a rare one (a 6 ms search).
            with db.uow.connect() as conn:
                conn.exec_driver_sql("ANALYZE")


class _Ticker:
    def __init__(self) -> None:
        self.lags: list[float] = []
        self.running = True

    async def run(self) -> None:
        while self.running:
            due = time.perf_counter() + 0.001
            await asyncio.sleep(0.001)
            self.lags.append(max(0.0, time.perf_counter() - due))


async def _op(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    result = call(*args, **kwargs)
    if isinstance(result, Awaitable):
        return await result
    return result


async def _worker(db: Any, n: int) -> None:
    rng = random.Random(n)
    sid = f"s{n % SESSIONS}"
    for i in range(OPS_PER_TASK):
        kind = i % 4
        if kind == 0:
            await _op(db.append_message, sid, "assistant", _text(rng))
        elif kind == 1:
            await _op(db.update_token_counts, sid, input_tokens=3, output_tokens=5)
        elif kind == 2:
            await _op(db.search_messages, rng.choice(WORDS), limit=20)
        else:
            await _op(db.list_sessions_rich, limit=20)
        await asyncio.sleep(0)


class _FullCollections:
    """Full (generation 2) garbage collections while it is entered, and how long each took:
    one pauses every thread of the process, the loop included, for as long as the heap is
    big, whatever the store does; shown beside the lag so a worst tick can be told apart."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._began = 0.0

    def _watch(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._began)

    def __enter__(self) -> _FullCollections:
        gc.callbacks.append(self._watch)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._watch)


async def _lag_round(target: str, api: str) -> tuple[float, float, list[float]]:
    with _FullCollections() as collections:
        p99, worst = await _lagged(target, api)
    return p99, worst, collections.pauses


async def _lagged(target: str, api: str) -> tuple[float, float]:
    ticker = _Ticker()
    if api == "idle":  # the machine's own contribution: the ticker alone, as long
        ticking = asyncio.create_task(ticker.run())
        await asyncio.sleep(IDLE_SECONDS)
        ticker.running = False
        await ticking
        return percentile(ticker.lags, 0.99), max(ticker.lags)
    if api == "async":
        db: Any = AsyncSessionDB(target)
        await db.message_count()  # opened before the clock runs
    else:
        db = SessionDB(target)
    ticking = asyncio.create_task(ticker.run())
    await asyncio.sleep(0.01)
    await asyncio.gather(*(_worker(db, n) for n in range(TASKS)))
    ticker.running = False
    await ticking
    if api == "async":
        await db.close()
    else:
        db.close()
    return percentile(ticker.lags, 0.99), max(ticker.lags)


async def _append_async(target: str) -> float:
    async with AsyncSessionDB(target) as db:
        await db.message_count()
        per_task = APPENDS // APPEND_TASKS

        async def task(n: int) -> None:
            for i in range(per_task):
                await db.append_message(f"s{n % SESSIONS}", "user", f"async {n} {i}")

        start = time.perf_counter()
        await asyncio.gather(*(task(n) for n in range(APPEND_TASKS)))
        return APPENDS / (time.perf_counter() - start)


def _append_threads(target: str) -> float:
    with SessionDB(target) as db:
        db.message_count()
        jobs = [(f"s{k % SESSIONS}", f"sync {k}") for k in range(APPENDS)]
        with ThreadPoolExecutor(APPEND_THREADS) as pool:
            start = time.perf_counter()
            list(pool.map(lambda job: db.append_message(job[0], "user", job[1]), jobs))
            return APPENDS / (time.perf_counter() - start)


def _spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    return spread(values, f"{{:.{digits}f}}", scale=scale)


def _scratch_pg() -> tuple[str, Callable[[], None]] | None:
    base = sa.make_url(
        os.environ.get(PG_ENV, "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    )
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{SCRATCH}" WITH (FORCE)')
            conn.exec_driver_sql(f'CREATE DATABASE "{SCRATCH}"')
    except sa.exc.OperationalError as error:
        print(f"PostgreSQL unavailable ({error.orig}); SQLite only", file=sys.stderr)
        return None

    def drop() -> None:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{SCRATCH}" WITH (FORCE)')
        admin.dispose()

    return base.set(database=SCRATCH).render_as_string(hide_password=False), drop


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        targets = {"sqlite": str(Path(folder) / "state.db")}
        pg = _scratch_pg()
        if pg is not None:
            targets["postgresql"] = pg[0]
        try:
            for target in targets.values():
                _build(target)
            messages = SESSIONS * MESSAGES_PER_SESSION
            print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
            print()
            print(f"## Event-loop lag: {TASKS} tasks x {OPS_PER_TASK} calls, {messages:,} messages")
            print(f"(1 ms ticker, {ROUNDS} rounds)")
            print()
            print(
                "| backend | API | tick lag p99 (ms) | tick lag max (ms) "
                "| full GC pauses, longest (ms) |"
            )
            print("|---|---|---|---|---|")
            for backend, target in targets.items():
                lags: dict[str, list[tuple[float, float, list[float]]]] = {
                    "async": [],
                    "sync": [],
                    "idle": [],
                }
                names = list(lags)
                for r in range(ROUNDS):
                    for api in names[r % 3 :] + names[: r % 3]:
                        lags[api].append(asyncio.run(_lag_round(target, api)))
                for api, found in lags.items():
                    label = {
                        "async": "AsyncSessionDB",
                        "sync": "SessionDB on the loop",
                        "idle": "no store (the ticker alone: the machine's share)",
                    }[api]
                    p99 = _spread([p for p, _, _ in found], 1000)
                    worst = _spread([m for _, m, _ in found], 1000)
                    pauses = [pause for _, _, seen in found for pause in seen]
                    gcs = f"{len(pauses)}, {max(pauses) * 1000:.0f}" if pauses else "0"
                    print(f"| {backend} | {label} | {p99} | {worst} | {gcs} |")
            if pg is not None:
                print()
                print(f"## append_message on PostgreSQL ({APPENDS} appends, {ROUNDS} rounds)")
                print()
                rates: dict[str, list[float]] = {"async": [], "threads": []}
                for r in range(ROUNDS):
                    order = ["async", "threads"] if r % 2 == 0 else ["threads", "async"]
                    for name in order:
                        if name == "async":
                            rates[name].append(asyncio.run(_append_async(pg[0])))
                        else:
                            rates[name].append(_append_threads(pg[0]))
                print("| contender | appends/s |")
                print("|---|---|")
                async_rate = _spread(rates["async"], digits=0)
                thread_rate = _spread(rates["threads"], digits=0)
                print(f"| AsyncSessionDB, {APPEND_TASKS} tasks | {async_rate} |")
                print(f"| SessionDB, {APPEND_THREADS} threads | {thread_rate} |")
            print()
            print(f"load average after: {os.getloadavg()[0]:.1f}")
        finally:
            if pg is not None:
                pg[1]()


if __name__ == "__main__":
    main()
