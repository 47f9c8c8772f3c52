"""``hermes-store search``: full-text search over every message."""

from __future__ import annotations

from typing import cast

import click

from hermes_store.cli.app import INT64_MAX, App, pass_app, sources_option
from hermes_store.cli.output import (
    Column,
    RowDict,
    chosen_format,
    echo,
    format_option,
    highlight,
    iso,
    paged,
    plain,
    print_rows,
    terminal_text,
    unmark,
    when,
    wrapped,
)
from hermes_store.echo import echoed


@click.command(short_help="Full-text search over every message.")
@click.argument("query")
@sources_option("Only messages of sessions of this source (repeatable).")
@click.option(
    "--exclude-source", "excluded", multiple=True, help="Leave out a source (repeatable)."
)
@click.option("--role", "roles", multiple=True, help="Only messages of this role (repeatable).")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, INT64_MAX))
@click.option(
    "--sort",
    type=click.Choice(["rank", "newest", "oldest"]),
    default="rank",
    show_default=True,
    help="Best match first, or by time.",
)
@format_option
@pass_app
@paged
def search(
    app: App,
    query: str,
    sources: tuple[str, ...],
    excluded: tuple[str, ...],
    roles: tuple[str, ...],
    limit: int,
    sort: str,
    fmt: str | None,
    as_json: bool,
) -> None:
    """Full-text search over every message, best match first (CJK: substring search).

    \b
    Examples:
      hermes-store search "deploy script" --role user
      hermes-store search migration --source cli --source telegram --limit 5
      hermes-store search 数据库 --sort newest
      hermes-store search 迁移 --format tsv | cut -f2
    """
    chosen = chosen_format(fmt, as_json)
    hits = app.store(read_only=True).search_messages(
        query,
        source_filter=list(sources) or None,
        exclude_sources=list(excluded) or None,
        role_filter=list(roles) or None,
        limit=limit,
        sort=sort,
    )
    if chosen != "table":
        columns = [
            Column("id", "id", lambda h: h["id"]),
            Column("session_id", "session", lambda h: h["session_id"]),
            Column("source", "source", lambda h: h["source"]),
            Column("role", "role", lambda h: h["role"]),
            Column("timestamp", "timestamp", lambda h: iso(h["timestamp"])),
            Column("snippet", "snippet", lambda h: unmark(h["snippet"] or "")),
        ]
        print_rows(chosen, columns, cast(list[RowDict], hits))
        return
    for number, hit in enumerate(hits, 1):  # stored text escaped before it is styled
        session = terminal_text(plain(hit["session_id"]), one_line=True)
        header = click.style(f"{number}. ", bold=True) + click.style(session, fg="cyan")
        about = f" · {plain(hit['source'])} · {plain(hit['role'])} · {when(hit['timestamp'])}"
        header += click.style(terminal_text(about, one_line=True), dim=True)
        echo(header)
        echo(wrapped(highlight(hit["snippet"] or ""), indent="   ", styled=True))
    shown = echoed(query)
    echo(f"{len(hits)} result(s) for {shown}" if hits else f"No results for {shown}.")
