"""``hermes-store``: manage a Hermes state database from the shell (click + rich).

The database is ``--db PATH|URL``, else ``HERMES_STORE_URL``, else ``$HERMES_HOME/state.db``
(``~/.hermes/state.db``). Exit codes a script can rely on:

* 0: done;
* 1: the command ran and the answer is "no": ``doctor`` found a problem, ``db check`` found
  drift, a session was not found, an input was refused (a title in use, a bad import line);
* 2: usage error (unknown option, bad argument, unknown revision);
* 3: the database could not be used (missing, not a database, schema too new, locked,
  read-only, server unreachable); one line on stderr, never a traceback.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Literal

import click
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text
from sqlalchemy import bindparam, func, select, update
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import NullPool

from hermes_store import analytics, ddl, files, migrate
from hermes_store import search as search_index
from hermes_store.engine import create_engine, sqlite_file, to_url, url_from_environment
from hermes_store.errors import (
    HermesStoreError,
    InvalidInputError,
    NotADatabaseError,
    mapped_errors,
    translate,
)
from hermes_store.models import messages_table as M
from hermes_store.models import sessions_table as S
from hermes_store.store import SessionDB

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_DATABASE = 3

RowDict = dict[str, Any]


# -- errors ------------------------------------------------------------------------------------


class Problem(click.ClickException):
    """Exit 1: not found, refused, or a check that failed."""

    exit_code = EXIT_PROBLEM


class DatabaseProblem(click.ClickException):
    """Exit 3: the database could not be used."""

    exit_code = EXIT_DATABASE


class BadArgument(click.ClickException):
    """Exit 2 without click's usage banner (e.g. an unknown revision)."""

    exit_code = EXIT_USAGE


class ImportCheckError(HermesStoreError):
    """A batch did not land as prepared (rolled back): the database disagrees with the file."""


def _one_line(error: object) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return first if len(first) <= 500 else first[:497] + "..."


class HermesGroup(click.Group):
    """Turns the package's errors into one line on stderr and a stable exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ValueError as error:
            if isinstance(error, HermesStoreError):  # unknown session, title in use, bad input
                raise Problem(_one_line(error)) from error
            raise
        except HermesStoreError as error:
            raise DatabaseProblem(_one_line(error)) from error
        except sa.exc.ArgumentError as error:
            raise click.BadParameter(_one_line(error), param_hint="'--db'") from error
        except sa.exc.DBAPIError as error:
            mapped = translate(error)
            message = _one_line(mapped) if mapped else f"database error: {_one_line(error.orig)}"
            raise DatabaseProblem(message) from error
        except CommandError as error:
            raise BadArgument(_one_line(error)) from error
        except OSError as error:  # the database's folder cannot be made, read or written
            if isinstance(error, BrokenPipeError):
                raise
            where = f": {error.filename}" if error.filename else ""
            raise DatabaseProblem(f"{error.strerror or error}{where}") from error


# -- the application object --------------------------------------------------------------------


@dataclass
class App:
    """What every command shares: the target URL, the consoles, and a lazily opened store."""

    url: URL
    out: Console = field(default_factory=lambda: Console(soft_wrap=True, highlight=False))
    err: Console = field(
        default_factory=lambda: Console(stderr=True, soft_wrap=True, highlight=False)
    )
    _store: SessionDB | None = None

    @property
    def where(self) -> str:
        path = sqlite_file(self.url)
        return str(path) if path is not None else self.url.render_as_string(hide_password=True)

    def store(self, *, create: bool = False) -> SessionDB:
        """The store (opening brings the schema to head); a missing file is an error unless
        ``create``, so a typo in ``--db`` never leaves an empty database behind."""
        if self._store is None:
            path = sqlite_file(self.url)
            if path is not None and not create and not path.exists():
                raise NotADatabaseError(
                    f"there is no database at {path} (`hermes-store db upgrade` creates one)"
                )
            self._store = SessionDB(self.url)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


pass_app = click.make_pass_decorator(App)


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, ensure_ascii=False, indent=2))


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")


@click.group(cls=HermesGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    "db",
    metavar="PATH|URL",
    help="SQLite file or SQLAlchemy URL. Default: $HERMES_STORE_URL, else $HERMES_HOME/state.db.",
)
@click.version_option(package_name="hermes-store", prog_name="hermes-store")
@click.pass_context
def cli(ctx: click.Context, db: str | None) -> None:
    """Manage a Hermes session database: migrations, sessions, search, export and health."""
    app = App(to_url(db) if db else url_from_environment())
    ctx.obj = app
    ctx.call_on_close(app.close)


def main() -> None:
    """Console-script entry point (``hermes-store`` and ``python -m hermes_store``)."""
    cli(prog_name="hermes-store")


# -- formatting helpers ------------------------------------------------------------------------


def _when(ts: float | None, fmt: str = "%Y-%m-%d %H:%M") -> str:
    return datetime.fromtimestamp(ts).strftime(fmt) if ts is not None else "—"


def _num(value: int | None) -> str:
    return f"{value or 0:,}"


def _cost(row: RowDict) -> str:
    """The actual cost when known, else the estimate marked with ``~``."""
    if row.get("actual_cost_usd") is not None:
        return f"${row['actual_cost_usd']:.4f}"
    if row.get("estimated_cost_usd"):
        return f"~${row['estimated_cost_usd']:.4f}"
    return "—"


def _fold(text: str, width: int = 100) -> str:
    """One line of at most ``width`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _highlight(snippet: str) -> Text:
    """A search snippet with its ``>>>match<<<`` markers rendered bold."""
    text = Text()
    rest = snippet
    while ">>>" in rest:
        before, _, after = rest.partition(">>>")
        match, closed, tail = after.partition("<<<")
        if not closed:
            break
        text.append(before)
        text.append(match, style="bold")
        rest = tail
    text.append(rest)
    return text


def _short_ids(ids: list[str], minimum: int = 8) -> dict[str, str]:
    """Each id cut to the shortest prefix (at least ``minimum``) no other listed id shares."""
    ordered = sorted(set(ids))
    short = {}
    for index, session_id in enumerate(ordered):
        neighbours = ordered[max(index - 1, 0) : index] + ordered[index + 1 : index + 2]
        shared = max((len(os.path.commonprefix([session_id, n])) for n in neighbours), default=0)  # noqa: RUF071
        short[session_id] = session_id[: max(minimum, shared + 1)]
    return short


def resolve_session(db: SessionDB, ref: str) -> str:
    """A session id from an exact id, an exact title, a unique id prefix or a title lineage."""
    if db.get_session(ref) is not None:
        return ref
    row = db.get_session_by_title(ref)
    if row is not None:
        return str(row["id"])
    found = db.resolve_session_id(ref) or db.resolve_session_by_title(ref)
    if found is None:
        raise Problem(f"no single session matches {ref!r} (by id, id prefix or title)")
    return found


# -- db ----------------------------------------------------------------------------------------


@cli.group()
def db() -> None:
    """Schema migrations (Alembic); a state.db written by the original store is adopted first."""


def _read_state(url: URL) -> migrate.DatabaseState | None:
    """The database's tables and versions, read without locking (None: no such file)."""
    path = sqlite_file(url)
    if path is not None:
        return migrate.preflight_sqlite(path)
    engine = migrate.read_engine(url)
    try:
        with mapped_errors(), engine.connect() as conn:
            state = migrate.read_state(conn)
    finally:
        engine.dispose()
    migrate.check_adoptable(state, url.render_as_string(hide_password=True))
    return state


def _revision_of(state: migrate.DatabaseState | None) -> str | None:
    if state is None:
        return None
    if state.revision is not None:
        return state.revision
    if state.is_legacy and state.schema_version is not None:
        return migrate.revision_for_version(state.schema_version)
    return None


@db.command("upgrade")
@click.argument("revision", default="head")
@pass_app
def db_upgrade(app: App, revision: str) -> None:
    """Upgrade to REVISION (default: head), creating or adopting the database."""
    before = _read_state(app.url)
    after = migrate.upgrade(app.url, revision)
    if before is not None and before.is_legacy:
        app.out.print(
            f"Adopted {app.where} (schema_version {before.schema_version} of the original store)."
        )
    start = _revision_of(before) or "empty"
    app.out.print(f"{app.where}: {start} -> {after}")


@db.command("downgrade")
@click.argument("revision")
@pass_app
def db_downgrade(app: App, revision: str) -> None:
    """Downgrade to REVISION (``base`` removes every table; columns dropped lose their data)."""
    before = _revision_of(_read_state(app.url))
    after = migrate.downgrade(app.url, revision)
    app.out.print(f"{app.where}: {before or 'empty'} -> {after or 'base'}")


@db.command("current")
@json_option
@pass_app
def db_current(app: App, as_json: bool) -> None:
    """Show the database's revision and schema_version."""
    state = _read_state(app.url)
    revision = _revision_of(state)
    head = migrate.head_revision()
    info = {
        "database": app.where,
        "exists": state is not None and not state.is_empty,
        "revision": revision,
        "schema_version": state.schema_version if state else None,
        "head": head,
        "at_head": revision == head and state is not None and not state.is_legacy,
        "legacy": bool(state and state.is_legacy),
    }
    if as_json:
        _echo_json(info)
        return
    if not info["exists"]:
        app.out.print(f"{app.where}: no schema yet (`hermes-store db upgrade` creates it)")
        return
    note = "(head)" if info["at_head"] else f"(head is {head})"
    if info["legacy"]:
        note = "(legacy file, not adopted yet: `hermes-store db upgrade` adopts it)"
    app.out.print(f"{app.where}: {revision} {note}, schema_version {info['schema_version']}")


@db.command("history")
@pass_app
def db_history(app: App) -> None:
    """List the revisions, oldest first, marking the database's current one."""
    try:
        current = _revision_of(_read_state(app.url))
    except HermesStoreError:
        current = None
    scripts = ScriptDirectory(migrate.script_location())
    head = scripts.get_current_head()
    table = Table("", "revision", "down revision", "description", box=None)
    for script in reversed(list(scripts.walk_revisions())):
        marks = []
        if script.revision == current:
            marks.append("current")
        if script.revision == head:
            marks.append("head")
        description = (script.doc or "").strip().splitlines()[0] if script.doc else ""
        table.add_row(
            "→" if script.revision == current else "",
            script.revision + (f" ({', '.join(marks)})" if marks else ""),
            str(script.down_revision or "—"),
            description,
        )
    app.out.print(table)


@db.command("check")
@pass_app
def db_check(app: App) -> None:
    """Compare the database with the models (alembic check); exit 1 on drift.

    A legacy file is adopted inside a transaction that is rolled back: the file is not changed.
    """
    state = _read_state(app.url)
    if state is None or state.is_empty:
        raise DatabaseProblem(f"there is no schema at {app.where} (`hermes-store db upgrade`)")
    head = migrate.head_revision()
    revision = _revision_of(state)
    # A legacy file at the original store's last version is current for it; this package's
    # own later revisions (the CJK index) are applied in the rolled-back transaction below.
    current_legacy = state.is_legacy and state.schema_version == ddl.HEAD_VERSION
    if revision != head and not current_legacy:
        raise Problem(
            f"{app.where} is at {revision}, head is {head}: run `hermes-store db upgrade`"
        )
    engine = create_engine(app.url, foreign_keys=False, poolclass=NullPool)
    try:
        with mapped_errors(), engine.connect() as conn:
            transaction = conn.begin()
            try:
                migrate.adopt(conn)
                config = migrate.alembic_config(conn)
                config.stdout = io.StringIO()
                if current_legacy:
                    command.upgrade(config, "head")
                command.check(config)
            finally:
                transaction.rollback()
    except CommandError as error:  # AutogenerateDiffsDetected is a CommandError
        raise Problem(f"{app.where} drifted from the models: {_one_line(error)}") from error
    finally:
        engine.dispose()
    app.out.print(f"{app.where}: no drift (at {head})")


# -- sessions ----------------------------------------------------------------------------------


@cli.group()
def sessions() -> None:
    """List, show, rename, delete and prune sessions."""


@sessions.command("list")
@click.option("--source", help="Only sessions of this source (cli, telegram, ...).")
@click.option(
    "--exclude-source", "excluded", multiple=True, help="Leave out a source (repeatable)."
)
@click.option("--children", is_flag=True, help="Include child sessions (subagents, continuations).")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1))
@json_option
@pass_app
def sessions_list(
    app: App,
    source: str | None,
    excluded: tuple[str, ...],
    children: bool,
    limit: int,
    as_json: bool,
) -> None:
    """List sessions, newest first."""
    rows = app.store().list_sessions_rich(
        source=source,
        exclude_sources=list(excluded) or None,
        limit=limit,
        include_children=children,
    )
    if as_json:
        _echo_json(rows)
        return
    table = Table(
        title=f"{len(rows)} session(s) in {app.where}", title_justify="left", box=box.SIMPLE_HEAD
    )
    ids = [row["id"] for row in rows]
    shown = dict(zip(ids, ids, strict=True)) if app.out.width >= 160 else _short_ids(ids)
    table.add_column("id", no_wrap=True)
    table.add_column("title", overflow="fold", max_width=30)
    table.add_column("source")
    table.add_column("model", overflow="fold", max_width=24)
    table.add_column("messages", justify="right")
    table.add_column("tokens in/out", justify="right")
    table.add_column("cost", justify="right")
    table.add_column("last active", no_wrap=True)
    table.add_column("preview", overflow="fold", min_width=12)
    for row in rows:
        table.add_row(
            shown[row["id"]],
            row.get("title") or "—",
            row["source"],
            row.get("model") or "—",
            _num(row.get("message_count")),
            f"{_num(row.get('input_tokens'))}/{_num(row.get('output_tokens'))}",
            _cost(row),
            _when(row.get("last_active")),
            row.get("preview") or "",
        )
    app.out.print(table)


def _tool_call_line(call: Any, full: bool) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict):
        name, arguments = function.get("name", "?"), function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        body = f"{name}({arguments})"
    else:
        body = json.dumps(call, ensure_ascii=False)
    return body if full else _fold(body)


def _render_message(message: RowDict, full: bool) -> Group:
    role = message["role"]
    styles = {"user": "bold cyan", "assistant": "bold green", "tool": "bold magenta"}
    header = Text(role, style=styles.get(role, "bold yellow"))
    if message.get("tool_name"):
        header.append(f" · {message['tool_name']}", style="magenta")
    header.append(f" · {_when(message['timestamp'], '%Y-%m-%d %H:%M:%S')}", style="dim")
    parts: list[Text] = [header]
    reasoning = message.get("reasoning")
    if reasoning:
        body = reasoning if full else _fold(reasoning, 90)
        parts.append(Text(f"  ▸ reasoning ({len(reasoning)} chars): {body}", style="dim italic"))
    for key in ("reasoning_details", "codex_reasoning_items"):
        if message.get(key):
            detail = f": {message[key]}" if full else ""
            parts.append(
                Text(
                    f"  ▸ {key.replace('_', ' ')} ({len(message[key])} chars){detail}", style="dim"
                )
            )
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ([calls] if calls else []):
        parts.append(Text(f"  ▸ tool call {_tool_call_line(call, full)}", style="yellow"))
    content = message.get("content")
    if content:
        if role == "tool" and not full:
            lines = content.count("\n") + 1
            parts.append(Text(f"  ◂ {_fold(content)}  ({lines} lines, {len(content)} chars)"))
        else:
            parts.append(Text(content))
    return Group(*parts, Text(""))


@sessions.command("show")
@click.argument("ref", metavar="ID|PREFIX|TITLE")
@click.option("--full", is_flag=True, help="Unfold reasoning, tool arguments and tool results.")
@json_option
@pass_app
def sessions_show(app: App, ref: str, full: bool, as_json: bool) -> None:
    """Show one conversation (tool calls and reasoning folded to one line each)."""
    store = app.store()
    session_id = resolve_session(store, ref)
    if as_json:
        _echo_json(store.export_session(session_id))
        return
    session = store.get_session(session_id)
    if session is None:
        raise Problem(f"session {session_id} was deleted meanwhile")
    grid = Table.grid(padding=(0, 2))
    grid.add_row("id", session["id"])
    grid.add_row("source / model", f"{session['source']} / {session.get('model') or '—'}")
    if session.get("parent_session_id"):
        grid.add_row("parent", session["parent_session_id"])
    ended = _when(session.get("ended_at"))
    if session.get("end_reason"):
        ended += f" ({session['end_reason']})"
    grid.add_row("started / ended", f"{_when(session['started_at'])} / {ended}")
    grid.add_row(
        "messages / tool calls",
        f"{_num(session.get('message_count'))} / {_num(session.get('tool_call_count'))}",
    )
    grid.add_row(
        "tokens in / out",
        f"{_num(session.get('input_tokens'))} / {_num(session.get('output_tokens'))}"
        f" (cache {_num(session.get('cache_read_tokens'))} read,"
        f" {_num(session.get('cache_write_tokens'))} write;"
        f" reasoning {_num(session.get('reasoning_tokens'))})",
    )
    grid.add_row("cost", _cost(session))
    app.out.print(Panel(grid, title=session.get("title") or session["id"], title_align="left"))
    for message in store.iter_messages(session_id):
        app.out.print(_render_message(message, full))


@sessions.command("rename")
@click.argument("ref", metavar="ID|PREFIX|TITLE")
@click.argument("title")
@pass_app
def sessions_rename(app: App, ref: str, title: str) -> None:
    """Set a session's title (an empty TITLE clears it)."""
    store = app.store()
    session_id = resolve_session(store, ref)
    if not store.set_session_title(session_id, title):
        raise Problem(f"session {session_id} was deleted meanwhile")
    new = store.get_session_title(session_id)
    app.out.print(f"{session_id}: " + (f"title is now {new!r}" if new else "title cleared"))


@sessions.command("delete")
@click.argument("ref", metavar="ID|PREFIX|TITLE")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@pass_app
def sessions_delete(app: App, ref: str, yes: bool) -> None:
    """Delete a session and its messages (its children are kept, unparented)."""
    store = app.store()
    session_id = resolve_session(store, ref)
    session = store.get_session(session_id) or {}
    label = f"{session_id} ({session.get('title') or 'untitled'}, "
    label += f"{_num(session.get('message_count'))} messages)"
    if not yes:
        click.confirm(f"Delete session {label}?", abort=True, err=True)
    if not store.delete_session(session_id):
        raise Problem(f"session {session_id} was deleted meanwhile")
    app.out.print(f"Deleted session {label}.")


@sessions.command("prune")
@click.option(
    "--older-than",
    "days",
    required=True,
    type=click.FloatRange(min=0),
    metavar="DAYS",
    help="Delete ended sessions started more than DAYS days ago.",
)
@click.option("--source", help="Only sessions of this source.")
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@pass_app
def sessions_prune(app: App, days: float, source: str | None, dry_run: bool) -> None:
    """Delete ended sessions older than DAYS (active sessions are never pruned)."""
    store = app.store()
    if not dry_run:
        count = store.prune_sessions(older_than_days=days, source=source)
        app.out.print(f"Deleted {count} session(s) started more than {days:g} days ago.")
        return
    criteria = [S.c.started_at < time.time() - days * 86400, S.c.ended_at.is_not(None)]
    if source is not None:
        criteria.append(S.c.source == source)
    columns = (S.c.id, S.c.title, S.c.source, S.c.started_at, S.c.ended_at, S.c.message_count)
    with store.uow.connect(write=False) as conn:
        rows = conn.execute(select(*columns).where(*criteria).order_by(S.c.started_at)).all()
    table = Table("id", "title", "source", "started", "ended", "messages", box=None)
    for row in rows[:50]:
        table.add_row(
            row.id,
            row.title or "—",
            row.source,
            _when(row.started_at),
            _when(row.ended_at),
            _num(row.message_count),
        )
    if rows:
        app.out.print(table)
    if len(rows) > 50:
        app.out.print(f"... and {len(rows) - 50} more")
    app.out.print(f"Dry run: would delete {len(rows)} session(s); nothing was deleted.")


# -- search ------------------------------------------------------------------------------------


@cli.command()
@click.argument("query")
@click.option("--source", "sources", multiple=True, help="Only this source (repeatable).")
@click.option(
    "--exclude-source", "excluded", multiple=True, help="Leave out a source (repeatable)."
)
@click.option("--role", "roles", multiple=True, help="Only messages of this role (repeatable).")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--sort",
    type=click.Choice(["rank", "newest", "oldest"]),
    default="rank",
    show_default=True,
    help="Best match first, or by time.",
)
@json_option
@pass_app
def search(
    app: App,
    query: str,
    sources: tuple[str, ...],
    excluded: tuple[str, ...],
    roles: tuple[str, ...],
    limit: int,
    sort: str,
    as_json: bool,
) -> None:
    """Full-text search over every message, best match first (or --sort newest/oldest)."""
    hits = app.store().search_messages(
        query,
        source_filter=list(sources) or None,
        exclude_sources=list(excluded) or None,
        role_filter=list(roles) or None,
        limit=limit,
        sort=sort,
    )
    if as_json:
        _echo_json(hits)
        return
    for number, hit in enumerate(hits, 1):
        header = Text(f"{number}. ", style="bold")
        header.append(hit["session_id"], style="cyan")
        header.append(
            f" · {hit['source']} · {hit['role']} · {_when(hit['timestamp'])}", style="dim"
        )
        app.out.print(header)
        snippet = " ".join((hit["snippet"] or "").split())
        app.out.print(Text("   ").append_text(_highlight(snippet)))
    app.out.print(f"{len(hits)} result(s) for {query!r}" if hits else f"No results for {query!r}.")


# -- export / import ---------------------------------------------------------------------------


def _progress(console: Console, *, bytes_: bool = False) -> Progress:
    """A progress bar on stderr, shown only on a terminal (pipes and logs stay clean)."""
    counter = DownloadColumn() if bytes_ else MofNCompleteColumn()
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        counter,
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


@contextmanager
def _output(path: str, database: URL) -> Iterator[IO[str]]:
    """``-`` is stdout; a file is written owner-only (0600) into an unpredictable temp file
    created exclusively beside its final name, and renamed into place when complete.

    The database and its ``-wal``/``-shm`` are never a target: replacing them would destroy
    the store, and even opening them would drop this process's SQLite locks.
    """
    if path == "-":
        yield sys.stdout
        return
    final = Path(path)
    db_file = sqlite_file(database)
    if db_file is not None and final.resolve() in {
        Path(f"{db_file.resolve()}{suffix}") for suffix in ("", *files.SIDECAR_SUFFIXES)
    }:
        raise Problem(f"refusing to export onto the database itself ({final})")
    try:
        fd, partial_name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
    except OSError as error:
        raise click.FileError(path, hint=error.strerror or str(error)) from error
    partial = Path(partial_name)
    try:
        with open(fd, "w", encoding="utf-8", newline="\n") as handle:
            yield handle
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)


@cli.command("export")
@click.option("--session", "session_ref", metavar="ID|PREFIX|TITLE", help="Only this session.")
@click.option("--source", help="Only sessions of this source.")
@click.option(
    "-o",
    "--output",
    required=True,
    metavar="FILE.jsonl",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Where to write ('-': stdout).",
)
@pass_app
def export(app: App, session_ref: str | None, source: str | None, output: str) -> None:
    """Stream sessions to JSON Lines: one session (row and messages) per line, newest first."""
    if session_ref and source:
        raise click.UsageError("--session and --source cannot be combined")
    store = app.store()
    if session_ref:
        session_id = resolve_session(store, session_ref)
        records: Iterable[RowDict] = filter(None, [store.export_session(session_id)])
        total = 1
    else:
        records, total = store.iter_export(source), store.session_count(source)
    count = messages = 0
    with _output(output, app.url) as handle, _progress(app.err) as progress:
        task = progress.add_task("exporting", total=total)
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
            messages += len(record["messages"])
            progress.advance(task)
    app.err.print(f"Exported {count} session(s), {messages} message(s) to {output}.")


@dataclass
class ImportReport:
    """What ``import`` did; every session or message of the file lands in exactly one bucket."""

    sessions: int = 0
    sessions_skipped: int = 0  # the id already exists in the target (or earlier in the file)
    messages: int = 0
    messages_skipped: int = 0  # they belong to a skipped session
    messages_renumbered: int = 0  # the message id was taken: stored under a new id
    titles_cleared: int = 0  # another session of the target holds the title
    parents_missing: int = 0  # the parent session is in neither the file nor the target


@dataclass
class _Prepared:
    session: RowDict
    messages: list[RowDict]
    line: int


@dataclass
class _BatchOutcome:
    report: ImportReport
    linked: set[str]
    new_links: dict[str, str]


_REQUIRED_SESSION = ("id", "source", "started_at")
_REQUIRED_MESSAGE = ("role", "timestamp")
_CHUNK = 500


def _python_types(column: sa.Column[Any]) -> tuple[type, ...]:
    if isinstance(column.type, sa.Integer):
        return (int,)
    if isinstance(column.type, sa.Float | sa.REAL | sa.Numeric):
        return (int, float)
    return (str,)


def _checked(
    record: Any,
    columns: sa.ColumnCollection[str, Any],
    where: str,
    required: tuple[str, ...],
    *,
    extra: frozenset[str] = frozenset(),
    nul_ok: bool,
) -> RowDict:
    """The record as a full column dict, every value type-checked before anything is written."""
    if not isinstance(record, dict):
        raise InvalidInputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = set(record) - set(columns.keys()) - extra
    if unknown:
        raise InvalidInputError(f"{where}: unknown fields {sorted(unknown)}")
    row: RowDict = {}
    for column in columns:
        default = 0 if column.server_default is not None else None  # the counters
        value = record.get(column.name, default)
        if value is None:
            if column.name in required:
                raise InvalidInputError(f"{where}: {column.name} is required")
        else:
            kinds = _python_types(column)
            if isinstance(value, bool) or not isinstance(value, kinds):
                expected = " or ".join(k.__name__ for k in kinds)
                raise InvalidInputError(f"{where}: {column.name} must be {expected}")
            if isinstance(value, str) and not nul_ok and "\x00" in value:
                raise InvalidInputError(f"{where}: {column.name} holds a NUL character")
        row[column.name] = value
    return row


def _prepare(record: Any, line: int, nul_ok: bool) -> _Prepared:
    """Validate one exported session (as :meth:`SessionDB.export_session` writes it)."""
    where = f"line {line}"
    session = _checked(
        record, S.c, where, _REQUIRED_SESSION, extra=frozenset({"messages"}), nul_ok=nul_ok
    )
    raw_messages = record.get("messages") or []
    if not isinstance(raw_messages, list):
        raise InvalidInputError(f"{where}: messages must be a list")
    messages = []
    for index, raw in enumerate(raw_messages):
        if isinstance(raw, dict) and raw.get("tool_calls") is not None:
            # get_messages() decodes tool_calls; store them as JSON text again.
            raw = {**raw, "tool_calls": json.dumps(raw["tool_calls"])}
        message = _checked(raw, M.c, f"{where}, message {index}", _REQUIRED_MESSAGE, nul_ok=nul_ok)
        if message["session_id"] not in (None, session["id"]):
            raise InvalidInputError(f"{where}, message {index}: belongs to another session")
        message["session_id"] = session["id"]
        messages.append(message)
    return _Prepared(session, messages, line)


def _existing(conn: Connection, column: sa.Column[Any], values: Iterable[Any]) -> set[Any]:
    """Which of ``values`` the column already holds (queried in chunks)."""
    values = list(dict.fromkeys(v for v in values if v is not None))
    found: set[Any] = set()
    for start in range(0, len(values), _CHUNK):
        chunk = values[start : start + _CHUNK]
        found.update(conn.scalars(select(column).where(column.in_(chunk))))
    return found


def _write_batch(
    conn: Connection, batch: list[_Prepared], pending: dict[str, str]
) -> _BatchOutcome:
    """One write unit: insert the new sessions and their messages, link parents, check counts.

    Pure with respect to the caller's state (the Unit of Work may run it twice on a lock).
    """
    report = ImportReport()
    taken = _existing(conn, S.c.id, (p.session["id"] for p in batch))
    fresh: list[_Prepared] = []
    for prepared in batch:
        if prepared.session["id"] in taken:
            report.sessions_skipped += 1
            report.messages_skipped += len(prepared.messages)
        else:
            taken.add(prepared.session["id"])
            fresh.append(prepared)
    if not fresh:
        return _BatchOutcome(report, set(), {})

    held_titles = _existing(conn, S.c.title, (p.session["title"] for p in fresh))
    new_links: dict[str, str] = {}
    rows = []
    for prepared in fresh:
        row = dict(prepared.session)
        if row["title"] in held_titles:
            row["title"] = None
            report.titles_cleared += 1
        if row["parent_session_id"] is not None:
            # Parents follow their children in a newest-first file: link once both exist.
            new_links[row["id"]] = row.pop("parent_session_id")
        row["parent_session_id"] = None
        rows.append(row)
    conn.execute(S.insert(), rows)
    report.sessions = len(rows)

    messages = [m for p in fresh for m in p.messages]
    used_ids = _existing(conn, M.c.id, (m["id"] for m in messages))
    keep, renumber = [], []
    for message in messages:
        if message["id"] is None or message["id"] in used_ids:
            renumber.append({k: v for k, v in message.items() if k != "id"})
        else:
            used_ids.add(message["id"])
            keep.append(message)
    if keep:
        conn.execute(M.insert(), keep)
        if conn.dialect.name == "postgresql":
            _advance_message_sequence(conn)
    if renumber:
        conn.execute(M.insert(), renumber)
    report.messages = len(messages)
    report.messages_renumbered = len(renumber) - sum(m["id"] is None for m in messages)

    links = {**pending, **new_links}
    parents = _existing(conn, S.c.id, links.values())
    linked = {child for child, parent in links.items() if parent in parents}
    if linked:
        conn.execute(
            update(S)
            .where(S.c.id == bindparam("child"))
            .values(parent_session_id=bindparam("parent")),
            [{"child": child, "parent": links[child]} for child in linked],
        )

    fresh_ids = [p.session["id"] for p in fresh]
    landed_sessions = landed_messages = 0
    for start in range(0, len(fresh_ids), _CHUNK):
        chunk = fresh_ids[start : start + _CHUNK]
        landed_sessions += conn.scalar(select(func.count()).where(S.c.id.in_(chunk))) or 0
        landed_messages += (
            conn.scalar(select(func.count()).select_from(M).where(M.c.session_id.in_(chunk))) or 0
        )
    if (landed_sessions, landed_messages) != (len(fresh), len(messages)):
        raise ImportCheckError(
            f"batch starting at line {batch[0].line}: expected {len(fresh)} sessions and "
            f"{len(messages)} messages, the database holds {landed_sessions} and "
            f"{landed_messages}; the batch was rolled back"
        )
    return _BatchOutcome(report, linked, new_links)


def _advance_message_sequence(conn: Connection) -> None:
    """Explicit ids bypass PostgreSQL's sequence: move it past them (never backwards)."""
    sequence = conn.scalar(sa.text("SELECT pg_get_serial_sequence('messages', 'id')"))
    if sequence is None:
        return
    last = conn.scalar(sa.text(f"SELECT last_value FROM {sequence}"))  # a quoted name from PG
    top = conn.scalar(select(func.max(M.c.id))) or 0
    conn.execute(
        sa.text("SELECT setval(CAST(:seq AS regclass), :value, true)"),
        {"seq": sequence, "value": max(int(top), int(last or 0))},
    )


def _read_records(handle: IO[bytes], advance: Callable[[int], None]) -> Iterator[tuple[int, Any]]:
    for number, raw in enumerate(handle, 1):
        advance(len(raw))
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InvalidInputError(f"line {number}: not valid JSON ({error})") from error


def import_sessions(
    db: SessionDB,
    records: Iterable[tuple[int, Any]],
    *,
    batch_size: int = 100,
    max_batch_messages: int = 5000,
) -> ImportReport:
    """Restore exported sessions into ``db``: ids, timestamps and counters exactly as exported.

    Each batch is validated first, then written as one unit of work and checked before it
    commits. Sessions whose id exists are skipped (with their messages); a message whose id
    is taken gets a new one. Returns the counts.
    """
    total = ImportReport()
    pending: dict[str, str] = {}
    batch: list[_Prepared] = []
    batch_messages = 0

    def flush() -> None:
        nonlocal batch, batch_messages
        if not batch:
            return
        frozen, links = batch, dict(pending)
        outcome = db.uow.run(lambda conn: _write_batch(conn, frozen, links))
        for child in outcome.linked:
            pending.pop(child, None)
        pending.update({c: p for c, p in outcome.new_links.items() if c not in outcome.linked})
        for name, value in asdict(outcome.report).items():
            setattr(total, name, getattr(total, name) + value)
        batch, batch_messages = [], 0

    for line, record in records:
        prepared = _prepare(record, line, nul_ok=db.is_sqlite)
        batch.append(prepared)
        batch_messages += len(prepared.messages)
        if len(batch) >= batch_size or batch_messages >= max_batch_messages:
            flush()
    flush()
    total.parents_missing = len(pending)
    return total


@cli.command("import")
@click.argument(
    "file", metavar="FILE.jsonl", type=click.Path(exists=True, dir_okay=False, allow_dash=True)
)
@click.option(
    "--batch-size",
    default=100,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Sessions per transaction.",
)
@json_option
@pass_app
def import_(app: App, file: str, batch_size: int, as_json: bool) -> None:
    """Restore an ``export`` file (the database is created if missing; known ids are skipped)."""
    store = app.store(create=True)
    handle: IO[bytes]
    if file == "-":
        handle, size = sys.stdin.buffer, None
    else:
        handle, size = open(file, "rb"), os.path.getsize(file)  # noqa: SIM115 - closed below
    try:
        with _progress(app.err, bytes_=True) as progress:
            task = progress.add_task("importing", total=size)
            report = import_sessions(
                store,
                _read_records(handle, lambda n: progress.advance(task, n)),
                batch_size=batch_size,
            )
    finally:
        if file != "-":
            handle.close()
    if as_json:
        _echo_json(asdict(report))
        return
    app.out.print(
        f"Imported {report.sessions} session(s) and {report.messages} message(s) into {app.where}."
    )
    notes = {
        "sessions_skipped": "session(s) skipped: the id already exists",
        "messages_skipped": "message(s) of skipped sessions not imported",
        "messages_renumbered": "message(s) stored under a new id (the id was taken)",
        "titles_cleared": "title(s) cleared: held by another session",
        "parents_missing": "parent link(s) left empty: the parent is not in the file",
    }
    for name, text in notes.items():
        if getattr(report, name):
            app.out.print(f"  {getattr(report, name)} {text}")


# -- stats -------------------------------------------------------------------------------------


def _usage_table(title: str, key: str, rows: list[RowDict]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(key)
    for name in (
        "sessions",
        "messages",
        "input",
        "output",
        "cache read",
        "cache write",
        "reasoning",
        "est. cost",
        "actual cost",
    ):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(
            str(row[key]) if row[key] is not None else "—",
            *(_num(row[c]) for c in ("sessions", "messages", *analytics.TOKEN_COLUMNS)),
            f"${row['estimated_cost_usd']:.4f}",
            f"${row['actual_cost_usd']:.4f}",
        )
    return table


@cli.command()
@click.option(
    "--days",
    default=30,
    show_default=True,
    type=click.IntRange(min=1),
    help="How many recent UTC days the per-day table covers.",
)
@click.option("--source", help="Only sessions of this source.")
@json_option
@pass_app
def stats(app: App, days: int, source: str | None, as_json: bool) -> None:
    """Sessions, messages, tokens and cost: in total, by model, by source and by day."""
    today = datetime.now(UTC).date()
    since = datetime.combine(today - timedelta(days=days - 1), datetime.min.time(), UTC)
    queries = {
        "totals": analytics.totals(source=source),
        "by_model": analytics.usage_per_model(source=source),
        "by_source": analytics.usage_per_source(source=source),
        "by_day": analytics.usage_per_day(since=since.timestamp(), source=source),
    }
    with app.store().uow.connect(write=False) as conn:
        result = {
            name: [dict(row._mapping) for row in conn.execute(query)]
            for name, query in queries.items()
        }
    report: dict[str, Any] = {"totals": result.pop("totals")[0], **result, "days": days}
    if as_json:
        _echo_json(report)
        return
    totals = report["totals"]
    app.out.print(
        f"{app.where}: {_num(totals['sessions'])} sessions, {_num(totals['messages'])} messages, "
        f"{_num(totals['input_tokens'])} input / {_num(totals['output_tokens'])} output tokens, "
        f"${totals['estimated_cost_usd']:.4f} estimated / ${totals['actual_cost_usd']:.4f} actual"
    )
    app.out.print(_usage_table("By model", "model", report["by_model"]))
    app.out.print(_usage_table("By source", "source", report["by_source"]))
    app.out.print(_usage_table(f"By day (UTC, last {days} days)", "day", report["by_day"]))


# -- doctor ------------------------------------------------------------------------------------

Status = Literal["ok", "info", "warn", "error"]
WAL_WARN_BYTES = 64 * 1024 * 1024


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: Status
    detail: str


def _schema_check(state: migrate.DatabaseState) -> Check:
    head = migrate.head_revision()
    revision = _revision_of(state)
    version = state.schema_version
    if state.is_legacy:
        return Check(
            "schema",
            "error",
            f"legacy file at schema_version {version}, not adopted: run `hermes-store db upgrade`",
        )
    if revision == head and version == ddl.HEAD_VERSION:
        return Check("schema", "ok", f"{revision} (head), schema_version {version}")
    return Check(
        "schema",
        "error",
        f"at {revision} (schema_version {version}), head is {head}: run `hermes-store db upgrade`",
    )


def _sqlite_checks(conn: Connection, path: Path) -> list[Check]:
    checks = []
    mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
    checks.append(
        Check(
            "journal mode",
            "ok" if mode == "wal" else "warn",
            str(mode) + ("" if mode == "wal" else " (the store expects WAL)"),
        )
    )
    wal = Path(f"{path}-wal")
    size = wal.stat().st_size if wal.exists() else 0
    checks.append(
        Check(
            "WAL size",
            "warn" if size > WAL_WARN_BYTES else "info",
            f"{size:,} bytes"
            + (" (a long reader blocks checkpoints?)" if size > WAL_WARN_BYTES else ""),
        )
    )
    checks.append(_wal_file_check(path, str(mode)))
    problems = [row[0] for row in conn.exec_driver_sql("PRAGMA integrity_check")]
    ok = problems == ["ok"]
    checks.append(Check("integrity_check", "ok" if ok else "error", "; ".join(problems[:3])))
    return checks


def _wal_file_check(path: Path, mode: str) -> Check:
    """Run while the doctor's own connection is open: the WAL must exist, and no process may
    still be writing into one that was unlinked (it lost its locks; its commits will vanish)."""
    name = "WAL file"
    holders = files.deleted_wal_holders(path)
    if holders:
        who = "; ".join(f"pid {pid} ({command})" for pid, command in holders)
        return Check(
            name,
            "error",
            f"{who} writes into a deleted WAL: its commits since then are invisible to other "
            "processes and are lost when it exits; stop it and check what closed a file "
            "handle on the database",
        )
    if mode == "wal" and not Path(f"{path}-wal").exists():
        return Check(name, "warn", "missing although the database is open in WAL mode")
    return Check(name, "ok", "present, used by no process that lost its locks")


def _postgresql_checks(conn: Connection) -> list[Check]:
    version = conn.exec_driver_sql("SHOW server_version").scalar()
    trigram = conn.scalar(sa.text("SELECT to_regclass(:name)"), {"name": ddl.PG_TRGM_INDEX})
    return [
        Check("server", "info", f"PostgreSQL {version}"),
        Check(
            "substring index",
            "ok" if trigram else "warn",
            f"{ddl.PG_TRGM_INDEX} " + ("present" if trigram else "missing: CJK search scans"),
        ),
    ]


def _index_check(conn: Connection) -> Check:
    """The full-text index is complete and in step with ``messages`` (see search.check_index)."""
    name = "full-text index"
    if conn.dialect.name == "sqlite":
        found = conn.scalars(
            sa.text(
                "SELECT name FROM sqlite_master "
                "WHERE name = :t OR (type = 'trigger' AND tbl_name = 'messages')"
            ),
            {"t": ddl.FTS_TABLE},
        )
        missing = sorted({ddl.FTS_TABLE, *ddl.FTS_TRIGGERS} - set(found))
        if missing:
            return Check(name, "error", f"missing {', '.join(missing)}: search will miss messages")
    try:
        ok = search_index.check_index(conn)
    finally:
        conn.rollback()  # SQLite's integrity-check writes nothing but holds the write lock
    if ok:
        return Check(name, "ok", "in step with messages")
    return Check(
        name, "error", "does not match messages: run `hermes-store doctor --rebuild-index`"
    )


def _row_checks(conn: Connection) -> list[Check]:
    orphan_messages = (
        conn.scalar(
            select(func.count())
            .select_from(M)
            .where(~select(S.c.id).where(S.c.id == M.c.session_id).exists())
        )
        or 0
    )
    parent = S.alias("parent")
    orphan_sessions = (
        conn.scalar(
            select(func.count())
            .select_from(S)
            .where(
                S.c.parent_session_id.is_not(None),
                ~select(parent.c.id).where(parent.c.id == S.c.parent_session_id).exists(),
            )
        )
        or 0
    )
    actual = select(func.count()).where(M.c.session_id == S.c.id).scalar_subquery()
    drifted = (
        conn.scalar(
            select(func.count()).select_from(S).where(func.coalesce(S.c.message_count, 0) != actual)
        )
        or 0
    )
    return [
        Check(
            "orphan messages",
            "error" if orphan_messages else "ok",
            f"{orphan_messages} message(s) whose session is gone",
        ),
        Check(
            "orphan sessions",
            "error" if orphan_sessions else "ok",
            f"{orphan_sessions} session(s) whose parent is gone",
        ),
        Check(
            "message counters",
            "warn" if drifted else "ok",
            f"{drifted} session(s) whose message_count differs from their messages",
        ),
    ]


def run_doctor(url: URL) -> list[Check]:
    """Every health check of ``url``, reading only (no migration, nothing written)."""
    try:
        state = _read_state(url)
    except HermesStoreError as error:
        return [Check("database", "error", _one_line(error))]
    if state is None or state.is_empty:
        return [Check("database", "error", "no schema yet: run `hermes-store db upgrade`")]
    checks = [_schema_check(state)]
    if not {"sessions", "messages"} <= state.tables:
        return checks
    engine = migrate.read_engine(url)
    path = sqlite_file(url)
    try:
        with mapped_errors(), engine.connect() as conn:
            if path is not None:
                checks += _sqlite_checks(conn, path)
            else:
                checks += _postgresql_checks(conn)
            checks.append(_index_check(conn))
            checks += _row_checks(conn)
    finally:
        engine.dispose()
    return checks


@cli.command()
@click.option(
    "--rebuild-index", is_flag=True, help="Rebuild the full-text index first (then check)."
)
@json_option
@pass_app
def doctor(app: App, rebuild_index: bool, as_json: bool) -> None:
    """Check schema, journal, integrity, full-text index and orphan rows; exit 1 on a problem."""
    if rebuild_index:
        state = _read_state(app.url)
        if state is None or state.is_empty:
            raise DatabaseProblem(f"there is no schema at {app.where} (`hermes-store db upgrade`)")
        with migrate.migration_connection(app.url) as conn:
            search_index.rebuild_index(conn)
        app.err.print("Rebuilt the full-text index.")
    checks = run_doctor(app.url)
    healthy = all(c.status != "error" for c in checks)
    if as_json:
        _echo_json({"database": app.where, "ok": healthy, "checks": [asdict(c) for c in checks]})
    else:
        marks = {
            "ok": "[green]✔[/]",
            "info": "[blue]·[/]",
            "warn": "[yellow]![/]",
            "error": "[red]✘[/]",
        }
        table = Table("", "check", "result", box=None, title=app.where, title_justify="left")
        for check in checks:
            table.add_row(marks[check.status], check.name, Text(check.detail))
        app.out.print(table)
        app.out.print("Healthy." if healthy else "Problems found.")
    if not healthy:
        raise click.exceptions.Exit(EXIT_PROBLEM)
