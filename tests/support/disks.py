"""A real, tiny file system to fill: what a full disk does to a store."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tiny_tmpfs(size: str = "4m") -> Iterator[Path]:
    """A real tmpfs of ``size``, mounted for the block and unmounted afterwards; the test is
    skipped where it cannot be mounted (not root, no mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount are not installed")
    folder = Path(tempfile.mkdtemp(prefix="hermes-tiny-disk-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
        folder.rmdir()


def fill(folder: Path) -> Path:
    """Write a file until the file system has no block left."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                continue
    finally:
        os.close(fd)
    return filler
