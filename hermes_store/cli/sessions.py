"""``hermes-store sessions``: list, show, rename, delete and prune sessions."""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, cast

import click

from hermes_store import jsontext
from hermes_store.cli.app import (
    INT64_MAX,
    App,
    FiniteFloat,
    Problem,
    boundary_error,
    complete_session,
    confirm,
    pass_app,
    resolve_session,
    sources_option,
    yes_option,
)
from hermes_store.cli.output import (
    BLOB_SHOWN,
    Column,
    RowDict,
    chosen_format,
    cost,
    echo,
    echo_json,
    fold,
    format_option,
    iso,
    lock_holds,
    num,
    paged,
    plain,
    print_rows,
    progress,
    terminal_text,
    when,
    width,
    wrapped,
)

if TYPE_CHECKING:
    from hermes_store.store import SessionDB

#: At this terminal width and wider, session ids are shown whole; narrower, as unique prefixes.
FULL_ID_WIDTH = 160


@click.group(short_help="List, show, rename, delete and prune sessions.")
def sessions() -> None:
    """List, show, rename, delete and prune sessions.

    \b
    Examples:
      hermes-store sessions list --source cli --source telegram
      hermes-store sessions list | grep "Discord moderation" | cut -f1
      hermes-store sessions show 7f3c9a2e --system-prompt
      hermes-store sessions prune --older-than 90 --dry-run
    """


def _list_rows(
    store: SessionDB,
    sources: tuple[str, ...],
    excluded: tuple[str, ...],
    children: bool,
    limit: int,
) -> list[RowDict]:
    """``list_sessions_rich`` for any number of sources (the library takes one per call):
    each source's newest ``limit``, merged newest first, cut to ``limit``."""
    wanted: list[str | None] = [*dict.fromkeys(sources)] or [None]
    rows: list[RowDict] = []
    for source in wanted:
        rows += cast(
            list[RowDict],
            store.list_sessions_rich(
                source=source,
                exclude_sources=list(excluded) or None,
                limit=limit,
                include_children=children,
            ),
        )
    if len(wanted) > 1:
        rows.sort(
            key=lambda r: (r["started_at"], r.get("_lineage_root_id") or r["id"]), reverse=True
        )
    return rows[:limit]


@sessions.command("list", short_help="Sessions, newest first.")
@sources_option("Only sessions of this source: cli, telegram, ... (repeatable).")
@click.option(
    "--exclude-source", "excluded", multiple=True, help="Leave out a source (repeatable)."
)
@click.option("--children", is_flag=True, help="Include child sessions (subagents, continuations).")
@click.option(
    "--limit",
    default=20,
    show_default=True,
    type=click.IntRange(0, INT64_MAX),
    help="How many sessions, newest first; 0 lists every one.",
)
@click.option("--all", "every", is_flag=True, help="Every session (the same as --limit 0).")
@format_option
@pass_app
@paged
def sessions_list(
    app: App,
    sources: tuple[str, ...],
    excluded: tuple[str, ...],
    children: bool,
    limit: int,
    every: bool,
    fmt: str | None,
    as_json: bool,
) -> None:
    """List sessions, newest first.

    On a terminal: a table whose titles wrap at words and whose numbers are never cut (on a
    narrow one the preview, model and last-active columns are left out first). Piped:
    tab-separated rows with a header and full values (see --format).

    \b
    Examples:
      hermes-store sessions list --limit 50
      hermes-store sessions list --source telegram --source discord --format csv
      hermes-store sessions list | cut -f1,2
      hermes-store sessions list --all | grep -i deploy
    """
    chosen = chosen_format(fmt, as_json)
    db = app.store(read_only=True)
    total = db.count_sessions(sources, excluded, children)
    if every or limit == 0:
        limit = max(total, 1)
    rows = _list_rows(db, sources, excluded, children, limit)
    if chosen == "table":
        ids = [row["id"] for row in rows]
        shown = {i: i for i in ids} if width() >= FULL_ID_WIDTH else db.unique_id_prefixes(ids)
        columns = [
            Column("id", "id", lambda r: r["id"], shown=lambda r: terminal_text(shown[r["id"]])),
            Column("title", "title", lambda r: r.get("title"), wraps=True),
            Column("source", "source", lambda r: r["source"]),
            Column("model", "model", lambda r: r.get("model"), wraps=True, optional=2),
            Column("messages", "messages", lambda r: num(r.get("message_count")), right=True),
            Column(
                "tokens",
                "tokens in/out",
                lambda r: f"{num(r.get('input_tokens'))}/{num(r.get('output_tokens'))}",
                right=True,
            ),
            Column("cost", "cost", lambda r: cost(r), right=True),
            Column("last_active", "last active", lambda r: when(r.get("last_active")), optional=1),
            Column("preview", "preview", lambda r: r.get("preview"), wraps=True, optional=3),
        ]
        shown_of = f"{len(rows)} of {total:,}" if len(rows) < total else f"{len(rows)}"
        print_rows(chosen, columns, rows, title=f"{shown_of} session(s) in {app.where}")
        if len(rows) < total:
            echo(click.style("(newest first: --limit N or --all for more)", dim=True))
        return
    columns = [
        Column("id", "id", lambda r: r["id"]),
        Column("title", "title", lambda r: r.get("title")),
        Column("source", "source", lambda r: r["source"]),
        Column("model", "model", lambda r: r.get("model")),
        Column("message_count", "messages", lambda r: r.get("message_count") or 0),
        Column("input_tokens", "input", lambda r: r.get("input_tokens") or 0),
        Column("output_tokens", "output", lambda r: r.get("output_tokens") or 0),
        Column("estimated_cost_usd", "est. cost", lambda r: r.get("estimated_cost_usd")),
        Column("actual_cost_usd", "actual cost", lambda r: r.get("actual_cost_usd")),
        Column("started_at", "started", lambda r: iso(r.get("started_at"))),
        Column("last_active", "last active", lambda r: iso(r.get("last_active"))),
        Column("preview", "preview", lambda r: r.get("preview")),
    ]
    print_rows(chosen, columns, rows)


def _tool_call_line(call: Any, full: bool) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict):
        name, arguments = function.get("name", "?"), function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = jsontext.dumps(arguments, ensure_ascii=False)
        body = f"{name}({arguments})"
    else:
        body = jsontext.dumps(call, ensure_ascii=False)
    return body if full else fold(body)


def _shown(value: object) -> str:
    """A short stored value (a role, a tool's name) on one line, escaped for the terminal."""
    return terminal_text(plain(value, limit=BLOB_SHOWN), one_line=True)


def _print_message(message: RowDict, full: bool) -> None:
    """One message for a person: stored text escaped (``terminal_text``) before it is styled."""
    role = message["role"]
    colours = {"user": "cyan", "assistant": "green", "tool": "magenta"}
    header = click.style(_shown(role), fg=colours.get(role, "yellow"), bold=True)
    if message.get("tool_name"):
        header += click.style(f" · {_shown(message['tool_name'])}", fg="magenta")
    header += click.style(f" · {when(message['timestamp'], '%Y-%m-%d %H:%M:%S')}", dim=True)
    echo(header)
    reasoning = plain(message.get("reasoning") or "", limit=None if full else BLOB_SHOWN)
    if reasoning:
        body = terminal_text(reasoning) if full else fold(reasoning, 90)
        echo(click.style(f"  ▸ reasoning ({len(reasoning)} chars): {body}", dim=True, italic=True))
    for key in ("reasoning_details", "codex_reasoning_items"):
        if message.get(key):
            text = plain(message[key], limit=None if full else BLOB_SHOWN)
            detail = f": {terminal_text(text)}" if full else ""
            label = key.replace("_", " ")
            echo(click.style(f"  ▸ {label} ({len(text)} chars){detail}", dim=True))
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ([calls] if calls else []):
        line = terminal_text(_tool_call_line(call, full))
        echo(click.style(f"  ▸ tool call {line}", fg="yellow"))
    stored = message.get("content")
    content = "" if stored is None else plain(stored, limit=None if full else BLOB_SHOWN)
    if content:
        if role == "tool" and not full:
            lines = content.count("\n") + 1
            echo(f"  ◂ {fold(content)}  ({lines} lines, {len(content)} chars)")
        else:
            echo(wrapped(content))
    echo()


def _label(row: RowDict | None, session_id: str) -> str:
    if row is None:
        return f"{session_id} (deleted)"
    return f"{session_id} ({row.get('title') or 'untitled'}, {row['source']})"


@sessions.command("show", short_help="One session and its conversation.")
@click.argument("ref", metavar="ID|PREFIX|TITLE", shell_complete=complete_session)
@click.option("--full", is_flag=True, help="Unfold reasoning, tool arguments and tool results.")
@click.option("--system-prompt", is_flag=True, help="Print the session's system prompt too.")
@format_option
@pass_app
@paged
def sessions_show(
    app: App, ref: str, full: bool, system_prompt: bool, fmt: str | None, as_json: bool
) -> None:
    """Show one conversation: its parent and children, then each message (tool calls and
    reasoning folded to one line each unless --full).

    With --format tsv or csv: one row per message, every value whole.

    \b
    Examples:
      hermes-store sessions show "Database migration plan" --full
      hermes-store sessions show 7f3c9a2e --system-prompt
      hermes-store sessions show 7f3c9a2e --format tsv | cut -f2,5
    """
    chosen = chosen_format(fmt, as_json, piped="table")
    store = app.store(read_only=True)
    session_id = resolve_session(store, ref)
    if chosen == "json":
        from hermes_store.cli.output import echo_json

        echo_json(store.export_session(session_id))
        return
    if chosen in ("tsv", "csv"):
        columns = [
            Column("id", "id", lambda m: m["id"]),
            Column("role", "role", lambda m: m["role"]),
            Column("timestamp", "timestamp", lambda m: iso(m["timestamp"])),
            Column("tool_name", "tool", lambda m: m.get("tool_name")),
            Column("content", "content", lambda m: m.get("content")),
            Column(
                "tool_calls",
                "tool calls",
                lambda m: (
                    jsontext.dumps(m["tool_calls"], ensure_ascii=False)
                    if m.get("tool_calls")
                    else None
                ),
            ),
            Column("reasoning", "reasoning", lambda m: m.get("reasoning")),
        ]
        print_rows(chosen, columns, cast(list[RowDict], list(store.iter_messages(session_id))))
        return
    session = store.get_session(session_id)
    if session is None:
        raise Problem(f"session {terminal_text(session_id)} was deleted meanwhile")
    children = store.get_child_sessions(session_id)
    parent_id = session.get("parent_session_id")
    parent = store.get_session(parent_id) if parent_id else None
    echo(click.style(terminal_text(plain(session.get("title") or session["id"])), bold=True))
    fields: list[tuple[str, str]] = [
        ("id", session["id"]),
        ("source / model", f"{session['source']} / {session.get('model') or '—'}"),
    ]
    if parent_id:
        fields.append(("parent", _label(cast(RowDict | None, parent), parent_id)))
    for number, child in enumerate(children):
        fields.append(("children" if number == 0 else "", _label(child, child["id"])))
    ended = when(session.get("ended_at"))
    if session.get("end_reason"):
        ended += f" ({session['end_reason']})"
    fields += [
        ("started / ended", f"{when(session['started_at'])} / {ended}"),
        (
            "messages / tool calls",
            f"{num(session.get('message_count'))} / {num(session.get('tool_call_count'))}",
        ),
        (
            "tokens in / out",
            f"{num(session.get('input_tokens'))} / {num(session.get('output_tokens'))}"
            f" (cache {num(session.get('cache_read_tokens'))} read,"
            f" {num(session.get('cache_write_tokens'))} write;"
            f" reasoning {num(session.get('reasoning_tokens'))})",
        ),
        ("cost", cost(cast(RowDict, session))),
    ]
    prompt = session.get("system_prompt")
    if prompt and not system_prompt:
        fields.append(("system prompt", f"{len(prompt)} chars (--system-prompt shows it)"))
    elif not prompt:
        fields.append(("system prompt", "—"))
    label_width = max(len(name) for name, _ in fields)
    for name, value in fields:
        echo(f"  {name:<{label_width}}  {terminal_text(value, one_line=True)}")
    if prompt and system_prompt:
        echo()
        echo(click.style("system prompt", bold=True))
        echo(terminal_text(plain(prompt)))
    echo()
    for message in store.iter_messages(session_id):
        _print_message(cast(RowDict, message), full)


@sessions.command("rename", short_help="Set or clear a session's title.")
@click.argument("ref", metavar="ID|PREFIX|TITLE", shell_complete=complete_session)
@click.argument("title")
@pass_app
def sessions_rename(app: App, ref: str, title: str) -> None:
    """Set a session's title (an empty TITLE clears it); exit 1 when another session holds it.

    \b
    Examples:
      hermes-store sessions rename 7f3c9a2e "Migration follow-up"
      hermes-store sessions rename 7f3c9a2e ""
    """
    store = app.store()
    session_id = resolve_session(store, ref)
    if not store.set_session_title(session_id, title):
        raise Problem(f"session {terminal_text(session_id)} was deleted meanwhile")
    new = store.get_session_title(session_id)
    echo(terminal_text(f"{session_id}: ") + (f"title is now {new!r}" if new else "title cleared"))


@sessions.command("delete", short_help="Delete a session and its messages.")
@click.argument("ref", metavar="ID|PREFIX|TITLE", shell_complete=complete_session)
@yes_option
@pass_app
def sessions_delete(app: App, ref: str, yes: bool) -> None:
    """Delete a session and its messages (its children are kept, unparented); asks first
    unless --yes, and refuses without a terminal unless --yes.

    \b
    Examples:
      hermes-store sessions delete 20251203_101512_a1b2c3
      hermes-store sessions delete "Database migration plan #2" --yes
    """
    store = app.store()
    session_id = resolve_session(store, ref)
    session: RowDict = cast(RowDict | None, store.get_session(session_id)) or {}
    label = f"{session_id} ({session.get('title') or 'untitled'}, "
    label = terminal_text(label + f"{num(session.get('message_count'))} messages)", one_line=True)
    confirm(f"Delete session {label}?", yes=yes, what=f"delete session {terminal_text(session_id)}")
    if not store.delete_session(session_id):
        raise Problem(f"session {terminal_text(session_id)} was deleted meanwhile")
    echo(f"Deleted session {label}.")


@sessions.command("prune", short_help="Delete old ended sessions, in chunks.")
@click.option(
    "--older-than",
    "days",
    required=True,
    type=FiniteFloat(min=0, scale=86400),
    metavar="DAYS",
    help="Delete ended sessions started more than DAYS days ago.",
)
@sources_option()
@click.option("--keep-titled", is_flag=True, help="Keep sessions that have a title.")
@click.option(
    "--keep-lineage",
    is_flag=True,
    help="Keep every session of a parent/child chain holding a session that is kept.",
)
@click.option(
    "--chunk",
    default=200,
    show_default=True,
    type=click.IntRange(1, 5000),
    help="Sessions a transaction considers at most; each holds the write lock ~0.1 s at most.",
)
@click.option(
    "--secure-delete",
    is_flag=True,
    help="Overwrite the freed pages with zeros (SQLite) and merge the whole full-text index.",
)
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@yes_option
@format_option
@pass_app
def sessions_prune(
    app: App,
    days: float,
    sources: tuple[str, ...],
    keep_titled: bool,
    keep_lineage: bool,
    chunk: int,
    secure_delete: bool,
    dry_run: bool,
    yes: bool,
    fmt: str | None,
    as_json: bool,
) -> None:
    """Delete ended sessions started more than DAYS ago, a chunk at a time (active ones never).

    Asks for confirmation, showing how many sessions would go; without a terminal (cron),
    --yes is required. The dry run lists exactly what the prune would delete. Deletes in short
    transactions (about 0.1 s of the write lock each; a session with a lot of text goes over
    several), so agents writing meanwhile wait for one at most. Safe as a periodic job: two
    runs at once delete each session once. The full-text index's delete records are folded
    together as it goes, in short steps too; the deleted words leave the index's big segments
    when `db optimize` merges it whole (--secure-delete does it here). A full-text index found
    damaged is refused before anything is deleted (`hermes-store doctor --rebuild-index`
    repairs it); a failure midway says what the steps before it deleted.

    \b
    Examples:
      hermes-store sessions prune --older-than 90 --dry-run
      hermes-store sessions prune --older-than 90 --source cli --source telegram --keep-titled
      hermes-store sessions prune --older-than 90 --yes    # from cron
    """
    from hermes_store.ops import retention

    store = app.store()
    policy = retention.Policy(days, sources, keep_titled=keep_titled, keep_lineage=keep_lineage)
    candidates = retention.would_delete(store.uow, policy)
    if dry_run:
        chosen = chosen_format(fmt, as_json)
        if chosen == "table":
            columns = [
                Column("id", "id", lambda r: r["id"]),
                Column("title", "title", lambda r: r["title"], wraps=True),
                Column("source", "source", lambda r: r["source"]),
                Column("started", "started", lambda r: when(r["started_at"])),
                Column("ended", "ended", lambda r: when(r["ended_at"])),
                Column("messages", "messages", lambda r: num(r["message_count"]), right=True),
            ]
        else:
            columns = [
                Column("id", "id", lambda r: r["id"]),
                Column("title", "title", lambda r: r["title"]),
                Column("source", "source", lambda r: r["source"]),
                Column("started_at", "started", lambda r: iso(r["started_at"])),
                Column("ended_at", "ended", lambda r: iso(r["ended_at"])),
                Column("message_count", "messages", lambda r: r["message_count"] or 0),
            ]
        if candidates or chosen != "table":
            print_rows(chosen, columns, candidates)
        summary = f"Dry run: would delete {len(candidates)} session(s); nothing was deleted."
        echo(summary, err=chosen != "table")
        return
    if candidates:
        retention.check_index(store.uow)  # a damaged index is refused before the question
        messages = sum(row["message_count"] or 0 for row in candidates)
        confirm(
            f"Delete {len(candidates)} session(s) and their {messages:,} message(s), "
            f"started more than {days:g} days ago?",
            yes=yes,
            what=f"delete {len(candidates)} session(s)",
        )
    report = retention.Report()  # filled in as each step commits: what landed, if it stops

    def chunk_done(_sessions: int, messages: int) -> None:
        bar.advance(messages)

    def landed() -> str:
        return (
            f"{report.sessions} session(s) and {report.messages} message(s) were deleted "
            "(whole steps); the others are kept."
        )

    app.landed = landed
    total = sum(row["message_count"] or 0 for row in candidates)
    bars = contextlib.ExitStack()
    shown: list[Any] = []

    def merge_done(_kind: str, pages: int) -> None:
        if len(shown) == 1:  # the deletes are done: the index's merge gets its own bar
            bars.close()
            shown.append(bars.enter_context(progress(None, "merging the full-text index (pages)")))
        shown[-1].advance(pages)

    with bars:
        bar = bars.enter_context(progress(total, "pruning (messages)"))
        shown.append(bar)
        # The whole index is merged (deleted words leave its big segments too) only with
        # --secure-delete: its steps for common words hold the write lock past the bound,
        # and `db optimize` runs that merge.
        try:
            retention.run(
                store.uow,
                policy,
                chunk=chunk,
                secure_delete=secure_delete,
                merge_index=secure_delete,
                on_chunk=chunk_done,
                on_merge=merge_done,
                report=report,
            )
        except Exception as error:
            # As for Ctrl-C: the steps that committed before the failure stay deleted.
            mapped = boundary_error(error)
            if mapped is None or not (report.sessions or report.messages):
                raise
            raise type(mapped)(f"{mapped.message}. The prune stopped there: {landed()}") from error
    if chosen_format(fmt, as_json, piped="table") == "json":
        echo_json(asdict(report))
        return
    echo(
        f"Deleted {report.sessions} session(s) and {report.messages} message(s) started more "
        f"than {days:g} days ago, in {report.chunks} chunk(s)."
    )
    echo(lock_holds(report))
    if report.sessions and not report.index_merged:
        echo(
            "The deleted words' records stay in the full-text index's big segments until "
            "`hermes-store db optimize` merges them (or prune with --secure-delete)."
        )
