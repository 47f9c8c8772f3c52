"""The command line in a fresh interpreter, for tests that need a real process (a terminal,
signals, another process's lock)."""

from __future__ import annotations

#: ``python -c RUN_CLI ARGS`` runs ``hermes-store ARGS`` in a fresh interpreter.
RUN_CLI = "import sys\nfrom hermes_store.cli import main\nsys.argv[0] = 'hermes-store'\nmain()"
