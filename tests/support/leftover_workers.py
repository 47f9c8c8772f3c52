"""The command line in a fresh interpreter, held at a known point of its work until a signal
ends it: for tests/cli/test_cli_sigterm.py (what a stopped command leaves behind).

Run as ``python -c HELD_IN_BACKUP ARGS`` (the repository's root as the working folder, so
``tests`` imports), with ``T_READY_FD`` and ``T_HOLD_FD`` naming the write end of a pipe the
parent reads and the read end of one it never writes.
"""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import PIPE, Popen

from tests.support.waiting import GUARD

#: The repository's root: the child's working folder, from which ``tests`` imports.
ROOT = Path(__file__).resolve().parents[2]

#: ``hermes-store ARGS`` whose backup stops once its copy is under way (its private file
#: created, SQLite copying into it): the first time the copy's flusher runs (after the first
#: step of the backup API, or from ``VACUUM INTO``'s progress handler), it says so on the
#: ready pipe and waits on the hold pipe, which only a signal (or the parent's end) ends.
HELD_IN_BACKUP = (
    "from tests.support.leftover_workers import cli_held_in_backup\ncli_held_in_backup()"
)


def cli_held_in_backup() -> None:
    """Run ``hermes-store`` (the arguments after ``-c CODE``), held inside its backup's copy
    (see :data:`HELD_IN_BACKUP`)."""
    from hermes_store.cli import main
    from hermes_store.ops import backup

    ready, hold = int(os.environ["T_READY_FD"]), int(os.environ["T_HOLD_FD"])
    flush = backup._Flusher.__call__
    reached: list[bool] = []

    def held(self: backup._Flusher, *args: object) -> int:
        if self.fd >= 0 and not reached:  # the copy's own file is open: the copy runs
            reached.append(True)
            os.write(ready, b"copying\n")
            os.read(hold, 1)  # never written: the signal's handler ends the wait
        return flush(self, *args)

    backup._Flusher.__call__ = held  # type: ignore[method-assign]
    sys.argv[0] = "hermes-store"
    main()


@contextmanager
def held_backup(database: Path, target: Path, method: str = "backup") -> Iterator[Popen[str]]:
    """``hermes-store --db DATABASE backup TARGET --method METHOD`` in a fresh interpreter,
    yielded once it holds inside its copy (its private file beside ``target``); killed on the
    way out if the caller did not end it (with a signal, then ``communicate``)."""
    ready_read, ready_write = os.pipe()
    hold_read, hold_write = os.pipe()
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "COLUMNS")}
        child = Popen(
            [
                sys.executable,
                "-c",
                HELD_IN_BACKUP,
                "--db",
                str(database),
                "backup",
                str(target),
                "--method",
                method,
            ],
            env=env | {"T_READY_FD": str(ready_write), "T_HOLD_FD": str(hold_read)},
            cwd=ROOT,
            pass_fds=(ready_write, hold_read),
            stdout=PIPE,
            stderr=PIPE,
            text=True,
        )
        os.close(ready_write)
        os.close(hold_read)
        try:
            readable, _, _ = select.select([ready_read], [], [], GUARD)
            assert readable, "timed out waiting for the backup to reach its copy"
            said = os.read(ready_read, 64)
            assert said == b"copying\n", (said, child.communicate(timeout=GUARD))
            yield child
        finally:
            if child.poll() is None:
                child.kill()
            if child.stdout is not None and not child.stdout.closed:  # not read by the caller
                child.communicate(timeout=GUARD)
    finally:
        os.close(ready_read)
        os.close(hold_write)
