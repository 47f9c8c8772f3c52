"""``hermes-store db``: schema migrations (upgrade, downgrade, current, history, check)."""

from __future__ import annotations

from dataclasses import asdict

import click

from hermes_store.cli.app import (
    App,
    DatabaseProblem,
    Problem,
    confirm,
    pass_app,
    yes_option,
)
from hermes_store.cli.output import (
    Column,
    chosen_format,
    echo,
    echo_json,
    format_option,
    lock_holds,
    paged,
    print_record,
    print_rows,
    progress,
)
from hermes_store.echo import one_line


@click.group(short_help="Migrate, inspect and optimize the schema.")
def db() -> None:
    """Schema migrations (Alembic); a state.db written by the original store is adopted first.

    \b
    Examples:
      hermes-store db current
      hermes-store db upgrade
      hermes-store db downgrade v5_billing_columns --yes
    """


@db.command("upgrade", short_help="Create, adopt or upgrade the schema.")
@click.argument("revision", default="head")
@click.option(
    "--sql",
    "offline",
    is_flag=True,
    help="Print the SQL instead of running it, connecting to nothing (as Alembic's --sql): "
    "from an empty database, or from START with REVISION given as START:END.",
)
@pass_app
def db_upgrade(app: App, revision: str, offline: bool) -> None:
    """Upgrade to REVISION (default: head), creating or adopting the database.

    \b
    Examples:
      hermes-store db upgrade
      hermes-store --db postgresql://hermes@db/hermes db upgrade --sql > create.sql
      hermes-store --db postgresql://hermes@db/hermes db upgrade v5_billing_columns:head --sql
      hermes-store db upgrade v5_billing_columns
    """
    from hermes_store.schema import migrate

    if offline:
        start, _, end = revision.rpartition(":")
        click.echo(migrate.upgrade_sql(app.url, end or "head", start=start or None), nl=False)
        return
    report = migrate.run_upgrade(app.url, revision)
    if report.adopted_version is not None:
        echo(
            f"Adopted {app.where} (schema_version {report.adopted_version} of the original store)."
        )
    echo(f"{app.where}: {report.before or 'empty'} -> {report.after}")


@db.command("downgrade", short_help="Step the schema down to a revision.")
@click.argument("revision")
@yes_option
@pass_app
def db_downgrade(app: App, revision: str, yes: bool) -> None:
    """Downgrade to REVISION; asks first unless --yes.

    'base' removes every table and every row; columns a step drops lose their data.

    \b
    Examples:
      hermes-store db downgrade v5_billing_columns
      hermes-store db downgrade base --yes
    """
    from hermes_store.schema import migrate

    migrate.resolve_revision(revision)  # a bad revision is refused before the question
    before = migrate.current(app.url)
    what = "every table and every row" if revision == "base" else "the columns it drops"
    confirm(
        f"Downgrade {app.where} from {before or 'empty'} to {revision}? This deletes {what}.",
        yes=yes,
        what=f"downgrade {app.where}",
    )
    after = migrate.downgrade(app.url, revision)
    echo(f"{app.where}: {before or 'empty'} -> {after or 'base'}")


@db.command("current", short_help="The revision and schema_version.")
@format_option
@pass_app
def db_current(app: App, fmt: str | None, as_json: bool) -> None:
    """Show the database's revision and schema_version (a newer release's file is reported).

    \b
    Examples:
      hermes-store db current
      hermes-store --db postgresql://hermes@db/hermes db current --json
    """
    from hermes_store.ops import health

    status = health.schema_status(app.url)
    info = {"database": app.where, **asdict(status)}

    def human() -> None:
        if not status.exists:
            echo(f"{app.where}: no schema yet (`hermes-store db upgrade` creates it)")
            return
        note = "(head)" if status.at_head else f"(head is {status.head})"
        if status.too_new:
            note = "(written by a newer hermes_store: upgrade hermes_store to open it)"
        elif status.legacy:
            note = "(legacy file, not adopted yet: `hermes-store db upgrade` adopts it)"
        echo(f"{app.where}: {status.revision} {note}, schema_version {status.schema_version}")

    print_record(chosen_format(fmt, as_json, piped="table"), info, human)


@db.command("history", short_help="Every revision, oldest first.")
@format_option
@pass_app
@paged
def db_history(app: App, fmt: str | None, as_json: bool) -> None:
    """List the revisions, oldest first, marking the database's current one.

    \b
    Examples:
      hermes-store db history
      hermes-store db history --format tsv | grep current
    """
    from hermes_store.schema import migrate

    rows = [asdict(revision) for revision in migrate.history(app.url)]

    def marked(row: dict[str, object]) -> str:
        marks = [name for name in ("current", "head") if row[name]]
        return f"{row['revision']}" + (f" ({', '.join(marks)})" if marks else "")

    chosen = chosen_format(fmt, as_json)
    if chosen == "table":  # one line per revision: the order says what comes down from what
        columns = [
            Column("mark", "", lambda r: "", shown=lambda r: "→" if r["current"] else ""),
            Column("revision", "revision", lambda r: r["revision"], shown=marked),
            Column("description", "description", lambda r: r["description"], cuts=True),
        ]
    else:
        columns = [
            Column("revision", "revision", lambda r: r["revision"]),
            Column("down_revision", "down revision", lambda r: r["down_revision"]),
            Column("current", "current", lambda r: str(r["current"]).lower()),
            Column("head", "head", lambda r: str(r["head"]).lower()),
            Column("description", "description", lambda r: r["description"]),
        ]
    print_rows(chosen, columns, rows)


@db.command("check", short_help="Compare the database with the models.")
@pass_app
def db_check(app: App) -> None:
    """Compare the database with the models (alembic check); exit 1 on drift.

    A legacy file is adopted inside a transaction that is rolled back: the file is not changed.

    \b
    Examples:
      hermes-store db check
      hermes-store --db postgresql://hermes@db/hermes db check && echo "no drift"
    """
    from hermes_store.schema import migrate

    report = migrate.check_drift(app.url)
    if not report.exists:
        raise DatabaseProblem(f"there is no schema at {app.where} (`hermes-store db upgrade`)")
    if not report.compared:
        raise Problem(
            f"{app.where} is at {report.revision}, head is {report.head}: "
            "run `hermes-store db upgrade`"
        )
    if report.differences is not None:
        raise Problem(f"{app.where} drifted from the models: {one_line(report.differences)}")
    echo(f"{app.where}: no drift (at {report.head})")


@db.command("optimize", short_help="Merge the index, free pages, in short steps.")
@click.option(
    "--vacuum",
    is_flag=True,
    help="Offline: a full VACUUM (refused while any other process has the file open).",
)
@click.option(
    "--swap",
    is_flag=True,
    help="With --vacuum: write a compacted copy beside the file and rename it over the file, "
    "never rewriting the file in place (for files a replica such as Litestream follows).",
)
@format_option
@pass_app
def db_optimize(app: App, vacuum: bool, swap: bool, fmt: str | None, as_json: bool) -> None:
    """Merge the full-text index, refresh statistics, free pages; online, in short steps.

    Each step holds the write lock about 0.1 s at most, so agents keep writing. A file created
    by the original store (auto_vacuum off) keeps its freed pages for reuse: --vacuum, run once
    with every agent stopped, rewrites it and turns incremental vacuum on. With --swap the file
    is never rewritten in place: a compacted copy is written beside it and renamed over it
    (also with every agent, and a replicator such as Litestream, stopped).

    \b
    Examples:
      hermes-store db optimize
      hermes-store db optimize --vacuum    # offline: no other process may have the file open
      hermes-store db optimize --vacuum --swap
    """
    from dataclasses import asdict

    from hermes_store.engine.factory import sqlite_file
    from hermes_store.ops import maintenance

    if swap and not vacuum:
        raise click.UsageError("--swap goes with --vacuum (--vacuum --swap)")
    as_json = chosen_format(fmt, as_json, piped="table") == "json"
    if vacuum:
        path = sqlite_file(app.url)
        if path is None:
            raise Problem("--vacuum is for SQLite files; on PostgreSQL use VACUUM FULL offline")
        app.store()  # brings the schema to head and refuses what is not a database
        app.close()
        if swap:
            before, after = maintenance.vacuum_swap(path)
        else:
            before, after = maintenance.vacuum_offline(path)
        if as_json:
            echo_json({"vacuum": True, "swap": swap, "bytes_before": before, "bytes_after": after})
            return
        how = "compacted copy swapped in" if swap else "rewritten (full vacuum)"
        echo(f"{app.where}: {how}, {before:,} -> {after:,} bytes.")
        return
    with progress(None, "optimizing (pages)") as bar:
        report = maintenance.optimize(
            app.store().uow, on_step=lambda _kind, work: bar.advance(work)
        )
    if as_json:
        echo_json(asdict(report))
        return
    echo(
        f"{app.where}: {report.bytes_before:,} -> {report.bytes_after:,} bytes; "
        f"{report.merge_steps} index merge step(s), {report.pages_freed:,} page(s) freed."
    )
    echo(
        lock_holds(report)
        + (f" (the longest: {report.longest_step_kind})" if report.longest_step_kind else "")
    )
    for note in report.notes:
        echo(f"  {note}")
