"""``hermes-store export`` and ``import``: JSON Lines in and out (the work is in
:mod:`hermes_store.transfer`)."""

from __future__ import annotations

import errno
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

import click

from hermes_store.cli.app import (
    App,
    BadArgument,
    DatabaseProblem,
    boundary_error,
    complete_session,
    output_failed,
    pass_app,
    resolve_session,
    sources_option,
)
from hermes_store.cli.output import (
    chosen_format,
    echo,
    format_option,
    print_record,
    progress,
)
from hermes_store.echo import one_line

if TYPE_CHECKING:  # the CLI loads SQLAlchemy inside its commands only
    from hermes_store.transfer import ExportReport, ImportReport


@click.command("export", short_help="Write sessions as JSON Lines or Markdown.")
@click.option(
    "--session",
    "session_ref",
    metavar="ID|PREFIX|TITLE",
    help="Only this session.",
    shell_complete=complete_session,
)
@sources_option()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "md"]),
    default="jsonl",
    show_default=True,
    help="JSON Lines (for import) or Markdown (for reading).",
)
@click.option("--redact", is_flag=True, help="Mask API keys, tokens, passwords and private keys.")
@click.option(
    "--split", is_flag=True, help="Markdown: one file per session into the folder -o names."
)
@click.option(
    "-o",
    "--output",
    required=True,
    metavar="FILE|DIR",
    type=click.Path(allow_dash=True),
    help="Where to write ('-': stdout; a folder with --split). Written owner-only (0600), "
    "replaced whole when done.",
)
@pass_app
def export(
    app: App,
    session_ref: str | None,
    sources: tuple[str, ...],
    fmt: str,
    redact: bool,
    split: bool,
    output: str,
) -> None:
    """Write sessions as JSON Lines (one session per line, newest first) or Markdown.

    \b
    Examples:
      hermes-store export -o backup.jsonl
      hermes-store export --source telegram --source discord -o chats.jsonl
      hermes-store export --session "Database migration plan" -o - | jq .title
      hermes-store export --format md --redact -o conversations.md
      hermes-store export --format md --split -o conversations/
    """
    from hermes_store import transfer

    if session_ref is not None and not session_ref.strip():
        raise click.UsageError("--session is empty: name a session (leave it out for all)")
    if session_ref and sources:
        raise click.UsageError("--session and --source cannot be combined")
    if split and fmt != "md":
        raise click.UsageError("--split needs --format md")
    if split and output == "-":
        raise click.UsageError("--split writes files into a folder: -o DIR")
    if output == "-" and sys.__stdout__ is None:
        # Started with stdout closed (``>&-``): what it is given goes to /dev/null, and an
        # export there would say it wrote what nobody can read.
        raise DatabaseProblem(output_failed(OSError(errno.EBADF, "standard output is closed")))
    store = app.store(read_only=True)
    app.landed = lambda: (
        "The output written so far is incomplete; the database was not changed."
        if output == "-" or split
        else f"Nothing was exported: {output} was left as it was; the database was not changed."
    )
    session_id = resolve_session(store, session_ref) if session_ref else None
    report = transfer.ExportReport()
    records, total = transfer.export_records(
        store, session_id=session_id, sources=sources, report=report
    )
    with progress(total, "exporting") as bar:
        transfer.write_records(
            records,
            output,
            app.url,
            fmt=fmt,
            split=split,
            redacted=redact,
            on_record=bar.advance,
            report=report,
        )
    note = " (redacted)" if redact else ""
    echo(
        f"Exported {report.sessions} session(s), {report.messages} message(s) to {output}{note}.",
        err=True,
    )
    for line in export_notes(report):
        echo(f"  {line}", err=True)


def _committed(report: ImportReport) -> str:
    """What a failed import had committed before it failed, said after its error: the
    batches before stay, and the same import run again adds the rest."""
    if not report.sessions:
        return ""
    return (
        f" ({report.sessions} session(s) of the batches before it were imported; run the "
        "same import again to add the rest: known ids are skipped)"
    )


def export_notes(report: ExportReport) -> list[str]:
    """What an export wrote in another form or left out, one line each: said every time, so
    that a backup is never taken for a whole copy when it is not."""
    notes = []
    if report.values_marked:
        notes.append(
            f"{report.values_marked} value(s) JSON or the import's checks have no plain form "
            "for (a blob, text where a number belongs, an infinite cost, a timestamp no date "
            'holds) written as {"$sqlite": ...} objects: import restores them as they are '
            "into a SQLite database"
        )
    if report.orphan_messages:
        notes.append(
            f"{report.orphan_messages} message(s) left out: their session no longer exists, "
            "and no import can restore a message without its session"
        )
    if report.sessions_without_id:
        notes.append(
            f"{report.sessions_without_id} session(s) left out: stored with no id, which no "
            "import can restore"
        )
    return notes


@click.command("import", short_help="Restore a JSON Lines export.")
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
@click.option("--force", is_flag=True, help="Import a redacted export (markers and all).")
@format_option
@pass_app
def import_(
    app: App, file: str, batch_size: int, force: bool, fmt: str | None, as_json: bool
) -> None:
    """Restore a file written by export (the database is created if missing; known ids are skipped).

    \b
    Examples:
      hermes-store --db restored.db import backup.jsonl
      hermes-store import chats.jsonl --batch-size 500 --json
    """
    from hermes_store import transfer

    new_file = app.new_file()
    report = transfer.ImportReport()
    app.landed = lambda: (
        f"{report.sessions} session(s) and {report.messages} message(s) were imported (whole "
        "batches); run the same import again to add the rest (known ids are skipped)."
    )
    try:
        with (
            transfer.import_reader(file, app.url) as (handle, size),
            progress(size, "importing", bytes_=True) as bar,
        ):
            records = transfer.read_records(handle, bar.advance)
            if new_file is not None:  # built whole beside it, then linked in place
                transfer.import_new_file(
                    new_file, records, batch_size=batch_size, allow_redacted=force, report=report
                )
            else:
                transfer.import_sessions(
                    app.store(create=True),
                    records,
                    batch_size=batch_size,
                    allow_redacted=force,
                    report=report,
                )
    except transfer.NotAnExportError as error:
        # The wrong file given: a usage error, as a missing one is.
        raise BadArgument(f"{file}: {one_line(error)}{_committed(report)}") from error
    except transfer.ParentCycleError:
        raise  # its message says what the batches before it left
    except Exception as error:
        mapped = boundary_error(error) if report.sessions else None
        if mapped is None:
            raise
        said = type(mapped)(f"{mapped.message}{_committed(report)}")
        raise said from error

    def human() -> None:
        echo(
            f"Imported {report.sessions} session(s) and {report.messages} message(s) "
            f"into {app.where}."
        )
        notes = {
            "sessions_skipped": "session(s) skipped: the id already exists",
            "messages_skipped": "message(s) of skipped sessions not imported",
            "messages_renumbered": "message(s) stored under a new id (the id was taken)",
            "titles_cleared": "title(s) cleared: held by another session",
            "titles_refused": "title(s) left empty: not one the store keeps (too long, or "
            "holding control or invisible characters)",
            "parents_missing": "parent link(s) left empty: the parent is not in the file",
            "parents_restored": "parent link(s) restored on session(s) already in the "
            "database (stored with no parent)",
            "parents_differing": "session(s) already in the database keep a stored parent "
            "other than the file's",
        }
        for name, text in notes.items():
            if getattr(report, name):
                echo(f"  {getattr(report, name)} {text}")

    print_record(chosen_format(fmt, as_json, piped="table"), asdict(report), human)
