"""Output for every command: the ``--format`` option, tab/comma-separated rows, JSON, and
terminal tables that never cut a value.

On a terminal, lists are tables: numbers and ids are never shortened (a column too wide for the
screen makes the line longer, the terminal wraps it), text columns (titles, previews) wrap at
word boundaries, and optional columns are left out, with a note, before a text column would
drop under a readable width. Anywhere else (a pipe, a file) lists are tab-separated rows with
a header and full values, so ``grep`` and ``cut -f`` see whole titles and numbers.

Stored text comes from remote chat users: whatever is meant for a person (the table format
wherever it goes, tsv and csv on a terminal) shows control characters escaped by
:func:`terminal_text`, so no stored value can clear the screen, set the window title or write
the clipboard. JSON, and tsv and csv written to a pipe or a file, keep every value as stored.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from hermes_store import jsontext, markdown, timestamps
from hermes_store.cli.streams import is_terminal

if TYPE_CHECKING:  # the CLI loads SQLAlchemy inside its commands only
    from hermes_store.ops.pacing import StepTally

FORMATS = ("table", "tsv", "csv", "json")
RowDict = dict[str, Any]
F = TypeVar("F", bound=Callable[..., Any])

GAP = 2
#: Colour and style codes (click.style): they take no cell on the terminal.
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MIN_TEXT_WIDTH = 12

#: What :func:`terminal_text` escapes: C0 controls (newline and tab aside), DEL, C1 controls,
#: and the bidi embeddings, overrides and isolates, which make text read other than it is.
_CONTROLS = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[{_CONTROLS}]")
_UNSAFE_ON_ONE_LINE = re.compile(rf"[\t\n{_CONTROLS}]")
_STYLED_OR_UNSAFE = re.compile(f"{ANSI.pattern}|[{_CONTROLS}]")
_STYLED_OR_UNSAFE_ON_ONE_LINE = re.compile(rf"{ANSI.pattern}|[\t\n{_CONTROLS}]")


def format_option(func: F) -> F:
    """``--format table|tsv|csv|json`` and ``--json`` (an alias of ``--format json``)."""
    func = click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (same as --format json)."
    )(func)
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(FORMATS),
        default=None,
        help="table, tsv, csv or json. Default: table on a terminal, tsv otherwise.",
    )(func)


def stdout_is_terminal() -> bool:
    return is_terminal(sys.stdout)


def chosen_format(fmt: str | None, as_json: bool, *, piped: str = "tsv") -> str:
    """The format asked for; otherwise a table on a terminal and ``piped`` elsewhere."""
    if as_json:
        if fmt not in (None, "json"):
            raise click.UsageError(f"--json and --format {fmt} contradict each other")
        return "json"
    if fmt is not None:
        return fmt
    return "table" if stdout_is_terminal() else piped


def _escape(match: re.Match[str]) -> str:
    found = match.group(0)
    if len(found) > 1:  # a colour or style code (``styled`` only): kept
        return found
    code = ord(found)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def terminal_text(text: str, *, one_line: bool = False, styled: bool = False) -> str:
    """``text`` safe to show a person on a terminal: every control character shown escaped
    as Python writes it, ``\\xNN`` (ESC as the four characters ``\\x1b``, DEL as ``\\x7f``,
    C1 controls as ``\\x80``-``\\x9f``), and the bidi embeddings, overrides and isolates
    (U+202A-U+202E, U+2066-U+2069) as ``\\uNNNN``. Newline and tab are kept (escaped too with
    ``one_line``: a table cell); a Windows line end (CR LF) is a newline, a lone CR is escaped.
    Backslashes are not escaped: the exact value is what JSON and piped tsv/csv give.

    ``styled``: ``text`` is a line this CLI styled with click.style after escaping the stored
    text in it, so its colour and style codes (``ESC [ ... m``) are kept; any other escape
    sequence is escaped still. Every line made of stored text goes through this function once
    before the terminal sees it (twice is harmless: the result holds no control character)."""
    text = text.replace("\r\n", "\n")
    if styled:
        unsafe = _STYLED_OR_UNSAFE_ON_ONE_LINE if one_line else _STYLED_OR_UNSAFE
    else:
        unsafe = _UNSAFE_ON_ONE_LINE if one_line else _UNSAFE
    return unsafe.sub(_escape, text)


def _echo_rows(rendered: str) -> None:
    """Rows in a machine format (tsv, csv): escaped on a terminal (see :func:`terminal_text`),
    elsewhere (a pipe, a file) exactly as stored: click would strip what looks like a colour
    code (``ESC [ ... m``, ``ESC [ 2 J``) from a stored value written to a pipe."""
    if stdout_is_terminal():
        rendered = terminal_text(rendered)
    click.echo(rendered, color=True)


def color() -> bool | None:
    """False when ``NO_COLOR`` is set; otherwise click decides (colour on a terminal only)."""
    return False if os.environ.get("NO_COLOR") else None


#: While a command's output is being gathered for the pager: its lines so far.
_paged: list[str] | None = None
#: ``--no-pager``: never page.
pager_off = False


def echo(text: str = "", *, err: bool = False) -> None:
    if _paged is not None and not err:
        _paged.append(text)
        return
    click.echo(text, err=err, color=color())


def echo_json(value: Any) -> None:
    """``--json``: valid JSON whatever the database holds (an infinite cost as ``null``)."""
    echo(jsontext.dumps(value, ensure_ascii=False, indent=2, default=str))


@contextlib.contextmanager
def pager() -> Iterator[None]:
    """Page what the block prints when it is longer than the terminal (as git and gh do:
    ``$PAGER``, else ``less``); printed as it is when piped, with ``--no-pager``, or when it
    fits."""
    global _paged
    if pager_off or _paged is not None or not stdout_is_terminal():
        yield
        return
    gathered: list[str] = []
    _paged = gathered
    try:
        yield
    finally:
        _paged = None
    text = "\n".join(gathered)
    height = _height()
    if text.count("\n") + 1 >= height:
        click.echo_via_pager(text, color=color())
    elif gathered:
        click.echo(text, color=color())


def paged(command: F) -> F:
    """A command whose output goes through :func:`pager`."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        with pager():
            return command(*args, **kwargs)

    return cast(F, run)


def wrapped(value: object, indent: str = "", *, styled: bool = False) -> str:
    """``value`` wrapped at words to the terminal's width (each paragraph on its own), on a
    terminal only: piped, lines stay whole for grep. A stored value that is no text (a blob,
    a number) is shown as :func:`plain` says; control characters escaped (:func:`terminal_text`;
    ``styled``: ``value`` is text this CLI styled, such as :func:`highlight` returns)."""
    text = terminal_text(plain(value), styled=styled)
    if not stdout_is_terminal():
        return indent + text
    room = max(20, width() - cell_width(indent))
    lines = []
    for paragraph in text.split("\n"):
        lines += [indent + line for line in wrap(paragraph, room)] if paragraph else [indent]
    return "\n".join(lines)


def _terminal(variable: str, axis: str, fallback: int) -> int:
    """One dimension of the terminal: the environment's ``variable`` first, else the
    terminal's own size, else ``fallback`` (no terminal)."""
    given = os.environ.get(variable, "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        size = os.get_terminal_size(sys.__stdout__.fileno())  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError):
        return fallback
    return int(getattr(size, axis))


def _height() -> int:
    """The terminal's height (``LINES`` first), 24 when there is none."""
    return _terminal("LINES", "lines", 24)


def width() -> int:
    """The terminal's width (``COLUMNS`` first), 80 when there is none."""
    return _terminal("COLUMNS", "columns", 80)


# -- values --------------------------------------------------------------------------------------


#: The most bytes of a blob shown in hex where a value is folded to a line.
BLOB_SHOWN = markdown.BLOB_SHOWN


def plain(value: object, *, limit: int | None = None) -> str:
    """A stored value as text: text as it is, a blob as its size and bytes in hex (the first
    ``limit`` bytes), a number as Python prints it (see ``markdown.plain``)."""
    return markdown.plain(value, limit=limit)


def when(ts: object, fmt: str = "%Y-%m-%d %H:%M") -> str:
    """A timestamp for people: local time, the number itself when no date holds it."""
    return timestamps.shown(ts, fmt) if ts is not None else "—"


def iso(ts: object) -> str:
    """A timestamp for machines: local ISO 8601 to the second, empty when missing, the number
    itself when no date holds it (a file the original store wrote may hold any)."""
    if ts is None:
        return ""
    moment = timestamps.moment(ts)
    return moment.isoformat(timespec="seconds") if moment is not None else repr(ts)


def lock_holds(report: StepTally) -> str:
    """How long a paced job's steps held the write lock: a writer beside it waited for one
    step at most, so a step over the bound is a wait the writer was not promised. Each kind
    of step ([steps, over, longest seconds]) is said after."""
    steps, longest_s, over = report.steps, report.longest_step_s, report.steps_over_bound
    bound_s, by_kind = report.bound_s, report.by_kind
    line = (
        f"{steps} step(s); the longest held the write lock {longest_s * 1000:.1f} ms; "
        f"{over} over the {bound_s * 1000:.0f} ms bound."
    )
    if by_kind:
        kinds = ", ".join(
            f"{kind} {int(count):,} (longest {longest * 1000:.1f} ms, {int(late)} over)"
            for kind, (count, late, longest) in by_kind.items()
        )
        line += f" By kind: {kinds}."
    return line


def num(value: object) -> str:
    """A counter with thousands separators; a stored value that is no number (text a file
    the original store wrote holds there) as it is."""
    return markdown.count(value)


def cost(row: RowDict) -> str:
    """The actual cost when known, else the estimate marked with ``~``."""
    money = markdown.money
    if row.get("actual_cost_usd") is not None:
        return f"${money(row['actual_cost_usd'])}"
    if row.get("estimated_cost_usd"):
        return f"~${money(row['estimated_cost_usd'])}"
    return "—"


def fold(text: object, limit: int = 100) -> str:
    """One line of at most ``limit`` characters (used for previews of long content only),
    control characters escaped (:func:`terminal_text`)."""
    flat = " ".join(terminal_text(plain(text, limit=limit)).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def unmark(snippet: str) -> str:
    """A search snippet without its ``>>>match<<<`` markers, on one line."""
    return " ".join(snippet.replace(">>>", "").replace("<<<", "").split())


def highlight(snippet: str) -> str:
    """A search snippet with its ``>>>match<<<`` markers rendered bold, the stored text
    escaped (:func:`terminal_text`): show it with ``styled=True``, as :func:`wrapped` does."""
    parts: list[str] = []
    rest = " ".join(terminal_text(snippet).split())
    while ">>>" in rest:
        before, _, after = rest.partition(">>>")
        match, closed, tail = after.partition("<<<")
        if not closed:
            break
        parts += [before, click.style(match, bold=True)]
        rest = tail
    parts.append(rest)
    return "".join(parts)


# -- cells and wrapping --------------------------------------------------------------------------


def cell_width(text: str) -> int:
    """Terminal cells ``text`` takes: wide (CJK, emoji) characters count two, marks zero."""
    total = 0
    for char in ANSI.sub("", text):
        if unicodedata.combining(char) or char in "\u200b\u200d\ufe0f":
            continue
        total += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return total


def _pad(text: str, size: int, right: bool) -> str:
    space = " " * max(0, size - cell_width(text))
    return space + text if right else text + space


def _split_long(word: str, size: int) -> list[str]:
    pieces, current = [], ""
    for char in word:
        if current and cell_width(current + char) > size:
            pieces.append(current)
            current = ""
        current += char
    return [*pieces, current] if current else pieces


def wrap(text: str, size: int) -> list[str]:
    """``text`` in lines of at most ``size`` cells, broken between words; a word longer than
    a line (a URL, CJK text without spaces) is broken between characters."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if cell_width(candidate) <= size:
            current = candidate
            continue
        if current:
            lines.append(current)
        if cell_width(word) <= size:
            current = word
        else:
            *full, current = _split_long(word, size)
            lines += full
    if current or not lines:
        lines.append(current)
    return lines


# -- tables and rows -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A column of a listing: ``key`` in machine formats, ``title`` on the terminal."""

    key: str
    title: str
    value: Callable[[RowDict], Any]  # the full value for tsv/csv
    # How the terminal shows it (default: str). It may style its cell (click.style): its
    # colour codes are kept, other controls escaped; stored text in it goes through
    # terminal_text before it is styled.
    shown: Callable[[RowDict], str] | None = None
    wraps: bool = False  # text that wraps at words on the terminal
    right: bool = False  # numbers align right
    optional: int = 0  # > 0: may be left out on a narrow terminal, highest first
    cuts: bool = False  # text shortened to one line with "…" on the terminal (whole elsewhere)

    def cell(self, row: RowDict) -> str:
        """The cell as the terminal table shows it: control characters escaped (a cell that
        does not wrap shows newlines and tabs escaped too), see :func:`terminal_text`."""
        one_line = not self.wraps
        if self.shown is not None:
            return terminal_text(self.shown(row), one_line=one_line, styled=True)
        value = self.value(row)
        text = "—" if value is None or value == "" else str(value)
        return terminal_text(text, one_line=one_line)


def escape_tsv(value: Any) -> str:
    """One field of a tab-separated row: tabs, newlines and backslashes escaped (``\\t``,
    ``\\n``, ``\\\\``), as PostgreSQL's COPY text format does, so each row is one line."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else str(value)
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def render_tsv(columns: Sequence[Column], rows: Iterable[RowDict]) -> str:
    lines = ["\t".join(c.key for c in columns)]
    lines += ["\t".join(escape_tsv(c.value(row)) for c in columns) for row in rows]
    return "\n".join(lines)


def render_csv(columns: Sequence[Column], rows: Iterable[RowDict]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([c.key for c in columns])
    for row in rows:
        writer.writerow(["" if (v := c.value(row)) is None else v for c in columns])
    return buffer.getvalue().rstrip("\n")


def _cell_lines(column: Column, text: str, size: int) -> list[str]:
    if column.wraps:
        return wrap(text, size)
    if column.cuts and cell_width(text) > size:
        return [cut(text, size)]
    return [text]


def cut(text: str, size: int) -> str:
    """``text`` shortened to ``size`` cells, ending in "…" when anything was left out."""
    shown = ""
    for char in text:
        if cell_width(shown + char) > size - 1:
            break
        shown += char
    return shown.rstrip() + "…"


def render_table(
    columns: Sequence[Column], rows: Sequence[RowDict], total_width: int | None = None
) -> tuple[str, list[str]]:
    """A terminal table and the titles of optional columns left out for lack of room.

    Fixed columns (ids, numbers, dates) take their widest value whole; wrapping columns share
    what remains, each at least ``MIN_TEXT_WIDTH`` cells (optional columns are dropped first).
    """
    available = width() if total_width is None else total_width
    cells = [[c.cell(row) for c in columns] for row in rows]
    titles = [terminal_text(c.title, one_line=True) for c in columns]
    natural = [
        max([cell_width(titles[i])] + [cell_width(line[i]) for line in cells])
        for i, c in enumerate(columns)
    ]
    keep = list(range(len(columns)))
    hidden: list[str] = []

    def flexible(i: int) -> bool:
        return columns[i].wraps or columns[i].cuts

    def room(indexes: list[int]) -> int:
        fixed = sum(natural[i] for i in indexes if not flexible(i))
        return available - fixed - GAP * (len(indexes) - 1)

    def squeezed(indexes: list[int]) -> bool:
        wrapping = [i for i in indexes if flexible(i)]
        if not wrapping:
            return room(indexes) < 0
        return room(indexes) < MIN_TEXT_WIDTH * len(wrapping) and room(indexes) < sum(
            natural[i] for i in wrapping
        )

    for index in sorted(keep, key=lambda i: -columns[i].optional):
        if not squeezed(keep) or not columns[index].optional:
            break
        keep.remove(index)
        hidden.append(titles[index])
    sizes = dict(enumerate(natural))
    wrapping = [i for i in keep if flexible(i)]
    if wrapping:
        budget = max(room(keep), MIN_TEXT_WIDTH * len(wrapping))
        wanted = {i: natural[i] for i in wrapping}
        # Give each wrapping column what it needs, narrowest first, sharing the rest evenly.
        for count, i in enumerate(sorted(wrapping, key=lambda i: wanted[i])):
            share = budget // (len(wrapping) - count)
            sizes[i] = max(min(wanted[i], share), min(MIN_TEXT_WIDTH, wanted[i]))
            budget -= sizes[i]
    out = [(" " * GAP).join(_pad(titles[i], sizes[i], columns[i].right) for i in keep).rstrip()]
    for line in cells:
        parts = {i: _cell_lines(columns[i], line[i], sizes[i]) for i in keep}
        height = max(len(p) for p in parts.values())
        for depth in range(height):
            out.append(
                (" " * GAP)
                .join(
                    _pad(
                        parts[i][depth] if depth < len(parts[i]) else "", sizes[i], columns[i].right
                    )
                    for i in keep
                )
                .rstrip()
            )
    return "\n".join(out), hidden


def print_rows(
    fmt: str,
    columns: Sequence[Column],
    rows: Sequence[RowDict],
    *,
    json_value: Any = None,
    title: str | None = None,
) -> None:
    """Print a listing in ``fmt``; ``json_value`` replaces the rows in JSON (default: rows).
    The table's values are escaped (:func:`terminal_text`), tsv and csv rows on a terminal
    only; JSON keeps them exact."""
    if fmt == "json":
        echo_json(rows if json_value is None else json_value)
    elif fmt == "tsv":
        _echo_rows(render_tsv(columns, rows))
    elif fmt == "csv":
        _echo_rows(render_csv(columns, rows))
    else:
        if title:
            echo(click.style(terminal_text(title), bold=True))
        table, hidden = render_table(columns, rows)
        echo(table)
        if hidden:
            echo(
                click.style(
                    f"({', '.join(hidden)} left out for width: widen the terminal or use "
                    "--format tsv)",
                    dim=True,
                )
            )


def print_record(fmt: str, record: RowDict, human: Callable[[], None]) -> None:
    """One record: ``human()`` in table format, ``field<TAB>value`` rows, CSV or JSON."""
    if fmt == "json":
        echo_json(record)
        return
    if fmt == "table":
        human()
        return
    columns = [
        Column("field", "field", lambda r: r["field"]),
        Column("value", "value", lambda r: _plain(r["value"])),
    ]
    rows = [{"field": key, "value": value} for key, value in record.items()]
    rendered = render_tsv(columns, rows) if fmt == "tsv" else render_csv(columns, rows)
    _echo_rows(rendered)


def _plain(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return jsontext.dumps(value, ensure_ascii=False)
    return value


def progress(total: int | None, description: str, *, bytes_: bool = False) -> Any:
    """A progress bar on stderr when it is a terminal (rich, imported only then); elsewhere a
    do-nothing stand-in, so pipes and logs stay clean."""
    if not is_terminal(sys.stderr):
        return _NoProgress()
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    counter = DownloadColumn() if bytes_ else MofNCompleteColumn()
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        counter,
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    return _RichProgress(bar, bar.add_task(description, total=total))


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def advance(self, amount: int = 1) -> None:
        return None

    def update(self, done: int, total: int | None) -> None:
        return None


class _RichProgress:
    def __init__(self, bar: Any, task: Any) -> None:
        self.bar, self.task = bar, task

    def __enter__(self) -> _RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def advance(self, amount: int = 1) -> None:
        self.bar.advance(self.task, amount)

    def update(self, done: int, total: int | None) -> None:
        self.bar.update(self.task, completed=done, total=total)
