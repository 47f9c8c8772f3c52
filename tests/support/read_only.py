"""Folders no file can be created in, for root too: what the read commands meet on a copied or
archived database."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def read_only_folder(folder: Path) -> Iterator[None]:
    """No file can be created in ``folder`` for the block: a plain mode (0555) for other users;
    as root, which ignores modes, the immutable attribute (skipped where ``chattr`` cannot set
    it)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("root ignores folder modes and chattr is not installed")
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make {folder} immutable here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def archived_database(folder: Path, session: str, content: str) -> Path:
    """``folder/state.db`` holding one session with one message, as a folder copied read-only
    holds it: no writer lock file beside it (the folder is created, still writable)."""
    from hermes_store import SessionDB

    folder.mkdir()
    path = folder / "state.db"
    with SessionDB(path) as db:
        db.create_session(session, "cli")
        db.append_message(session, "user", content)
    for extra in folder.glob("state.db?*"):
        extra.unlink()  # the queue's lock file
    return path
