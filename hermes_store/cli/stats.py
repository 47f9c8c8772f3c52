"""``hermes-store stats``: sessions, messages, tokens and cost by model, source and day."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from hermes_store.cli.app import App, pass_app, sources_option
from hermes_store.cli.output import (
    Column,
    RowDict,
    chosen_format,
    echo,
    echo_json,
    format_option,
    num,
    paged,
    print_rows,
)

TOKENS = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
)
FIGURES = ("sessions", "messages", "tool_calls", *TOKENS, "estimated_cost_usd", "actual_cost_usd")
HEADINGS = {
    "sessions": "sessions",
    "messages": "messages",
    "input_tokens": "input",
    "output_tokens": "output",
    "cache_read_tokens": "cache read",
    "cache_write_tokens": "cache write",
    "reasoning_tokens": "reasoning",
}


#: On a narrow terminal these columns are left out first (highest first), as the table says.
OPTIONAL = {"cache_write_tokens": 4, "reasoning_tokens": 3, "cache_read_tokens": 2}


def _table_columns(key: str) -> list[Column]:
    columns = [Column(key, key, _raw(key))]
    columns += [
        Column(name, title, _count(name), right=True, optional=OPTIONAL.get(name, 0))
        for name, title in HEADINGS.items()
    ]
    columns += [
        Column("estimated_cost_usd", "est. cost", _dollars("estimated_cost_usd"), right=True),
        Column(
            "actual_cost_usd", "actual cost", _dollars("actual_cost_usd"), right=True, optional=1
        ),
    ]
    return columns


def _count(name: str) -> Callable[[RowDict], str]:
    return lambda row: num(row[name])


def _dollars(name: str) -> Callable[[RowDict], str]:
    return lambda row: f"${row[name]:.4f}"


def _raw(name: str) -> Callable[[RowDict], Any]:
    return lambda row: row[name]


@click.command(short_help="Sessions, messages, tokens and cost.")
@click.option(
    "--days",
    default=30,
    show_default=True,
    type=click.IntRange(1, 100_000),  # analytics.summary's range (importing it loads SQLAlchemy)
    help="How many recent UTC days the per-day table covers.",
)
@sources_option()
@format_option
@pass_app
@paged
def stats(app: App, days: int, sources: tuple[str, ...], fmt: str | None, as_json: bool) -> None:
    """Sessions, messages, tokens and cost: in total, by model, by source and by day.

    Piped (or --format tsv/csv): one row per figure group, the first column saying which
    (total, model, source, day), every number whole.

    \b
    Examples:
      hermes-store stats --days 7
      hermes-store stats --source cli --source telegram --json
      hermes-store stats | grep ^model
    """
    from hermes_store import analytics

    chosen = chosen_format(fmt, as_json)
    wanted = list(dict.fromkeys(sources)) or None
    report = analytics.summary(app.store(read_only=True), days=days, source=wanted)
    if chosen == "json":
        echo_json(report)
        return
    if chosen in ("tsv", "csv"):
        rows: list[RowDict] = [{"group": "total", "key": None, **report["totals"]}]
        for group, key in (("by_model", "model"), ("by_source", "source"), ("by_day", "day")):
            rows += [{"group": key, "key": row[key], **row} for row in report[group]]
        columns = [Column("group", "group", lambda r: r["group"])]
        columns.append(Column("key", "key", lambda r: r["key"]))
        columns += [Column(name, name, _raw(name)) for name in FIGURES]
        print_rows(chosen, columns, rows)
        return
    totals = report["totals"]
    echo(click.style(app.where, bold=True))
    echo(
        f"{num(totals['sessions'])} sessions, {num(totals['messages'])} messages; "
        f"{num(totals['input_tokens'])} input / {num(totals['output_tokens'])} output tokens"
    )
    echo(
        f"cost ${totals['estimated_cost_usd']:.4f} estimated / "
        f"${totals['actual_cost_usd']:.4f} actual"
    )
    zero = {name for name in (*TOKENS, "actual_cost_usd") if not totals[name]}
    for title, group, key in (
        ("By model", "by_model", "model"),
        ("By source", "by_source", "source"),
        (f"By day (UTC, last {days} days)", "by_day", "day"),
    ):
        echo()
        columns = [c for c in _table_columns(key) if c.key not in zero]
        print_rows("table", columns, report[group], title=title)
    if zero:
        names = ", ".join(
            HEADINGS.get(n, "actual cost") for n in sorted(zero, key=list(FIGURES).index)
        )
        echo(click.style(f"(all zero, left out: {names})", dim=True))
