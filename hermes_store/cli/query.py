"""``hermes-store query``: read-only SQL (the library's :func:`hermes_store.query`)."""

from __future__ import annotations

from typing import Any

import click

from hermes_store.cli.app import App, pass_app
from hermes_store.cli.output import (
    Column,
    RowDict,
    chosen_format,
    echo,
    format_option,
    paged,
    print_rows,
)
from hermes_store.echo import echoed


@click.command("query", short_help="Run read-only SQL; print the rows.")
@click.argument("sql")
@click.option(
    "-p",
    "--param",
    "params",
    multiple=True,
    metavar="NAME=VALUE",
    help="Bind :NAME to VALUE (a string; repeatable).",
)
@click.option("--limit", type=click.IntRange(min=1), help="At most this many rows.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, max=2_000_000),
    default=60.0,
    show_default=True,
    metavar="SECONDS",
    help="Stop the query after this long (0: no limit).",
)
@format_option
@pass_app
@paged
def query(
    app: App,
    sql: str,
    params: tuple[str, ...],
    limit: int | None,
    timeout: float,
    fmt: str | None,
    as_json: bool,
) -> None:
    """Run one read-only SQL statement and print its rows (writes are refused by the
    database itself: SQLite opened read-only, PostgreSQL in a READ ONLY transaction; ATTACH,
    DETACH and VACUUM, which open or create other files, are refused before they run). It
    stops after --timeout seconds: on PostgreSQL what it reads or locks, it holds from the
    writers until it ends.

    \b
    Examples:
      hermes-store query "SELECT source, count(*) AS n FROM sessions GROUP BY source"
      hermes-store query "SELECT id, title FROM sessions WHERE model = :m" -p m=gpt-5 --json
      hermes-store query "SELECT role, count(*) FROM messages GROUP BY role" --format csv
    """
    from hermes_store.query import read_only_query

    bound: dict[str, Any] = {}
    for item in params:
        name, equals, value = item.partition("=")
        if not equals or not name:
            raise click.BadParameter(f"{echoed(item)} is not NAME=VALUE", param_hint="--param")
        bound[name] = value
    result = read_only_query(app.url, sql, bound, max_rows=limit, timeout=timeout or None)
    rows: list[RowDict] = [dict(zip(result.columns, row, strict=True)) for row in result.rows]
    columns = [
        Column(name, name, _value(name), wraps=True, right=_numeric(result.rows, index))
        for index, name in enumerate(result.columns)
    ]
    chosen = chosen_format(fmt, as_json)
    count = f"{len(rows)} row(s)" + (" (cut by --limit)" if result.truncated else "")
    print_rows(chosen, columns, rows, title=count if chosen == "table" else None)
    if chosen != "table" and result.truncated:
        echo(f"cut at {limit} rows by --limit", err=True)


def _value(name: str) -> Any:
    return lambda row: row[name]


def _numeric(rows: list[tuple[Any, ...]], index: int) -> bool:
    values = [row[index] for row in rows if row[index] is not None]
    return bool(values) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    )
