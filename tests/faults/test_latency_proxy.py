"""The latency proxy (a test utility for round trips over a network) forwards and counts."""

from __future__ import annotations

import time

import psycopg
from sqlalchemy.engine import URL

from tests.support.latency_proxy import LatencyProxy


def _conninfo(url: URL, port: int) -> str:
    return f"host=127.0.0.1 port={port} dbname={url.database} user={url.username or 'postgres'}"


def test_the_proxy_forwards_delays_and_counts_round_trips(pg_url: URL) -> None:
    target = (pg_url.host or "127.0.0.1", pg_url.port or 5432)
    with (
        LatencyProxy(target, delay=0.005) as proxy,
        psycopg.connect(_conninfo(pg_url, proxy.port), autocommit=True) as conn,
    ):
        proxy.reset()
        started = time.perf_counter()
        assert conn.execute("SELECT 41 + 1").fetchone() == (42,)
        elapsed = time.perf_counter() - started
        assert proxy.reset() == 1  # one statement in autocommit: one round trip
        with conn.transaction():
            conn.execute("SELECT 1")
            conn.execute("SELECT 2")
        assert proxy.reset() == 4  # BEGIN, two statements, COMMIT
        big = conn.execute("SELECT repeat('x', 1000000)").fetchone()
        assert big is not None and len(big[0]) == 1_000_000
        assert proxy.reset() == 1
    assert elapsed >= 0.010  # 5 ms each way is the least a round trip can cost through it
