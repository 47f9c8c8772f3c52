"""The ``hermes-store`` group: the database option, exit codes, confirmations and the one error
boundary that turns every error into one line on stderr and a documented exit code.

Only click is imported here: SQLAlchemy, Alembic and rich load when a command needs them, so
``--help`` starts fast.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from hermes_store.cli.streams import is_terminal
from hermes_store.echo import echoed, one_line

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from hermes_store.store import SessionDB
    from hermes_store.uow.retry import RetryPolicy

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_DATABASE = 3
#: Ended by Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130
#: Ended by SIGTERM (128 + SIGTERM): what systemd, ``timeout`` and ``kill`` send to stop it.
EXIT_TERMINATED = 143

#: The largest count an option takes: the store's integers are 64-bit.
INT64_MAX = 2**63 - 1

#: Backends the store runs on; any other URL is refused as a usage error before connecting.
SUPPORTED_BACKENDS = ("sqlite", "postgresql")
F = TypeVar("F", bound=Callable[..., Any])


class Problem(click.ClickException):
    """Exit 1: not found, refused, declined, or a check that failed."""

    exit_code = EXIT_PROBLEM


class DatabaseProblem(click.ClickException):
    """Exit 3: the database could not be used."""

    exit_code = EXIT_DATABASE


class BadArgument(click.ClickException):
    """Exit 2 without click's usage banner (an unknown revision, a bad URL)."""

    exit_code = EXIT_USAGE


class FiniteFloat(click.FloatRange):
    """A :class:`click.FloatRange` that also refuses NaN (click's range lets it through) and
    the infinities, and a value that stops being finite times ``scale`` (days as seconds):
    the API refuses them, so the CLI refuses them as usage errors (exit 2) before any work."""

    name = "finite float"

    def __init__(self, min: float | None = None, *, scale: float = 1.0) -> None:
        super().__init__(min=min)
        self.scale = scale

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{echoed(value)} is not a finite number.", param, ctx)
        if not math.isfinite(number * self.scale):
            self.fail(f"{echoed(value)} is too large.", param, ctx)
        return number


def stderr_is_terminal() -> bool:
    return is_terminal(sys.stderr)


def echo_err(text: str) -> None:
    click.echo(text, err=True)


def boundary_error(error: Exception) -> click.ClickException | None:
    """The one-line CLI error for an exception a command let escape, or None to re-raise.

    The package's own errors keep their message: ``ValueError`` subclasses (unknown session,
    title in use, bad input) exit 1, the rest (locked, not a database, too new) exit 3. Driver
    errors are first mapped onto the package's errors by :func:`hermes_store.errors.translate`.
    """
    if isinstance(error, click.ClickException | click.exceptions.Exit | click.Abort):
        return None
    if isinstance(error, BrokenPipeError):
        return None
    from hermes_store.errors import HermesStoreError  # imports SQLAlchemy: only on errors

    if isinstance(error, HermesStoreError):
        message = one_line(error.cli_message or error)
        if isinstance(error, ValueError):
            return Problem(message)
        return DatabaseProblem(message)
    if isinstance(error, ImportError):  # an optional dependency that is not installed
        from hermes_store.errors import missing_extra

        named = missing_extra(error)
        return DatabaseProblem(
            one_line(named) if named is not None else f"a module is missing ({one_line(error)})"
        )
    from alembic.util import CommandError
    from sqlalchemy import exc as sa_exc

    from hermes_store.errors import translate

    if isinstance(error, sa_exc.ArgumentError):
        return BadArgument(f"--db: {one_line(error)}")
    if isinstance(error, sa_exc.DBAPIError):
        mapped = translate(error)
        if mapped is not None:
            return boundary_error(mapped)
        return DatabaseProblem(f"database error: {one_line(error.orig)}")
    if isinstance(error, CommandError):
        return BadArgument(one_line(error))
    if isinstance(error, OSError):
        if error.filename is None and error.errno in _FULL:  # a write of the output, no file
            return DatabaseProblem(output_failed(error))
        # the database's folder cannot be made, read or written
        where = f": {error.filename}" if error.filename else ""
        return DatabaseProblem(f"{error.strerror or error}{where}")
    return None


#: A device or quota that took no more: what a failed write of the output (``>/dev/full``) says.
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def output_failed(error: OSError) -> str:
    """The one line for output that could not be written (stdout on a full device): not the
    database, which is what exit 3's other causes are about."""
    return f"could not write the output: {error.strerror or error}"


class HermesGroup(click.Group):
    """The error boundary: every error of a subcommand becomes one line and an exit code."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        """Parsing runs the eager options, which print (``--help``, ``--version``) before any
        command is invoked: a failed write of theirs (stdout on a full disk, a reader gone)
        meets the same boundary as a command's, not click's traceback."""
        with _error_boundary(None):
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _error_boundary(ctx):
            return super().invoke(ctx)


@contextlib.contextmanager
def _error_boundary(ctx: click.Context | None) -> Iterator[None]:
    """Every error of the block becomes one line and an exit code (``ctx``: the command's
    context, which knows what an interrupted command had written; None while parsing)."""
    try:
        yield
    except KeyboardInterrupt:
        app = ctx.find_object(App) if ctx is not None else None
        landed = app.landed() if app is not None and app.landed is not None else None
        echo_err(f"{_stopped_by()}. {landed or 'Nothing was written.'}")
        raise click.exceptions.Exit(_interrupted_exit_code()) from None
    except BrokenPipeError:
        # A reader that stopped early (``| head``) is not an error: end quietly, and point
        # stdout at /dev/null so the interpreter's last flush cannot complain either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise click.exceptions.Exit(EXIT_OK) from None
    except Exception as error:
        mapped = boundary_error(error)
        if mapped is None:
            raise
        raise mapped from error


class App:
    """What every command shares: the target (resolved on first use), the output streams, the
    terminal facts, and a lazily opened store."""

    def __init__(self, db: str | None) -> None:
        self._db = db
        self._url: URL | None = None
        self._store: SessionDB | None = None
        self._lock_notice: LockWaitNotice | None = None
        #: What a command has committed so far, said when Ctrl-C stops it (None: nothing).
        self.landed: Callable[[], str | None] | None = None

    @property
    def url(self) -> URL:
        """``--db``, else ``HERMES_STORE_URL``, else the default file; refused (exit 2) when the
        URL is malformed or names a backend the store does not run on."""
        if self._url is None:
            from hermes_store.engine.factory import display_url, to_url, url_from_environment

            if self._db is not None and not self._db.strip():
                raise BadArgument(
                    "--db is empty: give a SQLite path or a database URL (leave the option "
                    "out for the default database)"
                )
            origin = (
                "--db"
                if self._db
                else "HERMES_STORE_URL"
                if os.environ.get("HERMES_STORE_URL")
                else "HERMES_HOME"
                if os.environ.get("HERMES_HOME")
                else "the default database"
            )
            try:
                url = to_url(self._db) if self._db else url_from_environment()
                backend = url.get_backend_name()
            except ValueError as error:  # a non-numeric port, a malformed URL
                raise BadArgument(f"{origin}: {one_line(error)}") from error
            if backend not in SUPPORTED_BACKENDS:
                shown = display_url(url)
                raise BadArgument(
                    f"{origin}: unsupported database {shown!r}: use a SQLite path or "
                    "sqlite:/// URL, or a postgresql:// URL"
                )
            self._url = url
        return self._url

    @property
    def where(self) -> str:
        from hermes_store.engine.factory import display_url, sqlite_file

        path = sqlite_file(self.url)
        return str(path) if path is not None else display_url(self.url)

    def new_file(self) -> Path | None:
        """The SQLite file ``--db`` names when nothing is there yet (not even a link), for
        commands that build a new database whole; None otherwise."""
        from hermes_store.engine.factory import sqlite_file

        path = sqlite_file(self.url)
        if path is None or self.url.query or os.path.lexists(path):
            return None
        return path

    def store(self, *, create: bool = False, read_only: bool = False) -> SessionDB:
        """The store (opening brings the schema to head); a missing file is an error unless
        ``create``, so a typo in ``--db`` never leaves an empty database behind. Commands that
        only read open it with ``migrate="check"``: a database behind head is refused with the
        command to run, never upgraded behind the user's back."""
        if self._store is None:
            from hermes_store.engine.factory import sqlite_file
            from hermes_store.errors import NotADatabaseError
            from hermes_store.store import SessionDB

            path = sqlite_file(self.url)
            if path is not None and not create and not path.exists():
                raise NotADatabaseError(
                    f"there is no database at {path} (`hermes-store db upgrade` creates one)"
                )
            self._store = SessionDB(
                self.url, migrate="check" if read_only else "auto", retry=retry_from_environment()
            )
            if path is not None and not read_only and stderr_is_terminal():
                self._lock_notice = LockWaitNotice(path)
        return self._store

    def close(self) -> None:
        if self._lock_notice is not None:
            self._lock_notice.stop()
            self._lock_notice = None
        if self._store is not None:
            self._store.close()
            self._store = None


#: Seconds a command waits for a PostgreSQL server it cannot reach (at open and in each call)
#: before it exits 3; unset: the store's default (``RetryPolicy.unavailable_timeout``).
UNAVAILABLE_TIMEOUT_ENV = "HERMES_STORE_UNAVAILABLE_TIMEOUT"


def retry_from_environment() -> RetryPolicy | None:
    """The store's retry policy with ``$HERMES_STORE_UNAVAILABLE_TIMEOUT`` seconds of patience
    for an unreachable server (a cron job during a failover waits longer, a person at a
    terminal may want less); None when it is not set. A bad value is a usage error."""
    raw = os.environ.get(UNAVAILABLE_TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    from hermes_store.uow.retry import RetryPolicy

    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise BadArgument(f"{UNAVAILABLE_TIMEOUT_ENV}={echoed(raw)}: give a number of seconds >= 0")
    return RetryPolicy(unavailable_timeout=seconds)


class LockWaitNotice:
    """On a terminal, say once when another process has held the database's write lock for
    a second while this command runs (a write then waits for it, up to its bounded wait),
    and who holds it: a silent 20-second wait looks like a hang."""

    def __init__(self, path: Path, *, after: float = 1.0, every: float = 0.25) -> None:
        self._path = path
        self._after = after
        self._every = every
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hermes-lock-notice", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from hermes_store.engine.files import write_lock_holders

        held_since: float | None = None
        while not self._stopped.wait(self._every):
            holders = write_lock_holders(self._path)
            if not holders:
                held_since = None
                continue
            now = time.monotonic()
            held_since = now if held_since is None else held_since
            if now - held_since >= self._after:
                named = ", ".join(f"process {pid} ({command[:60]})" for pid, command in holders)
                echo_err(
                    f"Waiting for the write lock of {self._path}: held by {named}. "
                    "(The wait is bounded; Ctrl-C stops.)"
                )
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


pass_app = click.make_pass_decorator(App)


#: How many of the newest sessions' ids the shell completes.
COMPLETED_SESSIONS = 50


def complete_session(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of a session reference: the ids of the newest sessions (with their
    titles as help) that start with what was typed. The database is --db's, else the
    default; one that cannot be opened completes nothing (completion must never print)."""
    from click.shell_completion import CompletionItem

    from hermes_store.errors import HermesStoreError

    app = App(ctx.find_root().params.get("db"))
    try:
        rows = app.store(read_only=True).list_sessions_rich(
            limit=COMPLETED_SESSIONS, include_children=True
        )
    except (HermesStoreError, click.ClickException, OSError) as error:
        logging.getLogger(__name__).debug("no session completion: %s", error)
        return []
    finally:
        app.close()
    return [
        CompletionItem(row["id"], help=row.get("title") or None)
        for row in rows
        if row["id"].startswith(incomplete)
    ]


def resolve_session(db: SessionDB, ref: str) -> str:
    """A session id from an exact id, an exact title, a unique id prefix or a title lineage."""
    if db.get_session(ref) is not None:
        return ref
    row = db.get_session_by_title(ref)
    if row is not None:
        return str(row["id"])
    found = db.resolve_session_id(ref) or db.resolve_session_by_title(ref)
    if found is None:
        raise Problem(f"no single session matches {echoed(ref)} (by id, id prefix or title)")
    return found


def sources_option(
    help_text: str = "Only sessions of this source (repeatable).",
) -> Callable[[F], F]:
    """``--source``, repeatable everywhere: each value adds a source."""
    return click.option("--source", "sources", multiple=True, metavar="SOURCE", help=help_text)


def stdin_is_terminal() -> bool:
    return is_terminal(sys.stdin)


def confirm(question: str, *, yes: bool, what: str) -> None:
    """Ask ``question`` on the terminal unless ``--yes``; without a terminal, refuse (exit 1):
    a cron job or a pipe must say ``--yes`` rather than delete on a stray ``y`` in its input."""
    if yes:
        return
    if not stdin_is_terminal():
        raise Problem(f"refusing to {what} without confirmation: pass --yes (no terminal to ask)")
    if not click.confirm(question, default=False, err=True):
        raise Problem("declined: nothing was changed")


yes_option = click.option(
    "--yes", "-y", is_flag=True, help="Do not ask for confirmation (needed without a terminal)."
)


@click.group(
    cls=HermesGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--db",
    "db",
    metavar="PATH|URL",
    help="SQLite file or SQLAlchemy URL. Default: $HERMES_STORE_URL, else $HERMES_HOME/state.db.",
)
@click.option(
    "--schema",
    metavar="NAME",
    help="PostgreSQL schema holding the tables, beside an application's own. "
    "Default: $HERMES_STORE_SCHEMA, else the database's default.",
)
@click.option(
    "--version-table",
    metavar="NAME",
    help="Name of the Alembic version table. "
    "Default: $HERMES_STORE_VERSION_TABLE, else alembic_version.",
)
@click.option(
    "--no-pager",
    is_flag=True,
    help="Print long output straight to the terminal (default: through $PAGER, else less).",
)
@click.version_option(package_name="hermes-store", prog_name="hermes-store")
@click.pass_context
def cli(
    ctx: click.Context,
    db: str | None,
    schema: str | None,
    version_table: str | None,
    no_pager: bool,
) -> None:
    """Manage a Hermes session database: migrations, sessions, search, export and health.

    \b
    Examples:
      hermes-store db upgrade
      hermes-store sessions list | grep -i deploy
      hermes-store --db postgresql://hermes@localhost/hermes stats
      hermes-store sessions prune --older-than 90 --yes    # from cron

    \b
    Exit codes: 0 done; 1 the answer is no (a problem found, not found,
    refused, declined); 2 usage error; 3 the database could not be used.
    """
    app = App(db)
    ctx.obj = app
    ctx.call_on_close(app.close)
    from hermes_store.cli import output

    output.pager_off = no_pager
    if schema is not None or version_table is not None:
        from hermes_store.engine import placement  # only then: --help stays free of SQLAlchemy

        try:
            where = placement.Placement.resolve(schema, version_table)
        except ValueError as error:  # InvalidInputError: a usage error here
            raise BadArgument(one_line(error)) from error
        ctx.with_resource(placement.using(where))


def _tolerant_streams() -> None:
    """A terminal or pipe whose encoding cannot show a character gets a replacement, never a
    traceback (a CJK title on a latin-1 terminal)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        encoding = (getattr(stream, "encoding", "") or "").lower().replace("-", "")
        if reconfigure is not None and encoding != "utf8":
            reconfigure(errors="replace")


def _closed_streams_to_devnull() -> None:
    """A standard stream the caller closed (``>&-``, ``<&-``, ``2>&-``) becomes /dev/null:
    reading it finds nothing and what is written to it is dropped, as if the caller had said
    ``>/dev/null``. Python leaves such a stream None, which ``print`` and ``click.echo``
    tolerate but every other use of it does not (a traceback); and its free descriptor would go
    to the next file this process opens, where a stray write to fd 1 or 2 would land."""
    for name, flags in (("stdin", os.O_RDONLY), ("stdout", os.O_WRONLY), ("stderr", os.O_WRONLY)):
        if getattr(sys, name) is not None:
            continue
        fd = os.open(os.devnull, flags)  # the lowest free descriptor: the closed one itself
        if fd <= 2:  # a standard descriptor again, which a child process (the pager) inherits
            os.set_inheritable(fd, True)
        mode = "r" if flags == os.O_RDONLY else "w"
        # Open for the rest of the process, as Python's own standard streams are.
        setattr(sys, name, open(fd, mode, encoding="utf-8"))  # noqa: SIM115


#: Set once SIGTERM arrived: the interrupt being handled is a stop request, exit 143.
_terminated = threading.Event()


def _on_sigterm(_signum: int, _frame: object) -> None:
    """SIGTERM (systemd's stop, ``timeout``, ``kill``) stops the command as Ctrl-C does: the
    same exception, so the same cleanup runs (a backup's or an import's private file removed,
    FTS5's merge settings put back, the transaction in progress rolled back) and the command
    says what it had committed; remembered, so that it exits 143 rather than 130. Remembered
    first: where the driver swallows the exception (SQLite's progress handler turns it into
    "interrupted", raised again as ``KeyboardInterrupt``) the exit code is still right."""
    _terminated.set()
    raise KeyboardInterrupt


def _stop_on_sigterm() -> None:
    """Install :func:`_on_sigterm` for this process, from the main thread only (Python runs
    signal handlers there) and only where SIGTERM has its default action: a caller that
    ignores it or handles it itself keeps its choice."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _on_sigterm)


def _stopped_by() -> str:
    """How an interrupted command's last line starts: "Interrupted" (Ctrl-C) or "Terminated"."""
    return "Terminated" if _terminated.is_set() else "Interrupted"


def _interrupted_exit_code() -> int:
    return EXIT_TERMINATED if _terminated.is_set() else EXIT_INTERRUPTED


def main() -> None:
    """Console-script entry point (``hermes-store`` and ``python -m hermes_store``)."""
    _stop_on_sigterm()
    _closed_streams_to_devnull()
    _tolerant_streams()
    code: int | str | None = EXIT_OK
    try:
        cli(prog_name="hermes-store")
    except SystemExit as done:
        code = done.code
    except KeyboardInterrupt:
        if not _terminated.is_set():
            raise  # Ctrl-C outside the error boundary: Python's own behaviour, as before
        # SIGTERM as click started or ended, outside the boundary: still a clean stop.
        echo_err("Terminated.")
        code = EXIT_TERMINATED
    failed = _unflushed_output()
    if failed is not None and code in (None, EXIT_OK):
        echo_err(f"Error: {output_failed(failed)}")
        code = EXIT_DATABASE  # as the error boundary says a failed write of the output
    raise SystemExit(code)


def _unflushed_output() -> OSError | None:
    """Flush stdout; what it could not write (a full device) is dropped, pointing it at
    /dev/null, so the interpreter's own last flush cannot fail once more ("Exception
    ignored", exit 120, whatever the command said). The error, for the caller to tell."""
    try:
        sys.stdout.flush()
    except ValueError:  # closed by the command itself (an export to "-"): nothing is left
        return None
    except OSError as error:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
        return error
    return None
