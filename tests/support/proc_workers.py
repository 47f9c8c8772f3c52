"""Worker processes for the load, concurrency and fault tests.

Kept apart from the test modules so that a ``spawn``ed child imports only this and
``hermes_store`` (not pytest and the fixtures): starting ten processes on two cores stays cheap.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hermes_store import SessionDB

MARK = "loadmark"


@dataclass(frozen=True)
class Shape:
    """How much each writer does: ``threads`` threads x ``ops`` operations."""

    threads: int
    ops: int
    own_sessions: bool = True


def writer(url: str, worker: int, shape: Shape, start: Any, done: Any, out: Any) -> None:
    """Append to the shared session (and its own) and increment counters, from many threads."""
    errors: list[str] = []
    try:
        store = SessionDB(url)
    except BaseException as error:
        out.put(("writer", worker, [f"open: {error!r}"], 0))
        return

    def work(thread: int) -> None:
        for op in range(shape.ops):
            tag = f"w{worker}t{thread}o{op}"
            try:
                store.append_message("shared", "user", f"{MARK} {tag} shared")
                store.update_token_counts(
                    "shared", input_tokens=1, output_tokens=2, estimated_cost_usd=0.5
                )
                if shape.own_sessions:
                    own = f"w{worker}"
                    store.append_message(own, "assistant", f"{MARK} own {tag}")
                    store.update_token_counts(own, input_tokens=5, estimated_cost_usd=0.25)
            except BaseException as error:
                errors.append(f"{tag}: {error!r}")

    try:
        start.wait(timeout=120)
        threads = [threading.Thread(target=work, args=(t,)) for t in range(shape.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        store.close()
        out.put(("writer", worker, errors, 0))


def reader(url: str, worker: int, _shape: Shape, start: Any, done: Any, out: Any) -> None:
    """Search and list until ``done`` is set (then one last round); results must be well formed."""
    errors: list[str] = []
    reads = 0
    try:
        store = SessionDB(url)
    except BaseException as error:
        out.put(("reader", worker, [f"open: {error!r}"], 0))
        return
    try:
        start.wait(timeout=120)
        finished = False
        while not finished:
            finished = done.is_set()
            try:
                hits = store.search_messages(MARK, limit=10)
                if any(hit["snippet"] is None or "context" not in hit for hit in hits):
                    errors.append(f"r{worker}: malformed hit {hits[:1]}")
                listed = store.list_sessions_rich(limit=10, include_children=True)
                if any("preview" not in row or "last_active" not in row for row in listed):
                    errors.append(f"r{worker}: malformed row {listed[:1]}")
                store.get_messages("shared", limit=5)
                reads += 3
            except BaseException as error:
                errors.append(f"r{worker}: {error!r}")
            time.sleep(0.005)  # readers poll; they must not starve the writers of CPU
    finally:
        store.close()
        out.put(("reader", worker, errors, reads))


def run(
    url: str, *, writers: int, readers: int, shape: Shape, timeout: float = 240
) -> tuple[list[str], dict[int, int]]:
    """Start the processes together; every error they report, and each reader's read count."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(writers + readers)
    done = ctx.Event()
    procs = [ctx.Process(target=writer, args=(url, w, shape, start, done, out))
             for w in range(writers)]  # fmt: skip
    procs += [ctx.Process(target=reader, args=(url, r, shape, start, done, out))
              for r in range(readers)]  # fmt: skip
    for proc in procs:
        proc.start()
    errors: list[str] = []
    reads: dict[int, int] = {}
    writers_left = writers
    for _ in procs:
        try:
            kind, worker, worker_errors, count = out.get(timeout=timeout)
        except queue.Empty:
            errors.append("a worker did not report in time")
            break
        errors.extend(worker_errors)
        if kind == "reader":
            reads[worker] = count
        else:
            writers_left -= 1
            if writers_left == 0:
                done.set()
    done.set()
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            errors.append(f"{proc.name} hung")
        elif proc.exitcode != 0:
            errors.append(f"{proc.name} exited with {proc.exitcode}")
    return errors, reads


# -- faults ------------------------------------------------------------------------------------


def die_inside_a_unit(url: str, committed: int, mode: str, ready: Any) -> None:
    """Commit ``committed`` messages, then stop inside a write unit after inserting (the lock held,
    rows and their index entries written but not committed) and wait there to be SIGKILLed.

    ``mode`` picks the unit: ``"unit"`` (a Connection unit) or ``"driver"`` (the hot path's).
    """
    store = SessionDB(url)
    store.create_session("victim", "cli")
    for index in range(committed):
        store.append_message("victim", "user", f"committed {index} durable")
    statements = (
        "INSERT INTO messages (session_id, role, content, timestamp) "
        "VALUES ('victim', 'user', 'uncommitted ghost', 0)",
        "UPDATE sessions SET message_count = message_count + 1000 WHERE id = 'victim'",
        # Many rows at once, so pages may spill to the WAL before the commit that never comes.
        "INSERT INTO messages (session_id, role, content, timestamp) "
        "SELECT session_id, role, 'ghost ' || content, 0 FROM messages",
    )

    def unit(conn: Any) -> None:
        for statement in statements:
            conn.exec_driver_sql(statement)
        ready.set()
        time.sleep(600)

    def driver_unit(cursor: Any) -> None:
        for statement in statements:
            cursor.execute(statement)
        ready.set()
        time.sleep(600)

    if mode == "driver":
        store.uow.run_driver(driver_unit)
    else:
        store.uow.run(unit)


def drop_privileges_and_probe(path: str, out: Any) -> None:
    """As ``nobody`` (when started as root): read, then try every kind of write; report what
    each call returned or raised. Everything is imported and warmed up before the switch,
    since the interpreter's own files may not be readable by ``nobody``."""
    import tempfile

    from hermes_store import HermesStoreError

    warm_dir = tempfile.mkdtemp(prefix="hermes-warm-")
    warm = SessionDB(f"{warm_dir}/warm.db")
    warm.create_session("w", "cli")
    warm.append_message("w", "user", "warm hello")
    warm.update_token_counts("w", input_tokens=1)
    warm.search_messages("hello")
    warm.list_sessions_rich()
    warm.close()
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    report: dict[str, str] = {"uid": str(os.geteuid())}

    def attempt(name: str, fn: Callable[[], object]) -> None:
        try:
            value = fn()
        except HermesStoreError as error:
            report[name] = f"raised {type(error).__name__}: {error}"
        except BaseException as error:
            report[name] = f"RAW {type(error).__name__}: {error}"
        else:
            report[name] = f"ok {value!r}"[:300]

    try:
        store = SessionDB(path)
    except BaseException as error:
        report["open"] = f"raised {type(error).__name__}: {error}"
        out.put(report)
        return
    attempt("get_session", lambda: (store.get_session("a") or {}).get("message_count"))
    attempt("get_messages", lambda: [m["content"] for m in store.get_messages("a")])
    attempt("search", lambda: len(store.search_messages("hello")))
    attempt("list", lambda: [row["id"] for row in store.list_sessions_rich()])
    attempt("append_message", lambda: store.append_message("a", "user", "refused"))
    attempt("create_session", lambda: store.create_session("b", "cli"))
    attempt("update_token_counts", lambda: store.update_token_counts("a", input_tokens=1))
    attempt("set_session_title", lambda: store.set_session_title("a", "refused"))
    attempt("get_after", lambda: (store.get_session("a") or {}).get("input_tokens"))
    attempt("close", store.close)
    out.put(report)


def spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    """A started ``spawn`` process running ``target(*args, event)``, and that event."""
    ctx = mp.get_context("spawn")
    event = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, event))
    proc.start()
    return proc, event


def hold_write_lock(path: str, seconds: float, ready: Any) -> None:
    """Another process writing: hold ``BEGIN IMMEDIATE`` on ``path`` for ``seconds`` (the
    scenario's duration, not a synchronisation), signalling ``ready`` once the lock is held."""
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        ready.set()
        time.sleep(seconds)
        conn.execute("COMMIT")
    finally:
        conn.close()


def hold_write_lock_until(path: str, ready: Any, release: Any) -> None:
    """A stuck writer: hold ``BEGIN IMMEDIATE`` on ``path`` from ``ready`` until ``release``
    is set (bounded by GUARD-like 120 s, so a failed test never leaves it behind)."""
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        ready.set()
        release.wait(120)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def write_one(target: str, index: int, **options: Any) -> None:
    """Open ``target`` (with ``SessionDB`` ``options``), write session ``proc-<index>`` and one
    message saying ``concurrent message <index>``, close it."""
    db = SessionDB(target, **options)
    try:
        db.create_session(f"proc-{index}", "cli")
        db.append_message(f"proc-{index}", "user", f"concurrent message {index}")
    finally:
        db.close()


def open_and_append(target: str, index: int, barrier: Any, errors: Any) -> None:
    """Wait for the other openers, open ``target``, write one session and one message."""
    try:
        barrier.wait(timeout=60)
        write_one(target, index)
    except BaseException as error:
        errors.put(f"{index}: {error!r}")
        raise


#: A statement that keeps SQLite's virtual machine busy for a while (so the migration's
#: progress handler runs and beats) without touching a table.
BUSY_STATEMENT = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 200000) "
    "SELECT count(*) FROM c"
)


def adopt_slowly(path: str, waiters: int, beats: int, ready: Any) -> None:
    """A slow adopter: take the migration's connection on a legacy file (its turn in the writer
    queue and SQLite's write lock) and signal ``ready``; keep SQLite working until ``waiters``
    more processes have taken a ticket in the queue (they all wait for the lock), then until
    the queue has seen ``beats`` more heartbeats of it (at least ``beats`` x 0.2 s: the
    scenario's duration, counted in the adopter's own progress); then adopt the file."""
    from alembic import command

    from hermes_store.schema import migrate
    from hermes_store.uow import writequeue

    queue = writequeue.for_database(path)
    with migrate.migration_connection(path) as conn:
        ready.set()
        while queue.tickets()[0] < 1 + waiters:
            conn.exec_driver_sql(BUSY_STATEMENT).scalar()
        seen = {queue.progress()}
        while len(seen) <= beats:
            conn.exec_driver_sql(BUSY_STATEMENT).scalar()
            seen.add(queue.progress())
        command.upgrade(migrate.alembic_config(conn), "head")


def open_behind_an_adopter(
    target: str, index: int, attempts: int, queue_wait: float, barrier: Any, out: Any
) -> None:
    """Open ``target`` with a retry policy of ``attempts`` (and the writer queue's bounded wait
    ``queue_wait``), append one message; report ``(index, error, migration retries, queue
    fallbacks)``."""
    import logging

    from hermes_store import RetryPolicy
    from hermes_store.uow import writequeue

    os.environ[writequeue.ENV_WAIT] = str(queue_wait)
    retries = fallbacks = 0

    class Counting(logging.Handler):
        """The migration's retries and the writer queue's fallbacks (the adoption's turn and
        the store's: each queue is unregistered, counters and all, when its user is done)."""

        def emit(self, record: logging.LogRecord) -> None:
            nonlocal retries, fallbacks
            message = record.getMessage()
            retries += message.startswith("migration waits for the write lock")
            fallbacks += "write queue fallback" in message

    for name in ("hermes_store.schema.migrate", "hermes_store.uow.writequeue"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(Counting())
    error = ""
    try:
        barrier.wait(timeout=120)
        write_one(target, index, retry=RetryPolicy(attempts=attempts))
    except BaseException as exc:
        error = repr(exc)
    out.put((index, error, retries, fallbacks))


def write_sessions_in_random_order(
    url: str, sessions: list[str], threads: int, ops: int, seed: int, start: Any, out: Any
) -> None:
    """``threads`` threads (a store each) append to and add tokens on ``sessions`` in a random
    order; reports what landed per session, the errors and the process's group counters."""
    import random

    stores = [SessionDB(url) for _ in range(threads)]
    appended = {session: 0 for session in sessions}
    tokens = {session: 0 for session in sessions}
    errors: list[str] = []
    lock = threading.Lock()
    ready = threading.Barrier(threads + 1)

    def work(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        store = stores[number]
        ready.wait()
        for index in range(ops):
            session = rng.choice(sessions)
            try:
                if index % 2:
                    store.update_token_counts(session, input_tokens=1)
                    with lock:
                        tokens[session] += 1
                else:
                    store.append_message(session, "user", f"{seed}-{number}-{index}")
                    with lock:
                        appended[session] += 1
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}")

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    ready.wait()
    for worker in workers:
        worker.join()
    stats = [store.stats() for store in stores]
    for store in stores:
        store.close()
    out.put(
        {
            "appended": appended,
            "tokens": tokens,
            "errors": errors,
            "groups": sum(s.groups for s in stats),
            "lost_groups": sum(s.lost_groups for s in stats),
        }
    )


def back_up_until_killed(path: str, target: str, reached: Any, never: Any) -> None:
    """A backup of ``path`` to ``target`` stopped in its copy: at its first progress report
    ``reached`` is set, then this process waits on ``never`` for the signal that kills it."""
    from hermes_store import SessionDB

    def stop(_done: int, _total: int) -> None:
        reached.set()
        never.wait(120)

    with SessionDB(path) as store:
        store.backup(target, progress=stop, pages_per_step=1)
