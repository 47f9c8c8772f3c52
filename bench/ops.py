"""Operations under load: writers' latency while a backup, an optimize or a prune runs.

Builds a database of about ``--size-mb`` megabytes (1 GB for the acceptance run: ``--size-mb
1024``; takes a while), then for each operation starts ``--writers`` processes appending
messages, runs the operation, and reports the operation's time and the writers' p50/p99/max
latency, against a baseline phase with no operation. Nothing is written to the repository::

    python -m bench.ops --size-mb 200 --writers 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from bench.timing import percentile
from hermes_store import SessionDB, backup, maintenance, retention

WORDS = [
    *("server", "deploy", "migration", "rollback", "index", "token", "session", "gateway"),
    *("latency", "cache", "query", "schema", "vacuum", "backup", "restore", "message"),
    *("agent", "tool", "result", "python", "sqlite"),
]


def build(path: Path, size_mb: int) -> int:
    """Sessions of ~20 messages of ~1 KB until the file (and its index) reach the size."""
    SessionDB(path).close()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA journal_mode=WAL")
    rng = random.Random(7)
    now = time.time()
    number = 0
    while path.stat().st_size < size_mb * 1024 * 1024:
        raw.execute("BEGIN")
        for _ in range(500):
            sid = f"bench-{number:07d}"
            started = now - rng.uniform(0, 365) * 86400
            raw.execute(
                "INSERT INTO sessions (id, source, started_at, ended_at, message_count) "
                "VALUES (?, 'cli', ?, ?, 20)",
                (sid, started, started + 600),
            )
            raw.executemany(
                "INSERT INTO messages (session_id, role, content, timestamp) VALUES (?, ?, ?, ?)",
                [
                    (sid, "user" if i % 2 else "assistant",
                     " ".join(rng.choices(WORDS, k=150)), started + i)
                    for i in range(20)
                ],
            )  # fmt: skip
            number += 1
        raw.execute("COMMIT")
        raw.execute("PRAGMA wal_checkpoint(PASSIVE)")
    raw.close()
    return number


def writer(path: str, number: int, stop: Event, out: Any) -> None:
    store = SessionDB(path)
    session = f"writer-{number}"
    store.create_session(session, "gateway")
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        store.append_message(session, "user", "a message written during the operation")
        latencies.append(time.perf_counter() - started)
    store.close()
    out.put(latencies)


def phase(
    path: Path, writers: int, operation: Callable[[], object], idle: float
) -> tuple[float, list[float], object]:
    """Run ``operation`` (or sleep ``idle`` s when it is None-like) while writers write."""
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    processes = [ctx.Process(target=writer, args=(str(path), n, stop, out)) for n in range(writers)]
    for process in processes:
        process.start()
    time.sleep(0.5)  # benchmark warm-up, not synchronisation
    started = time.perf_counter()
    result = operation()
    seconds = time.perf_counter() - started
    if seconds < idle:
        time.sleep(idle - seconds)
    stop.set()
    latencies = [x for _ in processes for x in out.get(timeout=120)]
    for process in processes:
        process.join(60)
    return seconds, latencies, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--keep", type=Path, help="Build (or reuse) the database here.")
    parser.add_argument(
        "--ops", default="backup,optimize,prune", help="Which operations to time (comma list)."
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hermes-ops-bench-"))
    path = args.keep or folder / "state.db"
    if not path.exists():
        started = time.perf_counter()
        sessions = build(path, args.size_mb)
        print(f"built {sessions} sessions, {path.stat().st_size / 2**20:.0f} MiB "
              f"in {time.perf_counter() - started:.0f} s")  # fmt: skip
    store = SessionDB(path)

    def report(name: str, seconds: float, latencies: list[float], extra: str = "") -> None:
        ms = [x * 1000 for x in latencies]
        print(
            f"| {name} | {seconds:.2f} s | {len(ms)} | {percentile(ms, 0.5):.1f} ms | "
            f"{percentile(ms, 0.99):.1f} ms | {max(ms):.1f} ms | {extra} |"
        )

    print("| operation | time | writes | p50 | p99 | max | notes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    seconds, lat, _ = phase(path, args.writers, lambda: None, 5.0)
    report("none (baseline, 5 s)", 5.0, lat)
    wanted = set(args.ops.split(","))
    for method in ("backup", "vacuum") if "backup" in wanted else ():
        target = folder / f"copy-{method}.db"
        seconds, lat, result = phase(
            path, args.writers, lambda m=method, t=target: backup.backup(store, t, method=m), 0
        )
        size = target.stat().st_size / 2**20
        report(f"backup --method {method}", seconds, lat, f"{size:.0f} MiB copy")
        target.unlink()
    if "optimize" in wanted:
        seconds, lat, result = phase(path, args.writers, lambda: maintenance.optimize(store), 0)
        assert isinstance(result, maintenance.Report)
        longest = result.longest_step_s * 1000
        steps = f"{result.merge_steps} merge steps, longest lock {longest:.1f} ms"
        report("db optimize", seconds, lat, steps)
    if "prune" in wanted:
        policy = retention.Policy(300)
        seconds, lat, result = phase(path, args.writers, lambda: retention.run(store, policy), 0)
        assert isinstance(result, retention.Report)
        report("prune (older than 300 days)", seconds, lat,
               f"{result.sessions} sessions in {result.chunks} chunks")  # fmt: skip
    store.close()
    wal = Path(f"{path}-wal")
    print(f"WAL after the run: {wal.stat().st_size if wal.exists() else 0:,} bytes")
    if args.keep is None:
        for leftover in folder.iterdir():
            leftover.unlink()
        os.rmdir(folder)


if __name__ == "__main__":
    main()
