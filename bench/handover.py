"""The hand-over alone: what it costs to pass the writer's turn from one process to the next.

``python -m bench.handover --rounds 3`` runs ``--processes`` writer processes (default 4), each
making ``--ops`` ops (one ``append_message`` and one ``update_token_counts``) with the original
store's own code (``tests/support/seed_store.py``), one write at a time in turn. Only the
hand-over differs between the contenders:

- ``pipe``: a token passed through a pipe to the next process (a ring; the kernel wakes the
  next writer, nothing else happens);
- ``semaphore``: the same ring through a process-shared semaphore per process (a futex);
- ``queue``: hermes_store's fair writer queue (``WriteQueue.turn()``, every write a turn: the
  ticket under the lock file's mutex, the wait for the predecessor's byte through the
  descriptor's helper thread, the marks).

The same writes and commits run in every contender, so the difference in writes/s is the
hand-over. Each run is a fresh file; contenders alternate round after round (the order
rotating); the table gives the median [min..max] over rounds and checks every write landed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python bench/handover.py``: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import stamp
from bench.load import SHARED, Ring, prepare
from bench.timing import spread
from hermes_store.uow.writequeue import WriteQueue
from tests.support.seed_store import SeedSessionDB

CONTENDERS = ("pipe", "semaphore", "queue")


def _writer(
    path: str, contender: str, worker: int, rings: Any, ops: int, start: Barrier, out: Any
) -> None:
    store = SeedSessionDB(path)
    fallbacks = 0
    if contender == "queue":
        queue = WriteQueue(path)

        def turn() -> AbstractContextManager[Any]:
            return queue.turn()
    elif contender == "pipe":
        turn = Ring.of_pipes(rings, worker).turn
    else:
        turn = Ring(rings[worker].acquire, rings[(worker + 1) % len(rings)].release).turn
    start.wait()
    began = os.times()
    for op in range(ops):
        with turn() as held:
            store.append_message(SHARED, "user", f"handover {worker} {op}")
        fallbacks += held is not None and not held.queued
        with turn() as held:
            store.update_token_counts(SHARED, input_tokens=1, output_tokens=2)
        fallbacks += held is not None and not held.queued
    ended = os.times()
    store.close()
    cpu = ended.user - began.user + ended.system - began.system
    out.put((cpu, fallbacks))


def run(contender: str, processes: int, ops: int, work: Path) -> dict[str, float]:
    """One run on a fresh file: writes/s, CPU per write (µs), queue fallbacks, totals exact."""
    path = str(work / f"handover-{contender}-{time.monotonic_ns()}.db")
    prepare(path)
    ctx: Any = mp.get_context("fork")
    out = ctx.Queue()
    start = ctx.Barrier(processes + 1)
    rings: Any = None
    if contender == "pipe":
        rings = [os.pipe() for _ in range(processes)]
    elif contender == "semaphore":
        rings = [ctx.Semaphore(0) for _ in range(processes)]
    procs = [
        ctx.Process(target=_writer, args=(path, contender, w, rings, ops, start, out))
        for w in range(processes)
    ]
    for proc in procs:
        proc.start()
    start.wait(timeout=120)
    began = time.perf_counter()
    if contender == "pipe":
        os.write(rings[0][1], b"t")
    elif contender == "semaphore":
        rings[0].release()
    reports = [out.get(timeout=600) for _ in procs]
    seconds = time.perf_counter() - began
    for proc in procs:
        proc.join(timeout=60)
    for pipe in rings if contender == "pipe" else ():
        for fd in pipe:
            os.close(fd)
    store = SeedSessionDB(path)
    try:
        session = store.get_session(SHARED) or {}
        exact = session.get("message_count") == processes * ops and (
            session.get("input_tokens") == processes * ops
        )
    finally:
        store.close()
    for leftover in work.glob(f"{Path(path).name}*"):
        leftover.unlink()
    writes = 2 * processes * ops
    return {
        "writes_per_s": writes / seconds,
        "cpu_us": sum(cpu for cpu, _ in reports) / writes * 1e6,
        "fallbacks": float(sum(fallbacks for _, fallbacks in reports)),
        "exact": float(exact),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--ops", type=int, default=1500, help="ops per process and run")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hermes-handover-"))
    print(stamp.line(stamp.commit(Path(__file__).resolve().parent.parent)), flush=True)
    found: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    for round_ in range(args.rounds):
        shift = round_ % len(CONTENDERS)
        for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
            result = run(contender, args.processes, args.ops, work)
            found[contender].append(result)
            print(f"round {round_ + 1} {contender:>9}: {result['writes_per_s']:.0f} w/s, "
                  f"CPU {result['cpu_us']:.0f} µs/write", flush=True)  # fmt: skip
    work.rmdir()
    print("<!-- handover:begin -->")
    print(
        f"\n{args.processes} processes x {args.ops} ops (2 writes each), one write at a time in "
        f"turn, {args.rounds} interleaved rounds; median [min..max].\n\n"
        "| hand-over | writes/s | / pipe | CPU µs per write | queue fallbacks | totals exact |\n"
        "|---|---:|---:|---:|---:|---|"
    )
    pipe = [r["writes_per_s"] for r in found["pipe"]]
    for contender in CONTENDERS:
        runs = found[contender]
        per_s = [r["writes_per_s"] for r in runs]
        ratio = [mine / base for mine, base in zip(per_s, pipe, strict=True)]
        print(
            f"| {contender} | {spread(per_s, '{:.0f}')} | {spread(ratio, '{:.2f}x')} | "
            f"{spread([r['cpu_us'] for r in runs], '{:.0f}')} | "
            f"{sum(int(r['fallbacks']) for r in runs)} | "
            f"{'yes' if all(r['exact'] for r in runs) else 'NO'} |"
        )
    print("<!-- handover:end -->")
    wrong = any(not r["exact"] for runs in found.values() for r in runs)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
