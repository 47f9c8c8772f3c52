"""``hermes-store doctor``: health checks (the checks are in :mod:`hermes_store.ops.health`)."""

from __future__ import annotations

from dataclasses import asdict

import click

from hermes_store.cli.app import EXIT_PROBLEM, App, DatabaseProblem, FiniteFloat, pass_app
from hermes_store.cli.output import (
    Column,
    chosen_format,
    echo,
    echo_json,
    format_option,
    print_rows,
    progress,
)

MARKS = {
    "ok": ("✔", "green"),
    "info": ("·", "blue"),
    "warn": ("!", "yellow"),
    "error": ("✘", "red"),
}


@click.command(short_help="Check the database's health; exit 1 on a problem.")
@click.option(
    "--rebuild-index",
    is_flag=True,
    help="Rebuild the full-text index first (then check). It holds the write lock throughout "
    "(about a minute per 2 GB): stop the agent first.",
)
@click.option(
    "--budget",
    type=FiniteFloat(min=0),
    default=120,
    show_default=True,
    metavar="SECONDS",
    help="Time for the slow checks of a large file (0: no limit); what does not finish warns.",
)
@click.option(
    "--full",
    is_flag=True,
    help="Also check every entry on a snapshot copy (needs the file's size in free space).",
)
@format_option
@pass_app
def doctor(
    app: App, rebuild_index: bool, budget: float, full: bool, fmt: str | None, as_json: bool
) -> None:
    """Check schema, file names, journal, integrity, full-text index and orphan rows; exit 1 on a
    problem (a second name of the file, a hard link, is one: every other command refuses it).

    Reads only (nothing is migrated or written) unless --rebuild-index, and never takes the
    write lock: a large file is checked table by table within --budget, its full-text index
    by a sample; --full checks everything on a copy. --rebuild-index is the repair: it
    rebuilds the whole index in one transaction, so writers wait for it (and give up after
    their patience on a large file).

    \b
    Examples:
      hermes-store doctor
      hermes-store doctor --json
      hermes-store doctor --full --budget 0
      hermes-store doctor --format tsv | grep -v "	ok	"
    """
    from hermes_store.ops import health
    from hermes_store.schema import migrate

    chosen = chosen_format(fmt, as_json, piped="table")
    if rebuild_index:
        state = migrate.state_of(app.url)
        if state is None or state.is_empty:
            raise DatabaseProblem(f"there is no schema at {app.where} (`hermes-store db upgrade`)")
        health.rebuild_index(app.url)
        echo("Rebuilt the full-text index.", err=True)
    with progress(None, "checking (groups of checks)") as bar:
        checks = health.run_doctor(
            app.url, budget_s=budget, full=full, progress=lambda _name: bar.advance(1)
        )
    healthy = all(c.status != "error" for c in checks)
    rows = [asdict(c) for c in checks]
    if chosen == "json":
        echo_json({"database": app.where, "ok": healthy, "checks": rows})
    elif chosen in ("tsv", "csv"):
        columns = [
            Column("check", "check", lambda r: r["name"]),
            Column("status", "status", lambda r: r["status"]),
            Column("detail", "detail", lambda r: r["detail"]),
        ]
        print_rows(chosen, columns, rows)
    else:
        columns = [
            Column(
                "mark",
                "",
                lambda r: r["status"],
                shown=lambda r: click.style(MARKS[r["status"]][0], fg=MARKS[r["status"]][1]),
            ),
            Column("check", "check", lambda r: r["name"]),
            Column("detail", "result", lambda r: r["detail"], wraps=True),
        ]
        print_rows("table", columns, rows, title=app.where)
        echo("Healthy." if healthy else "Problems found.")
    if not healthy:
        raise click.exceptions.Exit(EXIT_PROBLEM)
