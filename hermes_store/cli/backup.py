"""``hermes-store backup`` and ``restore``: consistent snapshots of a live SQLite database (the
work is in :mod:`hermes_store.ops.backup`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

import click

from hermes_store.cli.app import App, Problem, confirm, pass_app, yes_option
from hermes_store.cli.output import chosen_format, echo, echo_json, format_option, progress
from hermes_store.echo import one_line

if TYPE_CHECKING:
    from hermes_store.engine.factory import Target


def _sqlite_only(app: App, what: str) -> None:
    from hermes_store.engine.factory import sqlite_file
    from hermes_store.ops import backup

    if sqlite_file(app.url) is None:
        raise Problem(f"{what} works on SQLite files only. {backup.PG_BACKUP_HINT}")


@click.command("backup", short_help="Snapshot the live SQLite file (while agents write).")
@click.argument("dest", metavar="DEST", type=click.Path(dir_okay=False))
@click.option("--verify", is_flag=True, help="Open the copy and run the integrity checks.")
@click.option(
    "--method",
    type=click.Choice(["backup", "vacuum"]),
    default="backup",
    show_default=True,
    help="SQLite's backup API (page copy, with progress) or VACUUM INTO (compacted copy).",
)
@click.option("--force", is_flag=True, help="Replace DEST if it exists.")
@format_option
@pass_app
def backup_cmd(
    app: App, dest: str, verify: bool, method: str, force: bool, fmt: str | None, as_json: bool
) -> None:
    """Copy a consistent snapshot of the live database to DEST (0600) while writers write.

    \b
    Examples:
      hermes-store backup ~/backups/state-$(date +%F).db --verify
      hermes-store backup snapshot.db --method vacuum --force
    """
    from hermes_store.ops import backup

    _sqlite_only(app, "backup")
    store = app.store()
    with progress(None, "backing up (pages)") as bar:
        report = backup.backup(
            store.engine,
            dest,
            method="vacuum" if method == "vacuum" else "backup",
            overwrite=force,
            verify=verify,
            progress=bar.update,
        )
    if chosen_format(fmt, as_json, piped="table") == "json":
        echo_json(asdict(report))
        return
    checked = " and verified" if report.verified else ""
    echo(
        f"Backed up {app.where} to {report.destination}{checked}: {report.bytes:,} bytes "
        f"in {report.seconds:.2f} s ({report.method})."
    )


@click.command("restore", short_help="Write a snapshot back into the live SQLite file.")
@click.argument("snapshot", metavar="SNAPSHOT", type=click.Path(exists=True, dir_okay=False))
@yes_option
@format_option
@pass_app
def restore_cmd(app: App, snapshot: str, yes: bool, fmt: str | None, as_json: bool) -> None:
    """Write SNAPSHOT into the live database (in place, under its write lock).

    Everything written after the snapshot was taken is replaced. Processes that have the
    database open keep working and see the restored content. Asks first; --yes from scripts.
    A snapshot this release cannot open is refused; a live file it cannot open (a newer
    release's schema, a damaged one) is replaced all the same: restoring is how it is put back.

    \b
    Examples:
      hermes-store restore ~/backups/state-2026-11-30.db
      hermes-store restore snapshot.db --yes
    """
    from hermes_store.errors import SchemaTooNewError, UnrecognizedSchemaError
    from hermes_store.ops import backup

    _sqlite_only(app, "restore")
    live: Target
    unusable = ""
    try:
        live = app.store().engine
    except (SchemaTooNewError, UnrecognizedSchemaError) as error:
        # Restored by its path, never opened as a store: still refused unless it is SQLite.
        live, unusable = app.url, f" (this release cannot open it: {one_line(error)})"
    confirm(
        f"Replace the content of {app.where}{unusable} with {snapshot}?",
        yes=yes,
        what=f"restore {snapshot} over {app.where}",
    )
    with progress(None, "restoring (pages)") as bar:
        report = backup.restore(live, snapshot, progress=bar.update)
    if chosen_format(fmt, as_json, piped="table") == "json":
        echo_json(asdict(report))
        return
    echo(
        f"Restored {snapshot} into {app.where}: {report.sessions} session(s), "
        f"{report.messages} message(s)."
    )
