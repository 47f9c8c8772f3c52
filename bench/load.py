"""The load benchmark: 8 writer processes (appending and incrementing one shared session's
counters, several threads each) while 2 processes search and list; write latency p50/p99/max.

Real processes (``spawn``), one database; totals are checked exactly afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier, Event
from typing import Any

from bench.corpus import COMMON_WORD
from bench.timing import percentile
from hermes_store import HermesStoreError, SessionDB

SHARED = "load-shared"


@dataclass
class LoadResult:
    """What one load run measured."""

    backend: str
    writers: int
    threads: int
    ops: int
    seconds: float
    write_latencies: list[float] = field(default_factory=list)
    read_latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reads_unavailable: bool = False
    totals_ok: bool = False
    totals: dict[str, Any] = field(default_factory=dict)

    @property
    def writes(self) -> int:
        return len(self.write_latencies)

    def summary(self) -> dict[str, float]:
        w = self.write_latencies
        r = self.read_latencies
        return {
            "write_p50_ms": percentile(w, 0.50) * 1000,
            "write_p99_ms": percentile(w, 0.99) * 1000,
            "write_max_ms": (max(w) if w else float("nan")) * 1000,
            "writes_per_s": len(w) / self.seconds if self.seconds else float("nan"),
            "read_p50_ms": percentile(r, 0.50) * 1000,
            "read_p99_ms": percentile(r, 0.99) * 1000,
            "reads": float(len(r)),
        }


def _open(url: str, kind: str) -> Any:
    """hermes_store, or the seed's own class (``tests/seed_store.py``) for the floor's run."""
    if kind == "seed":
        from tests.seed_store import SeedSessionDB

        return SeedSessionDB(url)
    return SessionDB(url)


def _writer(
    url: str, kind: str, worker: int, threads: int, ops: int, start: Barrier, out: Any
) -> None:
    store = _open(url, kind)
    latencies: list[float] = []
    errors: list[str] = []

    def work(thread: int) -> None:
        for op in range(ops):
            t0 = time.perf_counter()
            try:
                store.append_message(SHARED, "user", f"load {worker} {thread} {op} {COMMON_WORD}")
                t1 = time.perf_counter()
                store.update_token_counts(SHARED, input_tokens=1, output_tokens=2)
                t2 = time.perf_counter()
            except Exception as error:  # counted, reported, and the totals check fails
                errors.append(f"writer {worker}: {error!r}")
                continue
            latencies.extend((t1 - t0, t2 - t1))

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    start.wait()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    store.close()
    out.put(("writer", latencies, errors, False))


def _reader(url: str, kind: str, worker: int, start: Barrier, stop: Event, out: Any) -> None:
    store = _open(url, kind)
    latencies: list[float] = []
    errors: list[str] = []
    unavailable = False
    start.wait()
    turn = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            if turn % 2 == 0:
                store.search_messages(COMMON_WORD, limit=20)
            else:
                store.list_sessions_rich(limit=20)
        except NotImplementedError:
            unavailable = True  # search/listing not landed yet: keep the writers honest anyway
            time.sleep(0.01)
            continue
        except Exception as error:
            errors.append(f"reader {worker}: {error!r}")
            continue
        finally:
            turn += 1
        latencies.append(time.perf_counter() - t0)
    store.close()
    out.put(("reader", latencies, errors, unavailable))


def prepare(url: str) -> None:
    """A database at head with the shared session and a little searchable history."""
    store = SessionDB(url)
    try:
        store.create_session(SHARED, "load")
        for index in range(20):
            sid = f"load-history-{index}"
            store.create_session(sid, "cli")
            store.append_messages(
                sid,
                [
                    {"role": "user", "content": f"history {COMMON_WORD} {index} {n}"}
                    for n in range(25)
                ],
            )
    finally:
        store.close()


def run_load(
    url: str,
    backend: str,
    *,
    writers: int = 8,
    readers: int = 2,
    threads: int = 4,
    ops: int = 100,
    kind: str = "ours",
) -> LoadResult:
    """Run the load shape once against ``url`` (already prepared) and check the totals.

    ``kind="seed"`` runs the same shape with the seed's own class (SQLite path only): the floor.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(writers + readers + 1)
    stop = ctx.Event()
    procs = [
        ctx.Process(target=_writer, args=(url, kind, w, threads, ops, start, out))
        for w in range(writers)
    ]
    procs += [
        ctx.Process(target=_reader, args=(url, kind, r, start, stop, out)) for r in range(readers)
    ]
    for proc in procs:
        proc.start()
    start.wait(timeout=120)
    began = time.perf_counter()
    result = LoadResult(backend if kind == "ours" else f"{backend}, seed (floor)", writers,
                        threads, ops, 0.0)  # fmt: skip
    pending_writers = writers
    pending = len(procs)
    while pending:
        try:
            kind, latencies, errors, unavailable = out.get(timeout=300)
        except queue.Empty:
            result.errors.append("a worker did not report within 300 s")
            break
        pending -= 1
        result.errors.extend(errors)
        if kind == "writer":
            result.write_latencies.extend(latencies)
            pending_writers -= 1
            if pending_writers == 0:
                result.seconds = time.perf_counter() - began
                stop.set()
        else:
            result.read_latencies.extend(latencies)
            result.reads_unavailable |= unavailable
    stop.set()
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            result.errors.append(f"{proc.name} exited with {proc.exitcode}")
    _check_totals(url, result, writers * threads * ops)
    return result


def _check_totals(url: str, result: LoadResult, expected: int) -> None:
    store = SessionDB(url)
    try:
        session = store.get_session(SHARED)
        rows = store.message_count(SHARED)
    except HermesStoreError as error:
        result.errors.append(f"totals: {error!r}")
        return
    finally:
        store.close()
    assert session is not None
    result.totals = {
        "expected": expected,
        "message_count": session["message_count"],
        "rows": rows,
        "input_tokens": session["input_tokens"],
        "output_tokens": session["output_tokens"],
    }
    result.totals_ok = (
        session["message_count"] == rows == expected
        and session["input_tokens"] == expected
        and session["output_tokens"] == 2 * expected
    )
