"""Operations under load: writers' latency while a backup (or an optimize, a prune) runs.

The acceptance run backs up a 1 GB database while 8 processes append messages, and compares
the writers' latency against a baseline phase with no backup, the contenders interleaved over
``--rounds`` rounds (the order rotates each round)::

    python -m bench.ops --rounds 3

The database is built once and cached under ``--cache`` (default
``/tmp/hermes-ops-bench-cache``, keyed by size and schema revision; writers add a few thousand
messages to it per run). Each round reports the load average when it began: the machine may be
shared, so compare contenders within a round. ``--ops optimize,prune`` times those instead (on a
throw-away copy, as a prune deletes). Nothing is written to the repository.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from bench.timing import percentile, spread
from hermes_store import SessionDB
from hermes_store.ops import backup, maintenance, retention
from hermes_store.schema import migrate

WORDS = [
    *("server", "deploy", "migration", "rollback", "index", "token", "session", "gateway"),
    *("latency", "cache", "query", "schema", "vacuum", "backup", "restore", "message"),
    *("agent", "tool", "result", "python", "sqlite"),
]
CACHE = Path("/tmp/hermes-ops-bench-cache")
#: The concurrency issue's bound on a writer's worst latency.
BOUND_MS = 250.0


def build(path: Path, size_mb: int) -> int:
    """Sessions of ~20 messages of ~1 KB until the file (and its index) reach the size."""
    SessionDB(path).close()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA journal_mode=WAL")
    raw.execute("PRAGMA synchronous=OFF")  # a bench fixture: rebuilt if the machine crashes
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
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # nobody else has it open yet
    raw.close()
    return number


def cached(cache: Path, size_mb: int) -> Path:
    """The cached database of ``size_mb`` at the current head, built on first use."""
    path = cache / f"state-{size_mb}mb-{migrate.head_revision()}.db"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    building = cache / f".building-{os.getpid()}.db"
    started = time.perf_counter()
    sessions = build(building, size_mb)
    for sidecar in (Path(f"{building}-wal"), Path(f"{building}-shm")):
        sidecar.unlink(missing_ok=True)
    building.rename(path)
    print(f"built {sessions} sessions, {path.stat().st_size / 2**20:.0f} MiB "
          f"in {time.perf_counter() - started:.0f} s: {path}")  # fmt: skip
    return path


def writer(path: str, name: str, ready: Any, stop: Event, out: Any) -> None:
    """Appends until ``stop``; says ``ready`` once warm (connection open, 20 appends done),
    then sends (monotonic start, seconds) of every append."""
    store = SessionDB(path)
    store.create_session(name, "gateway")
    samples = []
    while not stop.is_set():
        started = time.monotonic()
        store.append_message(name, "user", "a message written during the operation")
        samples.append((started, time.monotonic() - started))
        if len(samples) == 20:
            ready.put(name)
    store.close()
    out.put(samples)


@dataclass
class Phase:
    """One operation under load: its duration and the latencies of appends begun meanwhile."""

    seconds: float
    latencies: list[float]
    result: object

    @property
    def writes_per_s(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else float("nan")

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies, 0.99) * 1000

    @property
    def max_ms(self) -> float:
        return max(self.latencies, default=float("nan")) * 1000


def phase(
    path: Path, writers: int, tag: str, operation: Callable[[Path], object], idle: float
) -> Phase:
    """Run ``operation(path)`` (and keep going until ``idle`` s) while writers write."""
    ctx = mp.get_context("fork")
    ready, stop, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    processes = [
        ctx.Process(target=writer, args=(str(path), f"writer-{tag}-{n}", ready, stop, out))
        for n in range(writers)
    ]
    for process in processes:
        process.start()
    for _ in processes:
        ready.get(timeout=300)  # every writer warm before the clock starts
    began = time.monotonic()
    result = operation(path)
    if time.monotonic() - began < idle:
        time.sleep(idle - (time.monotonic() - began))
    ended = time.monotonic()
    seconds = ended - began
    stop.set()
    samples = [x for _ in processes for x in out.get(timeout=300)]
    for process in processes:
        process.join(60)
    latencies = [took for start, took in samples if began <= start < ended]
    return Phase(seconds, latencies, result)


def _backup(folder: Path, method: backup.Method, **options: Any) -> Callable[[Path], object]:
    def run(path: Path) -> object:
        with SessionDB(path) as store:
            return backup.backup(store.engine, folder / "copy.db", method=method, **options)

    return run


def _remove_copy(folder: Path) -> None:
    """Outside the measured window: unlinking a 1 GB file stalls the disk's journal too."""
    (folder / "copy.db").unlink(missing_ok=True)


def _idle(path: Path) -> object:
    return None


CONTENDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "backup API (flushed every 4 MiB)": ("backup", {}),
    "VACUUM INTO (flushed every 4 MiB)": ("vacuum", {}),
    "backup API, one final fsync": ("backup", {"sync_bytes": 0}),
    "VACUUM INTO, one final fsync": ("vacuum", {"sync_bytes": 0}),
    # Tuning alternatives (``--contenders``): smaller flushes, a pause after each flush.
    "backup API (flushed every 1 MiB)": ("backup", {"sync_bytes": 1 << 20}),
    "backup API (4 MiB flushes, 50 ms pauses)": ("backup", {"pause": 0.05}),
}
DEFAULT_CONTENDERS = list(CONTENDERS)[:4]
BASELINE = "baseline (writers only)"


def _spread(values: list[float], unit: str, digits: int = 0) -> str:
    return spread(values, f"{{:.{digits}f}}", unit=f" {unit}" if unit else "")


def backups(path: Path, folder: Path, rounds: int, writers: int, chosen: list[str]) -> None:
    names = [BASELINE, *chosen]
    results: dict[str, list[Phase]] = {name: [] for name in names}
    longest = 15.0
    print(f"\n| round | load avg (1 min) | {' | '.join(names)} |")
    print(f"| --- | --- | {' | '.join('---' for _ in names)} |")
    for number in range(rounds):
        load = os.getloadavg()[0]
        shift = number % len(names)
        cells: dict[str, str] = {}
        for name in names[shift:] + names[:shift]:
            tag = f"{os.getpid()}-{number}-{names.index(name)}"
            if name == BASELINE:
                # As long as the longest backup so far: a longer window sees a worse maximum.
                result = phase(path, writers, tag, _idle, longest)
            else:
                method, options = CONTENDERS[name]
                result = phase(path, writers, tag, _backup(folder, method, **options), 0)  # type: ignore[arg-type]
                _remove_copy(folder)
                longest = max(longest, result.seconds)
            results[name].append(result)
            cells[name] = (
                f"max {result.max_ms:.0f} / p99 {result.p99_ms:.0f} ms, {result.seconds:.1f} s, "
                f"{result.writes_per_s:.0f} writes/s"
            )
        print(f"| {number + 1} | {load:.1f} | {' | '.join(cells[n] for n in names)} |", flush=True)
    print(f"\nMedian [min..max] over {rounds} rounds, {writers} writers, "
          f"{path.stat().st_size / 2**30:.2f} GiB database:\n")  # fmt: skip
    print(
        "| contender | writers' max latency | writers' p99 | duration | writes/s "
        "| rounds with max <= 250 ms |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        phases = results[name]
        within = sum(p.max_ms <= BOUND_MS for p in phases)
        print(
            f"| {name} | {_spread([p.max_ms for p in phases], 'ms')} | "
            f"{_spread([p.p99_ms for p in phases], 'ms')} | "
            f"{_spread([p.seconds for p in phases], 's', 1)} | "
            f"{_spread([p.writes_per_s for p in phases], '')} | {within}/{len(phases)} |"
        )


def others(path: Path, folder: Path, writers: int, wanted: set[str]) -> None:
    """Optimize and prune once each, on a throw-away copy (a prune deletes)."""
    scratch = folder / "scratch.db"
    shutil.copyfile(path, scratch)
    print("\n| operation | time | writes | p99 | max | notes |")
    print("| --- | --- | --- | --- | --- | --- |")
    if "optimize" in wanted:

        def optimize(p: Path) -> object:
            with SessionDB(p) as store:
                return maintenance.optimize(store.uow)

        result = phase(scratch, writers, "optimize", optimize, 0)
        assert isinstance(result.result, maintenance.Report)
        steps = (
            f"{result.result.merge_steps} merge steps, "
            f"longest lock {result.result.longest_step_s * 1000:.1f} ms"
        )
        print(f"| db optimize | {result.seconds:.1f} s | {len(result.latencies)} | "
              f"{result.p99_ms:.0f} ms | {result.max_ms:.0f} ms | {steps} |")  # fmt: skip
    if "prune" in wanted:

        def prune(p: Path) -> object:
            with SessionDB(p) as store:
                return retention.run(store.uow, retention.Policy(300))

        result = phase(scratch, writers, "prune", prune, 0)
        assert isinstance(result.result, retention.Report)
        notes = f"{result.result.sessions} sessions in {result.result.chunks} chunks"
        print(f"| prune (older than 300 days) | {result.seconds:.1f} s | {len(result.latencies)} | "
              f"{result.p99_ms:.0f} ms | {result.max_ms:.0f} ms | {notes} |")  # fmt: skip
    for leftover in folder.glob("scratch.db*"):
        leftover.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument(
        "--contenders",
        default="all",
        help=f"Backups to compare with the baseline: 'all' (the first four) or a ';' list "
        f"of {list(CONTENDERS)}",
    )
    parser.add_argument("--ops", default="backup", help="backup, optimize, prune (comma list).")
    args = parser.parse_args()
    chosen = DEFAULT_CONTENDERS if args.contenders == "all" else args.contenders.split(";")
    unknown = set(chosen) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}")
    path = cached(args.cache, args.size_mb)
    folder = Path(tempfile.mkdtemp(prefix="hermes-ops-bench-", dir=args.cache))
    try:
        wanted = set(args.ops.split(","))
        if "backup" in wanted:
            backups(path, folder, args.rounds, args.writers, chosen)
        if wanted & {"optimize", "prune"}:
            others(path, folder, args.writers, wanted)
    finally:
        shutil.rmtree(folder)
    wal = Path(f"{path}-wal")
    print(f"\nWAL after the run: {wal.stat().st_size if wal.exists() else 0:,} bytes")


if __name__ == "__main__":
    main()
