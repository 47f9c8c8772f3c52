"""A write that waits for another process's lock says so on a terminal, naming the holder,
instead of waiting silently."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_store import SessionDB
from hermes_store.engine.files import write_lock_holders
from tests.support.cli_process import RUN_CLI
from tests.support.readable import readable

HOLD = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE sessions SET title = 'held' WHERE id = 's1'")
print("holding", flush=True)
sys.stdin.readline()
con.execute("ROLLBACK")
"""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    target = tmp_path / "state.db"
    with SessionDB(target) as db:
        db.create_session("s1", "cli")
    return target


def _holder(path: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


@pytest.mark.slow
def test_the_kernel_names_the_holder_of_the_write_lock(path: Path) -> None:
    assert write_lock_holders(path) == []
    holder = _holder(path)
    try:
        found = write_lock_holders(path)
        assert [pid for pid, _ in found] == [holder.pid]
        assert "BEGIN IMMEDIATE" in found[0][1] or "python" in found[0][1]
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=60)
    assert write_lock_holders(path) == []


@pytest.mark.slow
def test_a_waiting_write_says_whom_it_waits_for_on_a_terminal(path: Path) -> None:
    holder = _holder(path)
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "HERMES_STORE_URL"}
    cli = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, "--db", str(path), "sessions", "rename", "s1", "renamed"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    said = b""
    deadline = time.monotonic() + 120
    try:
        while b"Waiting for the write lock" not in said:
            assert time.monotonic() < deadline, said
            if readable(leader, 1.0):
                said += os.read(leader, 4096)
        assert f"process {holder.pid}".encode() in said
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")  # let go: the rename then lands
        holder.stdin.flush()
        holder.wait(timeout=60)
    assert cli.wait(timeout=120) == 0
    os.close(leader)
    with SessionDB(path) as db:
        assert db.get_session("s1")["title"] == "renamed"  # type: ignore[index]
