"""Eight processes open one big legacy ``state.db`` at the same moment, round after round.

    .venv/bin/python -m bench.adoption --rounds 20 --sessions 300000

What the many-writers work must hold: every opener succeeds, every round, while one of them
adopts the file and holds the write lock for the whole (long) full-text rebuild.

Each round copies a cached template (built once per size under the temp dir, ``--rebuild``
builds it again): a file the original store wrote at schema_version 3 (``tests/support/legacy.py``),
grown to ``--sessions`` sessions with one or two messages each, whose FTS5 table and triggers
are gone, so adopting it recreates them and indexes every message under the write lock (the
longest step an adoption takes). Then ``--openers`` spawned processes wait on a barrier, open
the file with ``SessionDB`` and each append one message to a session of its own.

A round passes when every opener succeeded and the file is whole: at head, every session and
message of the template plus the openers' kept, ``messages_fts`` holding one entry per message,
FTS5's ``integrity-check`` passing and a search finding each opener's message.

Printed (markdown): per round the adoption time (how long the adopting process held the write
lock, from its own log), the worst wait (the longest any other opener took from the barrier to
its appended message), how many openers' turns left the writer queue for SQLite's busy handler
(the line stood still past its bounded wait, e.g. the adopter starved of CPU between two
statements), and the failures; then rounds passed out of N and the median [min..max] of the
adoption time and of the worst wait. ``--load N`` runs N CPU-burning processes beside the
openers: a loaded machine, where the adoption outlasts a fixed retry budget.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import queue
import re
import shutil
import sqlite3
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.timing import spread
from hermes_store import current
from hermes_store.schema import ddl, fulltext
from hermes_store.schema.migrate import head_revision
from hermes_store.uow import writequeue
from tests.support import legacy, proc_workers

#: The version the template is written at (a v3 file adopts through every later revision).
TEMPLATE_VERSION = 3
#: Hang guard only: a round whose openers have not all reported by then fails.
OPENER_TIMEOUT_S = 900.0
HELD = re.compile(r"held the write lock for ([0-9.]+) s")


@dataclass
class Opened:
    """What one opener reports."""

    index: int
    seconds: float = 0.0  #: from the barrier to its message appended
    adopted: bool = False  #: it ran the adoption (stamped the legacy file)
    held: float = 0.0  #: how long its migration held the write lock (its log)
    fallbacks: int = 0  #: its turns that left the writer queue for SQLite's busy handler
    error: str = ""


@dataclass
class Round:
    number: int
    openers: list[Opened] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def adoption(self) -> float:
        return max((o.held for o in self.openers if o.adopted), default=float("nan"))

    @property
    def worst_wait(self) -> float:
        waits = [o.seconds for o in self.openers if not o.adopted and not o.error]
        return max(waits, default=float("nan"))

    @property
    def passed(self) -> bool:
        return not self.problems


# -- the legacy file ------------------------------------------------------------------------------


def build_template(path: Path, sessions: int) -> tuple[int, int]:
    """A v3 file as the original store left it, with ``sessions`` more sessions (one or two
    messages each) and no full-text index; returns its (sessions, messages). The WAL is folded
    in, so copying the file alone copies the whole database."""
    partial = path.with_suffix(".partial")
    for leftover in (partial, Path(f"{partial}-wal"), Path(f"{partial}-shm")):
        leftover.unlink(missing_ok=True)
    legacy.build_legacy_db(partial, TEMPLATE_VERSION)
    legacy.drop_full_text(partial)
    raw = sqlite3.connect(partial, isolation_level=None)
    try:
        raw.execute("BEGIN")
        raw.executemany(
            "INSERT INTO sessions (id, source, model, started_at, message_count, title) "
            "VALUES (?, 'cli', 'bench-model', ?, ?, ?)",
            (
                (f"bench-{i:07d}", 1.7e9 + i, 1 + i % 2, f"bench session {i}")
                for i in range(sessions)
            ),
        )
        raw.executemany(
            "INSERT INTO messages (session_id, role, content, timestamp) VALUES (?, ?, ?, ?)",
            (
                (f"bench-{i:07d}", role, f"{role} note {i} about llamas and word{i % 977}", ts)
                for i in range(sessions)
                for role, ts in (("user", 1.7e9 + i), ("assistant", 1.7e9 + i + 0.5))[: 1 + i % 2]
            ),
        )
        raw.execute("COMMIT")
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        counts = tuple(
            raw.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("sessions", "messages")
        )
    finally:
        raw.close()
    partial.rename(path)
    return counts[0], counts[1]


def template(cache: Path, sessions: int, rebuild: bool) -> tuple[Path, int, int]:
    """The cached template for ``sessions`` (built when missing): its path and row counts."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"legacy-v{TEMPLATE_VERSION}-{sessions}.db"
    if rebuild or not path.exists() or Path(f"{path}-wal").exists():
        path.unlink(missing_ok=True)
        started = time.monotonic()
        rows = build_template(path, sessions)
        print(f"built {path} ({rows[0]:,} sessions, {rows[1]:,} messages) "
              f"in {time.monotonic() - started:.1f} s", flush=True)  # fmt: skip
        return path, *rows
    raw = sqlite3.connect(path)  # a WAL file: read-only would need its -shm to exist
    try:
        counts = [
            raw.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("sessions", "messages")
        ]
    finally:
        raw.close()
    return path, counts[0], counts[1]


# -- the openers ----------------------------------------------------------------------------------


class _HeldLog(logging.Handler):
    """Collects what this process's migration logged: whether it adopted, how long it held."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.adopted = False
        self.held = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "adopting a legacy database" in message:
            self.adopted = True
        elif (found := HELD.search(message)) and self.adopted:
            self.held = float(found.group(1))


def open_and_append(path: str, index: int, barrier: Any, out: Any) -> None:
    """One opener: wait for the others, open the file, append one message; report."""
    handler = _HeldLog()
    for name in ("hermes_store.schema.migrate", "hermes_store.migrations"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    report = Opened(index)
    try:
        barrier.wait(timeout=OPENER_TIMEOUT_S)
        started = time.monotonic()
        proc_workers.write_one(path, index)
        report.seconds = time.monotonic() - started
    except BaseException as error:
        report.error = f"{type(error).__name__}: {error}"
    report.adopted, report.held = handler.adopted, handler.held
    report.fallbacks = writequeue.for_database(path).stats().fallbacks
    out.put(report)


def run_round(number: int, source: Path, work: Path, openers: int, rows: tuple[int, int]) -> Round:
    """Copy the template, let ``openers`` processes open it at once, check what is left."""
    path = work / f"round-{number}.db"
    shutil.copyfile(source, path)
    result = Round(number)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(openers), ctx.Queue()
    procs = [ctx.Process(target=open_and_append, args=(str(path), i, barrier, out))
             for i in range(openers)]  # fmt: skip
    for proc in procs:
        proc.start()
    for _ in procs:
        try:
            result.openers.append(out.get(timeout=OPENER_TIMEOUT_S))
        except queue.Empty:
            result.problems.append("an opener did not report in time")
            break
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            result.problems.append(f"{proc.name} hung")
    errors = Counter(o.error.split(" (")[0] for o in result.openers if o.error)
    result.problems += [f"{n} opener(s): {error}" for error, n in errors.items()]
    if sum(o.adopted for o in result.openers) != 1:
        result.problems.append(f"{sum(o.adopted for o in result.openers)} openers adopted")
    result.problems += check_file(path, rows[0] + openers, rows[1] + openers, openers)
    for suffix in ("", "-wal", "-shm", "-writer.lock"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return result


def check_file(path: Path, sessions: int, messages: int, openers: int) -> list[str]:
    """Whatever is wrong with the adopted file (empty: nothing)."""
    problems: list[str] = []
    if (revision := current(path)) != head_revision():
        problems.append(f"at {revision}, not at head")
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        found = {
            "sessions": raw.execute("SELECT count(*) FROM sessions").fetchone()[0],
            "messages": raw.execute("SELECT count(*) FROM messages").fetchone()[0],
            "indexed": raw.execute("SELECT count(*) FROM messages_fts_docsize").fetchone()[0],
            "openers found": raw.execute(
                "SELECT count(*) FROM messages_fts WHERE messages_fts MATCH 'concurrent message'"
            ).fetchone()[0],
        }
        want = {"sessions": sessions, "messages": messages, "indexed": messages,
                "openers found": openers}  # fmt: skip
        problems += [f"{k}: {found[k]:,} (want {want[k]:,})" for k in want if found[k] != want[k]]
        try:
            raw.execute(fulltext.integrity_statement(ddl.FTS_TABLE))
        except sqlite3.DatabaseError as error:
            problems.append(f"integrity-check: {error}")
    finally:
        raw.close()
    return problems


# -- the report -----------------------------------------------------------------------------------


def seconds(values: list[float]) -> str:
    """``median [min..max]`` in seconds."""
    return spread(values, "{:.2f}", unit=" s")


def burn(stop: Any) -> None:
    """A CPU hog (``--load``): the other work of a loaded machine."""
    spins = 0
    while not stop.is_set():
        for _ in range(100_000):
            spins += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sessions", type=int, default=300_000)
    parser.add_argument("--openers", type=int, default=8)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "hermes-bench-adoption"
    )
    parser.add_argument("--rebuild", action="store_true", help="build the template again")
    parser.add_argument(
        "--load", type=int, default=0, help="CPU-burning processes beside the openers"
    )
    args = parser.parse_args()
    source, sessions, messages = template(args.cache, args.sessions, args.rebuild)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    hogs = [ctx.Process(target=burn, args=(stop,), daemon=True) for _ in range(args.load)]
    for hog in hogs:
        hog.start()
    try:
        rounds = run_rounds(args, source, (sessions, messages))
    finally:
        stop.set()
        for hog in hogs:
            hog.join(timeout=10)
    passed = [r for r in rounds if r.passed]
    adoption = [r.adoption for r in rounds if r.adoption == r.adoption]
    waits = [r.worst_wait for r in rounds if r.worst_wait == r.worst_wait]
    print(f"\n**{len(passed)}/{len(rounds)} rounds passed**; adoption {seconds(adoption)}, "
          f"worst wait {seconds(waits)}")  # fmt: skip


def run_rounds(args: argparse.Namespace, source: Path, rows: tuple[int, int]) -> list[Round]:
    """Every round, printed as it ends."""
    sessions, messages = rows
    load = f", {args.load} CPU hogs beside them" if args.load else ""
    print(f"\n{args.openers} openers, a v{TEMPLATE_VERSION} file of {sessions:,} sessions and "
          f"{messages:,} messages without its full-text index, {args.rounds} rounds"
          f"{load}\n")  # fmt: skip
    print("| round | adoption (lock held) | worst wait | queue fallbacks | failures |")
    print("|---:|---:|---:|---:|---|")
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="hermes-adoption-", dir=args.cache) as work:
        for number in range(1, args.rounds + 1):
            done = run_round(number, source, Path(work), args.openers, (sessions, messages))
            rounds.append(done)
            failures = "; ".join(done.problems) or "none"
            fallbacks = sum(o.fallbacks for o in done.openers)
            print(f"| {number} | {done.adoption:.2f} s | {done.worst_wait:.2f} s | {fallbacks} "
                  f"| {failures} |", flush=True)  # fmt: skip
    return rounds


if __name__ == "__main__":
    main()
