"""Worker processes for the writer-queue tests (kept apart so ``spawn``ed children import only
this and ``hermes_store``). Every worker talks to the test through a pipe: it says when it is
ready and what it did, and waits for the test's word before acting.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hermes_store import SessionDB
from hermes_store.uow import writequeue
from hermes_store.uow.writer import STARVE_AFTER_S


def starve(turn: writequeue.Turn) -> None:
    """Mark the line starving as a real head does: once it has waited its share at the head
    (``STARVE_AFTER_S``). A writer that found the line empty before the head took its turn looks
    at it again within ``uncontended.QUIET_S``, less than that share, so it sees the mark."""
    time.sleep(STARVE_AFTER_S)
    turn.mark_starving()


def append_on_go(db: str, label: str, conn: Any) -> None:
    """Open the store, say "ready", wait for "go", append ``label`` to session "q", say "done"."""
    store = SessionDB(db)
    conn.send("ready")
    conn.recv()
    store.append_message("q", "user", label)
    store.close()
    conn.send("done")


def hold_turn(db: str, conn: Any) -> None:
    """Commit one message, then take a queue turn, mark the line starving (newcomers queue
    behind it) and hold it until told to let go."""
    store = SessionDB(db)
    store.append_message("q", "user", "holder committed")
    with writequeue.for_database(db).turn() as turn:
        turn.mark_starving()
        conn.send(("holding", turn.queued))
        conn.recv()
    store.close()
    conn.send("released")


def writer_threads(db: str, kind: str, worker: int, threads: int, ops: int, conn: Any) -> None:
    """``threads`` threads (each on its own store of ``kind``), ``ops`` x (append + tokens)."""
    if kind == "original":
        from tests.support.seed_store import SeedSessionDB

        stores: list[Any] = [SeedSessionDB(db) for _ in range(threads)]
    else:
        stores = [SessionDB(db) for _ in range(threads)]
    errors: list[str] = []
    conn.send("ready")
    conn.recv()

    def work(thread: int) -> None:
        for op in range(ops):
            try:
                stores[thread].append_message("q", "user", f"{kind} w{worker} t{thread} o{op}")
                stores[thread].update_token_counts("q", input_tokens=1, output_tokens=2)
            except Exception as error:
                errors.append(f"{kind} w{worker} t{thread} o{op}: {error!r}")

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    stats = None
    for store in stores:
        write_queue = getattr(getattr(store, "uow", None), "write_queue", None)
        if write_queue is not None:
            stats = write_queue.stats()
        store.close()
    conn.send((errors, stats))
