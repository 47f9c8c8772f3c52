"""Chaos: processes x threads write while the test SIGKILLs and respawns random writers (and, on
PostgreSQL, terminates their backends and restarts the server). Afterwards every acknowledged
write is there exactly once, nothing unknown or torn is, the counters add up, and the
database and its full-text index are sound.

The writers (``tests/support/chaos_workers.py``) journal each operation before and after it, fsynced
before the ack is announced on stdout; the announcements drive the disruption schedule (after
a random number of acks), so nothing here waits on the clock. PostgreSQL runs in a private
throwaway cluster (initdb into a temporary folder, a free port): the shared server is never
touched.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB
from tests.support.chaos_workers import SHARED, Op, own_session, read_journals, word_of

ROOT = Path(__file__).resolve().parents[2]
PG_BIN = Path("/usr/lib/postgresql/15/bin")
DEADLINE_S = 150  # a deadlock guard only; a run takes well under a minute
#: Per writer process: threads, and operations per thread per incarnation. A SIGKILLed writer
#: is respawned and starts its operations afresh, so kills add work.
THREADS = 3
SQLITE_OPS = 50
PG_OPS = 30


@dataclass
class Writer:
    worker: int
    kind: str  # "store" or "seed" (the original store)
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class Chaos:
    """Runs the writers and applies ``actions`` when the total of acks passes their marks."""

    target: str
    journal: Path
    writers: list[Writer]
    threads: int
    ops: int
    seed: int
    rng: random.Random
    killed: int = 0
    acks: int = 0
    log: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.selector = selectors.DefaultSelector()

    def spawn(self, writer: Writer) -> None:
        config = {
            "kind": writer.kind,
            "target": self.target,
            "worker": writer.worker,
            "incarnation": writer.incarnation,
            "threads": self.threads,
            "ops": self.ops,
            "seed": self.seed,
            "journal": str(self.journal),
        }
        stderr = (self.journal / f"w{writer.worker}-i{writer.incarnation}.err").open("wb")
        writer.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.chaos_workers", json.dumps(config)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        stderr.close()
        assert writer.proc.stdout is not None
        self.selector.register(writer.proc.stdout, selectors.EVENT_READ, writer)

    def kill_one(self) -> None:
        """SIGKILL a random running writer and start its next incarnation."""
        running = [w for w in self.writers if w.proc is not None and w.proc.poll() is None]
        if not running:
            return
        writer = self.rng.choice(running)
        assert writer.proc is not None and writer.proc.stdout is not None
        os.kill(writer.proc.pid, signal.SIGKILL)
        writer.proc.wait()
        self.selector.unregister(writer.proc.stdout)
        writer.proc.stdout.close()
        self.killed += 1
        self.log.append(f"killed w{writer.worker}i{writer.incarnation} at {self.acks} acks")
        writer.incarnation += 1
        self.spawn(writer)

    def run(self, actions: list[tuple[int, Callable[[], None]]]) -> None:
        for writer in self.writers:
            self.spawn(writer)
        pending = sorted(actions, key=lambda a: a[0])
        deadline = time.monotonic() + DEADLINE_S
        while self.selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.errors.append(f"writers still running after {DEADLINE_S} s")
                self._kill_all()
                return
            for key, _ in self.selector.select(timeout=remaining):
                writer = key.data
                chunk = os.read(key.fd, 65536)
                if chunk:
                    self.acks += chunk.count(b"\n")
                    continue
                self.selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                assert writer.proc is not None
                if writer.proc.wait() != 0:
                    err = self.journal / f"w{writer.worker}-i{writer.incarnation}.err"
                    self.errors.append(
                        f"w{writer.worker} exited {writer.proc.returncode}: "
                        f"{err.read_text()[-2000:]}"
                    )
            while pending and self.acks >= pending[0][0]:
                pending.pop(0)[1]()

    def _kill_all(self) -> None:
        for writer in self.writers:
            if writer.proc is not None and writer.proc.poll() is None:
                writer.proc.kill()
                writer.proc.wait()


def _seed() -> int:
    """Random per run; ``HERMES_CHAOS_SEED`` replays a failing run's choices (the kill timing
    itself still depends on how the processes interleave)."""
    return int(os.environ.get("HERMES_CHAOS_SEED") or random.randrange(1 << 30))


def _marks(rng: random.Random, count: int, up_to: int) -> list[int]:
    """``count`` random ack totals at which to disrupt, spread over the first wave of work."""
    return sorted(rng.sample(range(10, up_to), count))


# -- what must hold afterwards ------------------------------------------------------------------


def verify(
    store: SessionDB, ops: dict[str, Op], workers: list[int], rng: random.Random
) -> dict[str, int]:
    raw = [f"{op.key}: {op.raw}" for op in ops.values() if op.raw]
    assert raw == [], raw[:5]
    sessions = [SHARED, *(own_session(w) for w in workers)]
    messages = {sid: store.get_messages(sid) for sid in sessions}
    where: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for sid, rows in messages.items():
        for row in rows:
            where[row["content"]].append((row["id"], sid))
    duplicates = {c: w for c, w in where.items() if len(w) > 1}
    assert duplicates == {}, list(duplicates.items())[:5]

    known: set[str] = set()
    lost: list[str] = []
    torn: list[str] = []
    for op in ops.values():
        if op.op == "tokens":
            continue
        known.update(op.contents)
        found = [where.get(content, []) for content in op.contents]
        if op.acked is not None:
            if not all(found) or [f[0] for f in found] != [(i, op.sid) for i in op.acked]:
                lost.append(f"{op.key}: acked {op.acked} in {op.sid}, found {found}")
        elif any(found) and not all(found):
            torn.append(f"{op.key}: {found}")  # part of one all-or-nothing unit landed
    assert lost == [], lost[:5]
    assert torn == [], torn[:5]
    unknown = sorted(set(where) - known)
    assert unknown == [], unknown[:5]

    totals = {"acked": 0, "in_flight": 0, "failed": 0, "failed_but_landed": 0, "messages": 0}
    for sid in sessions:
        session = store.get_session(sid)
        assert session is not None
        count = len(messages[sid])
        totals["messages"] += count
        assert session["message_count"] == count, (sid, session["message_count"], count)
        mine = [op for op in ops.values() if op.sid == sid]
        acked_msgs = sum(len(op.contents) for op in mine if op.acked is not None)
        maybe_msgs = sum(len(op.contents) for op in mine if op.acked is None)
        assert acked_msgs <= count <= acked_msgs + maybe_msgs, (sid, acked_msgs, count)
        tokens = [op for op in mine if op.op == "tokens"]
        acked_tokens = sum(op.tokens for op in tokens if op.acked is not None)
        maybe_tokens = sum(op.tokens for op in tokens if op.acked is None)
        have = session["input_tokens"]
        assert acked_tokens <= have <= acked_tokens + maybe_tokens, (sid, acked_tokens, have)
        assert session["output_tokens"] == 2 * have  # both counters of one statement, together
    totals["acked"] = sum(op.acked is not None for op in ops.values())
    totals["in_flight"] = sum(op.acked is None and op.failed is None for op in ops.values())
    totals["failed"] = sum(op.failed is not None for op in ops.values())
    # A failed call whose commit reached the server before the connection died: it landed.
    totals["failed_but_landed"] = sum(
        op.failed is not None and bool(op.contents) and op.contents[0] in where
        for op in ops.values()
    )

    acked = [
        pair for op in ops.values() if op.acked for pair in zip(op.contents, op.acked, strict=True)
    ]
    for content, message_id in rng.sample(acked, min(25, len(acked))):
        hits = store.search_messages(word_of(content), limit=5)
        assert message_id in {hit["id"] for hit in hits}, (content, hits[:2])
    return totals


def _sqlite_is_sound(path: Path) -> None:
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        raw.execute("INSERT INTO messages_fts(messages_fts) VALUES('integrity-check')")
        # rank=1: also compare the index with the content table (SQLITE_CORRUPT_VTAB on drift)
        raw.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES('integrity-check', 1)")
        assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        raw.close()


def _prepare(target: str, workers: list[int]) -> None:
    store = SessionDB(target)
    try:
        for sid in (SHARED, *(own_session(w) for w in workers)):
            store.create_session(sid, "chaos")
    finally:
        store.close()


# -- SQLite -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_chaos_sqlite(tmp_path: Path) -> None:
    seed = _seed()
    rng = random.Random(seed)
    path = tmp_path / "state.db"
    journal = tmp_path / "journal"
    journal.mkdir()
    kinds = ["store", "store", "store", "seed"]
    workers = list(range(len(kinds)))
    _prepare(str(path), workers)
    chaos = Chaos(
        str(path),
        journal,
        [Writer(w, k) for w, k in zip(workers, kinds, strict=True)],
        threads=THREADS,
        ops=SQLITE_OPS,
        seed=seed,
        rng=rng,
    )
    first_wave = len(kinds) * THREADS * SQLITE_OPS
    chaos.run([(mark, chaos.kill_one) for mark in _marks(rng, 14, first_wave * 4 // 5)])
    assert chaos.errors == [], (seed, chaos.errors)
    assert chaos.killed == 14, (seed, chaos.log)
    _sqlite_is_sound(path)
    store = SessionDB(path)
    try:
        totals = verify(store, read_journals(journal), workers, rng)
    finally:
        store.close()
    _sqlite_is_sound(path)
    print(f"chaos sqlite: seed {seed}, {chaos.killed} kills, {totals}")
    assert totals["acked"] >= first_wave // 2, (seed, totals)


# -- PostgreSQL, on a private cluster -----------------------------------------------------------


@dataclass
class Cluster:
    base: Path
    port: int
    as_owner: list[str]

    @property
    def data(self) -> Path:
        return self.base / "data"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def pg_ctl(self, *args: str) -> None:
        options = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200"
        )
        subprocess.run(
            [
                *self.as_owner,
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-o",
                options,
                "-l",
                str(self.base / "server.log"),
                "-w",
                "-t",
                "60",
                *args,
            ],
            check=True,
            capture_output=True,
        )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A throwaway PostgreSQL 15 server of our own (the shared one is never restarted)."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL server binaries in {PG_BIN}")
    base = Path(tempfile.mkdtemp(prefix="hermes-chaos-pg-"))
    as_owner: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as postgres
        shutil.chown(base, "postgres", "postgres")
        as_owner = ["runuser", "-u", "postgres", "--"]
    try:
        subprocess.run(
            [
                *as_owner,
                str(PG_BIN / "initdb"),
                "-D",
                str(base / "data"),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
        )
        server = Cluster(base, _free_port(), as_owner)
        server.pg_ctl("start")
        try:
            admin = sa.create_engine(
                server.url("postgres"), isolation_level="AUTOCOMMIT", poolclass=NullPool
            )
            with admin.connect() as conn:
                conn.exec_driver_sql("CREATE DATABASE chaos")
            admin.dispose()
            yield server
        finally:
            server.pg_ctl("-m", "immediate", "stop")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _terminate_backends(server: Cluster, log: list[str]) -> Callable[[], None]:
    def act() -> None:
        admin = sa.create_engine(
            server.url("postgres"), isolation_level="AUTOCOMMIT", poolclass=NullPool
        )
        try:
            with admin.connect() as conn:
                killed = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = 'chaos' AND pid <> pg_backend_pid()"
                    )
                ).scalar_one()
            log.append(f"terminated {killed} backends")
        finally:
            admin.dispose()

    return act


@pytest.mark.slow
def test_chaos_postgresql(cluster: Cluster) -> None:
    seed = _seed()
    rng = random.Random(seed)
    url = cluster.url("chaos")
    journal = cluster.base / "journal"
    journal.mkdir()
    workers = [0, 1, 2, 3]
    _prepare(url, workers)
    chaos = Chaos(
        url,
        journal,
        [Writer(w, "store") for w in workers],
        threads=THREADS,
        ops=PG_OPS,
        seed=seed,
        rng=rng,
    )
    first_wave = len(workers) * THREADS * PG_OPS
    marks = _marks(rng, 15, first_wave * 4 // 5)
    restart_at = marks[len(marks) // 2]

    def restart() -> None:
        cluster.pg_ctl("-m", "immediate", "restart")
        chaos.log.append("restarted the server")

    actions: list[tuple[int, Callable[[], None]]] = [(restart_at, restart)]
    for index, mark in enumerate(m for m in marks if m != restart_at):
        actions.append(
            (mark, chaos.kill_one if index % 2 else _terminate_backends(cluster, chaos.log))
        )
    chaos.run(actions)
    assert chaos.errors == [], (seed, chaos.errors)
    assert "restarted the server" in chaos.log, (seed, chaos.log)
    store = SessionDB(url)
    try:
        totals = verify(store, read_journals(journal), workers, rng)
    finally:
        store.close()
    print(f"chaos postgresql: seed {seed}, {chaos.killed} kills, {totals}, {chaos.log}")
    assert totals["acked"] >= first_wave // 3, (seed, totals)
