"""A private PostgreSQL primary and its streaming standby, built from the server binaries on this
machine (initdb, pg_ctl, pg_basebackup) in a temporary folder on free ports, for tests that
break them: stop the primary in immediate mode, promote the standby, rebuild the old primary
as the new one's standby. Never the shared test server.

Everything waits on a condition (``pg_isready``, a query's answer) within a generous deadline,
never on a fixed sleep; :meth:`Pair.close` stops both servers and removes the folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: How long anything may take on a loaded 2-core machine before the harness gives up.
DEADLINE_S = 120.0
#: The database the tests use (created on the first primary, replicated to its standby).
DATABASE = "postgres"


def binaries() -> Path | None:
    """The newest PostgreSQL server's bin folder on this machine, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll ``condition`` until it holds (a condition, with a deadline: never a fixed sleep)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting {deadline_s:.0f} s for {what}")
        time.sleep(0.05)


@dataclass
class Node:
    """One server of the pair: its data folder and port."""

    name: str
    folder: Path
    port: int = field(default_factory=free_port)

    @property
    def data(self) -> Path:
        return self.folder / self.name

    @property
    def log(self) -> Path:
        return self.folder / f"{self.name}.log"

    @property
    def url(self) -> str:
        return self.database_url(DATABASE)

    def database_url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


class Pair:
    """A primary and a standby streaming from it; ``synchronous`` makes the primary wait for
    the standby's flush before it acknowledges a commit (``synchronous_standby_names = '*'``)."""

    def __init__(self, bin_dir: Path, *, synchronous: bool) -> None:
        self.bin = bin_dir
        self.synchronous = synchronous
        self.folder = Path(tempfile.mkdtemp(prefix="hermes-failover-"))
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres")
        self.primary = Node("a", self.folder)
        self.standby = Node("b", self.folder)

    # -- the URL the store is given -------------------------------------------------------------

    @property
    def fleet_url(self) -> str:
        """Both hosts; libpq picks the one that accepts writes."""
        hosts = "&".join(f"host=127.0.0.1:{node.port}" for node in (self.primary, self.standby))
        return f"postgresql+psycopg://postgres@/{DATABASE}?{hosts}&target_session_attrs=read-write"

    # -- running the binaries ---------------------------------------------------------------------

    @property
    def as_owner(self) -> list[str]:
        # PostgreSQL refuses to run as root.
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def run(self, *argv: str) -> None:
        done = subprocess.run(
            [*self.as_owner, *argv], capture_output=True, text=True, timeout=DEADLINE_S
        )
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr}")

    def pg_ctl(self, node: Node, *argv: str) -> None:
        options = f"-p {node.port} -k {self.folder} -c listen_addresses=127.0.0.1"
        self.run(
            str(self.bin / "pg_ctl"), "-D", str(node.data), "-l", str(node.log), "-o", options,
            "-t", str(int(DEADLINE_S)), "-w", *argv,
        )  # fmt: skip

    def write_settings(self, node: Node, **settings: str) -> None:
        """The pair's own settings (read at start and at every reload): one include file."""
        lines = [f"{name} = '{value}'" for name, value in settings.items()]
        path = node.data / "fleet.conf"
        path.write_text("\n".join(lines) + "\n")
        if os.geteuid() == 0:
            shutil.chown(path, "postgres")

    def reload(self, node: Node) -> None:
        self.pg_ctl(node, "reload")

    # -- building -----------------------------------------------------------------------------

    def start(self) -> None:
        """initdb the primary, start it, and stream a standby from it (waits until streaming,
        and until the standby is synchronous when the pair is)."""
        node = self.primary
        initdb = str(self.bin / "initdb")
        self.run(initdb, "-D", str(node.data), "-A", "trust", "-U", "postgres", "--no-sync")
        with (node.data / "postgresql.conf").open("a") as conf:
            # Durability on the server's disk is not what these tests check: fsync off.
            conf.write("fsync = off\nwal_level = replica\nhot_standby = on\n")
            conf.write("wal_keep_size = '256MB'\ninclude_if_exists = 'fleet.conf'\n")
        self.write_settings(node, synchronous_standby_names=self._sync_names)
        self.pg_ctl(node, "start")
        self.rebuild_standby()

    @property
    def _sync_names(self) -> str:
        return "*" if self.synchronous else ""

    def rebuild_standby(self) -> None:
        """(Re)create the standby from a base backup of the primary and wait until it streams
        (synchronously, for a synchronous pair)."""
        node = self.standby
        if node.running:
            self.pg_ctl(node, "stop", "-m", "immediate")
        shutil.rmtree(node.data, ignore_errors=True)
        self.run(
            str(self.bin / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.primary.port),
            "-U", "postgres", "-D", str(node.data), "-R", "-X", "stream", "-c", "fast", "--no-sync",
        )  # fmt: skip
        with (node.data / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"primary_conninfo = 'host=127.0.0.1 port={self.primary.port} "
                       f"user=postgres application_name={node.name}'\n")  # fmt: skip
        self.write_settings(node, synchronous_standby_names=self._sync_names)
        self.pg_ctl(node, "start")
        self.wait_streaming()

    def wait_streaming(self) -> None:
        wanted = "sync" if self.synchronous else "async"

        def streaming() -> bool:
            rows = self.query(
                self.primary,
                "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'",
            )
            return [row[0] for row in rows] == [wanted]

        wait_for(streaming, f"{self.standby.name} to stream ({wanted}) from {self.primary.name}")

    # -- failing over ---------------------------------------------------------------------------

    def stop_primary(self) -> None:
        """The primary dies: immediate mode (no checkpoint, every connection cut)."""
        self.pg_ctl(self.primary, "stop", "-m", "immediate")

    def promote(self) -> None:
        """The standby becomes the primary (returns once it accepts writes); the dead primary
        becomes the standby-to-be. A synchronous pair's new primary waits for no standby until
        one streams again (:meth:`resync`), as a failover manager would set it."""
        node = self.standby
        self.write_settings(node, synchronous_standby_names="")
        self.reload(node)
        self.pg_ctl(node, "promote")
        wait_for(lambda: self.query(node, "SELECT pg_is_in_recovery()") == [(False,)],
                 f"{node.name} to leave recovery")  # fmt: skip
        self.primary, self.standby = self.standby, self.primary

    def resync(self) -> None:
        """After :meth:`promote`: the old primary rebuilt as the new one's standby; a synchronous
        pair waits for it again and for everything written meanwhile to reach it."""
        self.rebuild_standby_async()
        if not self.synchronous:
            return
        self.write_settings(self.primary, synchronous_standby_names="*")
        self.reload(self.primary)
        self.wait_streaming()
        # Commits acknowledged while no standby was synchronous reach it before the next
        # failover: wait until it has flushed the primary's WAL as of now.
        self.wait_received()

    def set_synchronous(self, synchronous: bool) -> None:
        """Switch the running pair between synchronous and asynchronous replication."""
        self.synchronous = synchronous
        for node in (self.primary, self.standby):  # the standby's apply once it is promoted
            self.write_settings(node, synchronous_standby_names=self._sync_names)
            self.reload(node)
        self.wait_streaming()

    def cut_standby_off(self) -> None:
        """The standby stops receiving WAL (no primary_conninfo), as a standby lagging behind
        or cut off by the network would: returns once the primary streams to nobody."""
        self.query(self.standby, "ALTER SYSTEM SET primary_conninfo = ''")
        self.query(self.standby, "SELECT pg_reload_conf()")
        wait_for(
            lambda: self.query(self.primary, "SELECT count(*) FROM pg_stat_replication") == [(0,)],
            "the primary to stream to nobody",
        )

    def wait_received(self) -> None:
        """Until the standby has flushed every WAL record the primary wrote so far."""
        self._wait_standby_at("flush_lsn", "flush")

    def wait_replayed(self) -> None:
        """Until the standby has applied every WAL record the primary wrote so far, so reads
        on it see them (flushed is not yet visible: a database just created may be missing)."""
        self._wait_standby_at("replay_lsn", "replay")

    def _wait_standby_at(self, column: str, what: str) -> None:
        lsn = self.query(self.primary, "SELECT pg_current_wal_lsn()::text")[0][0]
        # column is one of pg_stat_replication's own LSN columns, named by the callers above.
        sql = f"SELECT count(*) FROM pg_stat_replication WHERE {column} >= %s::pg_lsn"
        wait_for(
            lambda: self.query(self.primary, sql, (lsn,)) == [(1,)],
            f"the standby to {what} the primary's WAL",
        )

    def rebuild_standby_async(self) -> None:
        synchronous, self.synchronous = self.synchronous, False
        try:
            self.rebuild_standby()
        finally:
            self.synchronous = synchronous

    # -- looking ------------------------------------------------------------------------------

    def query(self, node: Node, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of ``sql`` on ``node`` (autocommit); [] when it does not answer."""
        import psycopg

        try:
            with psycopg.connect(
                host="127.0.0.1", port=node.port, user="postgres", dbname=DATABASE,
                autocommit=True, connect_timeout=5,
            ) as conn:  # fmt: skip
                cursor = conn.execute(sql, params)  # type: ignore[arg-type]
                return list(cursor.fetchall()) if cursor.description else []
        except psycopg.OperationalError:
            return []

    def close(self) -> None:
        for node in (self.primary, self.standby):
            if node.running:
                with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                    self.pg_ctl(node, "stop", "-m", "immediate")
        shutil.rmtree(self.folder, ignore_errors=True)
