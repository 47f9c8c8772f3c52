"""``hermes-store``: manage a Hermes state database from the shell.

The database is ``--db PATH|URL``, else ``HERMES_STORE_URL``, else ``$HERMES_HOME/state.db``
(``~/.hermes/state.db``). Exit codes a script can rely on:

* 0: done;
* 1: the command ran and the answer is "no": ``doctor`` found a problem, ``db check`` found
  drift, a session was not found, an input was refused (a title in use, a bad import line),
  a confirmation was declined or could not be asked (no terminal and no ``--yes``);
* 2: usage error (unknown option, bad argument, unknown revision, malformed or unsupported
  database URL);
* 3: the database could not be used (missing, not a database, schema too new, locked,
  read-only, server unreachable, driver not installed); one line on stderr, never a traceback.

One module per command group (``db``, ``sessions``, ``search``, ``transfer``: export and
import, ``backup``: backup and restore, ``stats``, ``doctor``), each a thin layer over the
library; ``app`` holds the group, the exit codes, confirmations and the error boundary,
``output`` the formats. Only click is
imported up front: every command imports what it needs when it runs.
"""

from __future__ import annotations

from hermes_store.cli import backup, db, doctor, query, search, sessions, stats, transfer
from hermes_store.cli.app import (
    EXIT_DATABASE,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    App,
    cli,
    main,
)

for _command in (
    db.db,
    sessions.sessions,
    search.search,
    query.query,
    transfer.export,
    transfer.import_,
    backup.backup_cmd,
    backup.restore_cmd,
    stats.stats,
    doctor.doctor,
):
    cli.add_command(_command)

__all__ = ["EXIT_DATABASE", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "App", "cli", "main"]
