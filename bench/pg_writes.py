"""PostgreSQL writes and small reads: this code against the code before one-statement writes.

``python -m bench.pg_writes --rounds 3`` (about 3 minutes on two cores) measures, on a scratch
database of the server in ``HERMES_STORE_TEST_PG_URL`` (or ``--url``):

- latency through ``tests/support/latency_proxy.py`` adding 5 ms each way (a network between the
  gateway and the server): median ``append_message``, ``update_token_counts``,
  ``get_messages`` of a short session and a rare-word ``search_messages``, with the round
  trips per call the proxy counted;
- load 8x4 (8 processes x 4 threads, each thread its own store, appending to one shared
  session and adding to its counters; no proxy): throughput and p50/p99 latency; totals are
  checked exactly after every run. ``--ops`` (default 100 appends + 100 token updates per
  thread) sets the run's length: at 40 a run lasts about 2 s, and its ends, while threads
  start and finish unevenly and fewer than 32 write at once, weigh on the figure.

Contenders run as subprocesses importing ``hermes_store`` from their own source tree: ``new``
(this checkout) and ``old`` (``git archive`` of ``--baseline``, default the commit before the
one-statement writes), interleaved round after round (the order rotates each round, so drift on
a shared machine hits both alike). Figures are medians over rounds with [min..max].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.timing import spread

ROOT = Path(__file__).resolve().parent.parent
#: main before one-statement writes: the code path the numbers compare against.
BASELINE = "70ffc8a"
OPS = ("append_message", "update_token_counts", "get_messages", "search_rare", "floor")
RARE_WORD = "quetzalcoatlus"
#: ``floor``: a bare psycopg ``SELECT 1`` in autocommit, what one round trip costs here.


def _work(store: Any, session: str) -> dict[str, Callable[[int], object]]:
    """Each measured op (the floor on a connection of its own, outside the store)."""
    import psycopg

    url = store.engine.url
    floor = psycopg.connect(
        host=url.host, port=url.port, user=url.username, dbname=url.database, autocommit=True
    )
    return {
        "append_message": lambda i: store.append_message(session, "user", f"hello {i}"),
        "update_token_counts": lambda i: store.update_token_counts(session, input_tokens=1),
        "get_messages": lambda i: store.get_messages("short"),
        "search_rare": lambda i: store.search_messages(RARE_WORD),
        "floor": lambda i: floor.execute("SELECT 1").fetchall(),
    }


SHARED = "load-shared"


# -- the workers (run in a subprocess, hermes_store imported from --tree) ---------------------


def _latency_worker(url: str, calls: int, tag: str) -> dict[str, list[float]]:
    from hermes_store import SessionDB

    store = SessionDB(url, migrate="never")
    try:
        session = f"lat-{tag}"
        store.create_session(session, "bench")
        samples: dict[str, list[float]] = {op: [] for op in OPS}
        work = _work(store, session)
        for op, fn in work.items():
            for i in range(8):  # warm: connections open, statements prepared
                fn(i)
            for i in range(calls):
                start = time.perf_counter()
                fn(i)
                samples[op].append(time.perf_counter() - start)
        return samples
    finally:
        store.close()


def _load_worker(url: str, threads: int, ops: int) -> dict[str, Any]:
    from hermes_store import SessionDB

    stores = [SessionDB(url, migrate="never") for _ in range(threads)]
    latencies: list[list[float]] = [[] for _ in range(threads)]
    errors: list[str] = []
    ready = threading.Barrier(threads + 1)

    def work(index: int) -> None:
        store, mine = stores[index], latencies[index]
        store.get_session(SHARED)  # connect before the start
        ready.wait()
        for i in range(ops):
            for append in (True, False):
                start = time.perf_counter()
                try:
                    if append:
                        store.append_message(SHARED, "user", f"load {index} {i}")
                    else:
                        store.update_token_counts(SHARED, input_tokens=1)
                except Exception as error:
                    errors.append(f"{type(error).__name__}: {error}")
                mine.append(time.perf_counter() - start)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    print("ready", flush=True)
    sys.stdin.readline()  # the parent says go once every process is ready
    began = time.monotonic()
    ready.wait()
    for worker in workers:
        worker.join()
    ended = time.monotonic()
    for store in stores:
        store.close()
    flat = [value for mine in latencies for value in mine]
    return {"began": began, "ended": ended, "latencies": flat, "errors": errors}


# -- the parent -------------------------------------------------------------------------------


def _tree(work: Path, ref: str) -> Path:
    """``hermes_store`` of ``ref`` extracted under ``work`` (``new``: this checkout)."""
    if ref == "new":
        return ROOT
    target = work / f"tree-{ref}"
    if not target.exists():
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", ref, "hermes_store"],
            check=True,
            capture_output=True,
        ).stdout
        target.mkdir(parents=True)
        tar_path = work / f"{ref}.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(target, filter="data")
    return target


def _worker_command(tree: Path, *args: str) -> list[str]:
    """Run this module as a worker importing ``hermes_store`` from ``tree``."""
    return [sys.executable, "-m", "bench.pg_writes", "--tree", str(tree), *args]


def _seed(url: str) -> None:
    from hermes_store import SessionDB
    from hermes_store.schema import migrate

    migrate.upgrade(url)
    store = SessionDB(url)
    try:
        store.create_session("short", "bench")
        store.append_messages("short", [{"role": "user", "content": f"m {i}"} for i in range(10)])
        for s in range(50):
            sid = f"corpus-{s}"
            store.create_session(sid, "bench")
            store.append_messages(
                sid,
                [
                    {"role": "user", "content": f"the usual words of message {i} in {s}"}
                    | ({"content": f"one {RARE_WORD} here"} if (s, i) == (7, 3) else {})
                    for i in range(200)
                ],
            )
        store.create_session(SHARED, "bench")
    finally:
        store.close()


def _spread(values: Sequence[float], scale: float = 1000.0, digits: int = 1) -> str:
    return spread(values, f"{{:.{digits}f}}", scale=scale)


def _latency_round(tree: Path, url: str, calls: int, tag: str) -> dict[str, float]:
    """One contender's run through the proxy: median seconds per op."""
    out = subprocess.run(
        [
            *_worker_command(tree, "--worker", "latency", "--url", url),
            "--calls",
            str(calls),
            "--tag",
            tag,
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    samples = json.loads(out.strip().splitlines()[-1])
    return {op: statistics.median(values) for op, values in samples.items()}


def _trips_worker(url: str, op: str, calls: int) -> None:
    from hermes_store import SessionDB

    store = SessionDB(url, migrate="never")
    try:
        store.create_session("trips", "bench")
        work = _work(store, "trips")
        for i in range(8):
            work[op](i)
        print("warm", flush=True)
        sys.stdin.readline()
        for i in range(calls):
            work[op](i)
        print("done", flush=True)
        sys.stdin.readline()
    finally:
        store.close()


def _count_trips(tree: Path, url: str, proxy: Any, calls: int = 10) -> dict[str, float]:
    trips: dict[str, float] = {}
    for op in OPS:
        process = subprocess.Popen(
            [
                *_worker_command(tree, "--worker", "trips", "--url", url, "--op", op),
                "--calls",
                str(calls),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert process.stdin is not None and process.stdout is not None
        assert process.stdout.readline().strip() == "warm"
        proxy.reset()
        process.stdin.write("\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "done"
        trips[op] = proxy.reset() / calls
        process.stdin.write("\n")
        process.stdin.flush()
        process.wait(120)
    return trips


def _load_run(tree: Path, url: str, processes: int, threads: int, ops: int) -> dict[str, Any]:
    from hermes_store import SessionDB

    store = SessionDB(url, migrate="never")
    try:
        before = store.get_session(SHARED) or {}
    finally:
        store.close()
    workers = [
        subprocess.Popen(
            [
                *_worker_command(tree, "--worker", "load", "--url", url),
                "--threads",
                str(threads),
                "--ops",
                str(ops),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(processes)
    ]
    for worker in workers:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "ready"
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
    results = []
    for worker in workers:
        out, _ = worker.communicate(timeout=1800)
        results.append(json.loads(out.strip().splitlines()[-1]))
    store = SessionDB(url, migrate="never")
    try:
        after = store.get_session(SHARED) or {}
    finally:
        store.close()
    writes = processes * threads * ops
    errors = [error for result in results for error in result["errors"]]
    totals_ok = (
        after["message_count"] - before.get("message_count", 0) == writes
        and after["input_tokens"] - before.get("input_tokens", 0) == writes
    )
    seconds = max(r["ended"] for r in results) - min(r["began"] for r in results)
    latencies = sorted(value for r in results for value in r["latencies"])
    return {
        "throughput": 2 * writes / seconds,
        "p50": latencies[len(latencies) // 2],
        "p99": latencies[int(len(latencies) * 0.99)],
        "errors": errors,
        "totals_ok": totals_ok,
    }


def compare(base_url: str, database: str, rounds: int, calls: int, ops: int, baseline: str) -> str:
    from bench.build import drop_pg_database, fresh_pg_database
    from tests.support.latency_proxy import LatencyProxy

    url = fresh_pg_database(base_url, database)
    url_text = url.render_as_string(hide_password=False)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    lines: list[str] = []
    try:
        _seed(url_text)
        with tempfile.TemporaryDirectory(prefix="pg-writes-") as work_dir:
            trees = {"new": _tree(Path(work_dir), "new"), "old": _tree(Path(work_dir), baseline)}
            names = list(trees)
            latency: dict[str, dict[str, list[float]]] = {n: {op: [] for op in OPS} for n in names}
            trips: dict[str, dict[str, float]] = {}
            load: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            with LatencyProxy((url.host or "127.0.0.1", url.port or 5432), delay=0.005) as proxy:
                proxied = url.set(host="127.0.0.1", port=proxy.port)
                proxied_text = proxied.render_as_string(hide_password=False)
                for name in names:
                    trips[name] = _count_trips(trees[name], proxied_text, proxy)
                for index in range(rounds):
                    order = names[index % 2 :] + names[: index % 2]
                    for name in order:
                        medians = _latency_round(
                            trees[name], proxied_text, calls, f"{name}-{index}"
                        )
                        for op, value in medians.items():
                            latency[name][op].append(value)
            for index in range(rounds):
                order = names[index % 2 :] + names[: index % 2]
                for name in order:
                    load[name].append(_load_run(trees[name], url_text, 8, 4, ops))
        load_after = Path("/proc/loadavg").read_text().split()[:3]
        lines.append(
            f"Through the latency proxy (5 ms each way), median ms per call over {rounds} "
            f"rounds of {calls} calls [min..max of the round medians]; round trips per call "
            "counted by the proxy (warm connections):"
        )
        lines.append("")
        lines.append("| call | new | old | new/old | round trips new | round trips old |")
        lines.append("|---|---|---|---|---|---|")
        for op in OPS:
            new, old = latency["new"][op], latency["old"][op]
            ratio = statistics.median(new) / statistics.median(old)
            lines.append(
                f"| {op} | {_spread(new)} | {_spread(old)} | {ratio:.2f} | "
                f"{trips['new'][op]:g} | {trips['old'][op]:g} |"
            )
        lines.append("")
        lines.append(
            f"Load 8x4 on PostgreSQL (no proxy; {ops} appends + {ops} token updates per thread, "
            f"each thread its own store), {rounds} rounds:"
        )
        lines.append("")
        lines.append("| contender | writes/s | p50 ms | p99 ms | errors | totals exact |")
        lines.append("|---|---|---|---|---|---|")
        for name in names:
            runs = load[name]
            lines.append(
                f"| {name} | {_spread([r['throughput'] for r in runs], 1.0, 0)} | "
                f"{_spread([r['p50'] for r in runs], digits=2)} | "
                f"{_spread([r['p99'] for r in runs], digits=1)} | "
                f"{sum(len(r['errors']) for r in runs)} | "
                f"{all(r['totals_ok'] for r in runs)} |"
            )
        ratios = [
            n["throughput"] / o["throughput"] for n, o in zip(load["new"], load["old"], strict=True)
        ]
        p50s = [n["p50"] / o["p50"] for n, o in zip(load["new"], load["old"], strict=True)]
        lines.append("")
        lines.append(
            f"Per round new/old: throughput {_spread(ratios, 1.0, 2)}, p50 {_spread(p50s, 1.0, 2)}."
            f" Load average before {' '.join(load_before)}, after {' '.join(load_after)}."
        )
    finally:
        drop_pg_database(base_url, database)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("HERMES_STORE_TEST_PG_URL", ""))
    parser.add_argument("--database", default="hermes_bench_pg_writes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=40, help="timed calls per op and round")
    parser.add_argument("--ops", type=int, default=100, help="appends per thread at 8x4")
    parser.add_argument("--baseline", default=BASELINE, help="git ref of the old code path")
    # Worker mode (internal).
    parser.add_argument("--worker", choices=("latency", "load", "trips"))
    parser.add_argument("--tree", default="")
    parser.add_argument("--tag", default="")
    parser.add_argument("--op", default="")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args(argv)
    if args.worker:
        sys.path.insert(0, args.tree)  # this contender's hermes_store, before any import
        if args.worker == "latency":
            print(json.dumps(_latency_worker(args.url, args.calls, args.tag)))
        elif args.worker == "load":
            print(json.dumps(_load_worker(args.url, args.threads, args.ops)))
        else:
            _trips_worker(args.url, args.op, args.calls)
        return 0
    if not args.url:
        parser.error("no server: pass --url or set HERMES_STORE_TEST_PG_URL")
    print(compare(args.url, args.database, args.rounds, args.calls, args.ops, args.baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
