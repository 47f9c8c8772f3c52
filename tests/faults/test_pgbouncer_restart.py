"""A fleet behind PgBouncer (transaction pooling) comes back by itself after the server
restarts: on a private cluster and a private PgBouncer (never the shared ones), two
processes of four writer threads append while the server is restarted twice in immediate
mode; every writer writes again within 10 s of the server accepting connections, no write
fails outright, and every acknowledged append is there exactly once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.pool import NullPool

from hermes_store import (
    AsyncSessionDB,
    DatabaseUnavailableError,
    InvalidInputError,
    RetryPolicy,
    SessionDB,
)
from hermes_store.cli import cli as cli_main
from hermes_store.schema import migrate
from tests.support.log_events import LogSays
from tests.support.opening import Opening
from tests.support.pgbouncer_workers import THREADS

PROCESSES = 2
#: The acceptance bound: every writer writes again this soon after the server is back.
BACK_WITHIN_S = 10.0
#: Generous bounds for a loaded machine: only a broken store ever reaches them.
PATIENCE_S = 120.0


def _binaries() -> tuple[Path, Path] | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    bouncer = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not found or not os.access(bouncer, os.X_OK):
        return None
    return Path(found[-1]).parent, Path(bouncer)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    """A private PostgreSQL cluster and a PgBouncer in front of it, both ours to break."""

    bin: Path
    bouncer_bin: Path
    folder: Path
    port: int = field(default_factory=_free_port)
    bouncer_port: int = field(default_factory=_free_port)

    @property
    def as_owner(self) -> list[str]:
        # PostgreSQL and PgBouncer refuse to run as root.
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @property
    def direct_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def bouncer_url(self) -> str:
        return (
            f"postgresql+psycopg://postgres@127.0.0.1:{self.bouncer_port}/postgres"
            "?prepare_threshold=none"
        )

    def run(self, *argv: str) -> None:
        subprocess.run([*self.as_owner, *argv], check=True, capture_output=True, timeout=120)

    def pg_ctl(self, *argv: str) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self.run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.folder / "data"),
            "-l",
            str(self.folder / "postgres.log"),
            "-o",
            options,
            "-w",
            *argv,
        )

    def start(self, login_retry: int) -> None:
        self.run(str(self.bin / "initdb"), "-D", str(self.folder / "data"), "-A", "trust", "-U",
                 "postgres")  # fmt: skip
        self.pg_ctl("start")
        self.write_bouncer_config(login_retry)
        self.run(str(self.bouncer_bin), "-d", str(self.folder / "pgbouncer.ini"))
        self.wait_ready(self.bouncer_port)

    def write_bouncer_config(self, login_retry: int) -> None:
        """The CI's PgBouncer settings (.ci/pgbouncer) with ``server_login_retry``."""
        (self.folder / "userlist.txt").write_text('"postgres" ""\n')
        (self.folder / "pgbouncer.ini").write_text(
            f"""[databases]
* = host=127.0.0.1 port={self.port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.bouncer_port}
unix_socket_dir =
auth_type = trust
auth_file = {self.folder}/userlist.txt
admin_users = postgres
pool_mode = transaction
max_client_conn = 500
default_pool_size = 20
server_reset_query =
server_login_retry = {login_retry}
ignore_startup_parameters = extra_float_digits,options
logfile = {self.folder}/pgbouncer.log
pidfile = {self.folder}/pgbouncer.pid
"""
        )
        if os.geteuid() == 0:
            shutil.chown(self.folder / "pgbouncer.ini", "postgres")

    def reload_bouncer(self, login_retry: int) -> None:
        """New settings through the console's RELOAD (it returns once they apply)."""
        import psycopg

        self.write_bouncer_config(login_retry)
        with psycopg.connect(
            host="127.0.0.1",
            port=self.bouncer_port,
            user="postgres",
            dbname="pgbouncer",
            autocommit=True,
        ) as conn:
            conn.execute("RELOAD")

    def wait_ready(self, port: int) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            probe = subprocess.run(
                [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)],
                check=False,
            )
            if probe.returncode == 0:
                return
            time.sleep(0.1)  # polling a condition, with a deadline
        raise AssertionError(f"nothing accepts connections on port {port}")

    def stop(self) -> None:
        pidfile = self.folder / "pgbouncer.pid"
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
        if (self.folder / "data" / "postmaster.pid").exists():
            self.pg_ctl("stop", "-m", "immediate")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    binaries = _binaries()
    if binaries is None:
        if os.environ.get("HERMES_STORE_REQUIRE_PG") == "1":
            pytest.fail("initdb or pgbouncer is missing but HERMES_STORE_REQUIRE_PG=1")
        pytest.skip("PostgreSQL's initdb and pgbouncer are needed for a private cluster")
    folder = Path(tempfile.mkdtemp(prefix="hermes-pgbouncer-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
    made = Cluster(*binaries, folder)
    try:
        made.start(login_retry=1)
        migrate.upgrade(made.direct_url)
        yield made
    finally:
        made.stop()
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Ledger:
    """Every outcome the writer processes reported, as they report them."""

    outcomes: list[tuple[str, str, str, float, str]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def read(self, process: int, stream: Iterator[str]) -> None:
        for line in stream:
            kind, thread, content, at, detail = line.rstrip("\n").split("\t", 4)
            with self.cond:
                self.outcomes.append((kind, f"{process}.{thread}", content, float(at), detail))
                self.cond.notify_all()

    def oks_after(self, since: float) -> dict[str, float]:
        """Each writer's first acknowledged write after ``since``."""
        first: dict[str, float] = {}
        for kind, writer, _, at, _ in self.outcomes:
            if kind == "ok" and at > since and writer not in first:
                first[writer] = at
        return first

    def wait_all_ok_after(self, since: float) -> dict[str, float]:
        with self.cond:
            self.cond.wait_for(
                lambda: len(self.oks_after(since)) == PROCESSES * THREADS, timeout=PATIENCE_S
            )
            return self.oks_after(since)


@pytest.mark.slow
def test_writers_come_back_within_seconds_of_two_immediate_restarts(cluster: Cluster) -> None:
    session = "restarts"
    with SessionDB(cluster.direct_url) as db:
        db.create_session(session, "cli")
    ledger = Ledger()
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.pgbouncer_workers",
                cluster.bouncer_url,
                session,
                f"p{n}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for n in range(PROCESSES)
    ]
    readers = [
        threading.Thread(target=ledger.read, args=(n, worker.stdout), daemon=True)
        for n, worker in enumerate(workers)
    ]
    for reader in readers:
        reader.start()
    back_after: list[float] = []
    starts: list[float] = []
    readies: list[float] = []
    try:
        ledger.wait_all_ok_after(0.0)  # every writer is writing
        for _ in range(2):
            starts.append(time.time())
            cluster.pg_ctl("restart", "-m", "immediate")  # returns once it accepts connections
            ready = time.time()
            readies.append(ready)
            first = ledger.wait_all_ok_after(ready)
            assert len(first) == PROCESSES * THREADS, f"writers never came back: {first}"
            back_after.append(max(first.values()) - ready)
    finally:
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.close()
        for worker in workers:
            worker.wait(timeout=PATIENCE_S)
        for reader in readers:
            reader.join(timeout=PATIENCE_S)
    print(json.dumps({"back_after_s": back_after, "outcomes": len(ledger.outcomes)}))
    assert all(worker.returncode == 0 for worker in workers)
    assert max(back_after) <= BACK_WITHIN_S, back_after

    kinds = collections.Counter(kind for kind, *_ in ledger.outcomes)
    # No write failed outright: the store waited for the server instead.
    assert kinds["failed"] == 0 and kinds["error"] == 0, [
        o for o in ledger.outcomes if o[0] in ("failed", "error")
    ][:5]
    # "May or may not have landed" only for writes in flight when the server died, never for
    # one that PgBouncer refused before passing it on (once the server was back).
    windows = list(zip(readies, [*starts[1:], float("inf")], strict=True))
    late = [
        o for o in ledger.outcomes if o[0] == "unknown" and any(a < o[3] < b for a, b in windows)
    ]
    assert late == [], late[:5]

    engine = sa.create_engine(cluster.direct_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            present = collections.Counter(
                conn.execute(
                    sa.text("SELECT content FROM messages WHERE session_id = :s"), {"s": session}
                ).scalars()
            )
    finally:
        engine.dispose()
    acked = [content for kind, _, content, _, _ in ledger.outcomes if kind == "ok"]
    unknown = {content for kind, _, content, _, _ in ledger.outcomes if kind == "unknown"}
    assert len(acked) == len(set(acked))
    assert [c for c in acked if present[c] != 1] == []  # acknowledged: exactly once
    assert [c for c in unknown if present[c] > 1] == []  # unknown: 0 or 1 times
    assert set(present) <= set(acked) | unknown  # nothing else landed


@pytest.mark.slow
def test_an_async_store_waits_for_a_restarting_server_without_blocking_its_loop(
    cluster: Cluster,
) -> None:
    """Directly connected (PgBouncer would hold the query itself): a call waits for the server
    up to the policy's ``unavailable_timeout``, far beyond the lock retries' ~1 s, while the
    event loop keeps running; past the timeout it says the server stayed unreachable."""
    with SessionDB(cluster.direct_url) as db:
        db.create_session("async", "cli")
    url = cluster.direct_url.replace("+psycopg:", "+psycopg_async:")

    async def main() -> tuple[int, float, int]:
        async with (
            AsyncSessionDB(url) as patient,
            AsyncSessionDB(url, retry=RetryPolicy(unavailable_timeout=1.0)) as brief,
        ):
            await patient.append_message("async", "user", "before")
            await brief.get_session("async")
            cluster.pg_ctl("stop", "-m", "immediate")
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticking = asyncio.ensure_future(ticker())
            append = asyncio.ensure_future(patient.append_message("async", "user", "while down"))
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailableError, match="stayed unreachable for"):
                await brief.append_message("async", "user", "gives up")
            gave_up_after = time.monotonic() - started
            # Twice the lock retries' budget and more: the patient call is still waiting.
            while time.monotonic() - started < 3.0:
                await asyncio.sleep(0.05)
                assert not append.done(), append.result()
            ticked = ticks
            await asyncio.get_running_loop().run_in_executor(None, cluster.pg_ctl, "start")
            await asyncio.wait_for(append, PATIENCE_S)
            ticking.cancel()
            return len(await patient.get_messages("async")), gave_up_after, ticked

    count, gave_up_after, ticked = asyncio.run(main())
    assert count == 2
    assert gave_up_after >= 1.0
    assert ticked >= 50  # the loop ran all along (a blocked loop would not tick)


@pytest.mark.slow
def test_a_store_opened_while_the_server_is_down_waits_for_it(cluster: Cluster) -> None:
    """Opening, as a call, waits up to ``unavailable_timeout`` for a server it cannot reach (a
    restart, a failover): a short timeout expires with DatabaseUnavailableError, sync and
    async; the default one opens once the server is started during the wait."""
    with SessionDB(cluster.direct_url) as db:
        db.create_session("opened-late", "cli")
    brief = RetryPolicy(unavailable_timeout=0.3)
    async_url = cluster.direct_url.replace("+psycopg:", "+psycopg_async:")
    cluster.pg_ctl("stop", "-m", "immediate")
    try:
        with pytest.raises(DatabaseUnavailableError, match="stayed unreachable for") as gave_up:
            SessionDB(cluster.direct_url, retry=brief)
        assert "Connection refused" in str(gave_up.value)

        async def open_async() -> None:
            async with AsyncSessionDB(async_url, retry=brief):
                raise AssertionError("opened with the server down")

        with pytest.raises(DatabaseUnavailableError, match="stayed unreachable for"):
            asyncio.run(open_async())

        with LogSays("hermes_store.uow.retry", "unreachable") as waiting:
            opening = Opening(cluster.direct_url, ended=waiting.said)
            assert waiting.said.wait(PATIENCE_S), "the opening never said it waits"
            assert opening.outcome() is None  # waiting (said so), not ended
            cluster.pg_ctl("start")
            with opening.store(PATIENCE_S) as store:
                assert store.get_session("opened-late") is not None
    finally:
        if not (cluster.folder / "data" / "postmaster.pid").exists():
            cluster.pg_ctl("start")


@pytest.mark.slow
def test_doctor_says_when_server_login_retry_strands_writers(cluster: Cluster) -> None:
    runner = CliRunner()
    try:
        cluster.reload_bouncer(login_retry=15)  # PgBouncer's default
        result = runner.invoke(cli_main, ["--db", cluster.bouncer_url, "doctor", "--json"])
        checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
        assert checks["connection pooler"]["status"] == "warn"
        assert "server_login_retry = 15" in checks["connection pooler"]["detail"]
    finally:
        cluster.reload_bouncer(login_retry=1)
    result = runner.invoke(cli_main, ["--db", cluster.bouncer_url, "doctor", "--json"])
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["connection pooler"]["status"] == "ok"
    # A server that is no pooler gets no pooler check.
    result = runner.invoke(cli_main, ["--db", cluster.direct_url, "doctor", "--json"])
    assert "connection pooler" not in {c["name"] for c in json.loads(result.stdout)["checks"]}


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "30"])
def test_a_bad_unavailable_timeout_is_refused_before_anything_is_opened(
    tmp_path: Path, bad: object
) -> None:
    path = tmp_path / "state.db"
    with pytest.raises(InvalidInputError, match="unavailable_timeout"):
        SessionDB(path, retry=RetryPolicy(unavailable_timeout=bad))  # type: ignore[arg-type]
    assert not path.exists()
