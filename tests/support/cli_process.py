"""The command line in a fresh interpreter, for tests that need a real process (a terminal,
signals, another process's lock)."""

from __future__ import annotations

#: ``python -c RUN_CLI ARGS`` runs ``hermes-store ARGS`` in a fresh interpreter.
RUN_CLI = "import sys\nfrom hermes_store.cli import main\nsys.argv[0] = 'hermes-store'\nmain()"


def read_terminal(leader: int) -> bytes:
    """Everything a child wrote to the pty whose ``leader`` end this is, until it closed its
    end (Linux then says EIO); the leader is closed after."""
    import os

    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    return shown
