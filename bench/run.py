"""The one command that writes ``docs/benchmarks.md``, whole, from this checkout.

    python -m bench.run --pg postgresql://postgres@127.0.0.1/test    # the full run
    python -m bench.run --quick --out /tmp/benchmarks.md                # a smoke run

Every section is measured in the run and stamped with the commit it measured (``+dirty`` when
the tree differs from it), the date, and the machine's cores and load average at its start:
nothing in the file is older than the run. It first waits (``--settle``, at most 300 s) for
the load average to fall to half the cores, so a run begun after another job does not
measure that job's tail. Sections, in order:

- ``alone`` and ``load`` (``bench/load.py``): one writer alone per call against the original
  store and the raw floor; writer processes x threads, readers, the hog and the occasional
  writers, each set against the original store in interleaved rounds (``--ours [LABEL=]DIR``,
  repeatable: hermes_store from other checkouts, A/B in the same rounds);
- ``calls``: databases of 10k and 100k messages (``--sizes``), then, interleaved with the
  floor (raw ``sqlite3`` running the original store's statements, or the original store's
  own method): bulk import, ``get_messages``/``iter_messages`` of a long session, search,
  ``list_sessions_rich``, ``iter_export`` with its peak memory;
- ``pg`` (``--pg URL``): the same on PostgreSQL, against the SQLite floor;
- the companion benchmarks, each run as its own module in a fresh process at the sizes the
  time budget allows (``--scale``: the large sizes): ``small_reads``, ``cli_startup``,
  ``search_scale``, ``pg_writes``, ``pg_scale``, ``async_lag``, ``ops``, ``adoption``,
  ``handover``.

``--sections``/``--skip`` choose sections (a section not run is listed as such, never kept
from an older file); ``--quick`` shrinks every section to a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import os
import platform
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python bench/run.py``: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench import load as load_bench
from bench import stamp
from bench.build import build, drop_pg_database, fresh_pg_database, pg_server_version
from bench.corpus import CJK_QUERY, COMMON_WORD, PHRASE, RARE_WORD, Corpus, bulk_batch
from bench.floor import Floor, SeedSessionDB
from bench.timing import Stats, interleaved, peak_memory
from hermes_store import SessionDB

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"1k": 1_000, "10k": 10_000, "100k": 100_000, "1m": 1_000_000}
SEARCHES = (
    ("common word", COMMON_WORD),
    ("rare word", RARE_WORD),
    ("phrase", PHRASE),
    ("CJK", CJK_QUERY),
)
APPEND_SHAPES: tuple[dict[str, Any], ...] = (
    {"role": "user", "content": "Can you check why the deploy server keeps timing out? " * 3},
    {
        "role": "assistant",
        "content": "Let me look at the logs first.",
        "token_count": 42,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "terminal", "arguments": '{"command": "tail log"}'},
            }
        ],
    },
    {
        "role": "tool",
        "content": "error: connection reset by peer\n" * 5,
        "tool_name": "terminal",
        "tool_call_id": "call_1",
    },
)


@dataclass
class Row:
    """One line of a results table."""

    section: str
    operation: str
    size: str
    ours: Stats | None
    floor: Stats | None
    unit: str = "call"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.floor is None or self.floor.median <= 0:
            return None
        return self.ours.median / self.floor.median


@dataclass
class Section:
    """One measured section of the report: its stamp, its markdown, how long it took."""

    key: str
    title: str
    stamp: str
    body: str
    seconds: float
    failed: bool = False


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    builds: list[tuple[str, str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    checks: list[tuple[str, str, bool]] = field(default_factory=list)
    stamps: dict[str, str] = field(default_factory=dict)  #: row section -> stamp at its start
    measured: str = "unknown"  #: the commit measured

    def begin(self, *keys: str) -> None:
        """Stamp row sections as their measurement starts (the first stamp stays)."""
        line = stamp.line(self.measured)
        for key in keys:
            self.stamps.setdefault(key, line)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        print(
            f"  {row.section:10s} {row.operation:34s} {row.size:>5s}  ours {_t(row.ours):>10s}"
            f"  floor {_t(row.floor):>10s}  {ratio:>7s} {row.note}",
            flush=True,
        )


def _t(stats: Stats | None) -> str:
    return "-" if stats is None else fmt_seconds(stats.median)


def fmt_seconds(value: float) -> str:
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def fmt_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _consume(iterator: Iterator[Any]) -> int:
    count = 0
    for _ in iterator:
        count += 1
    return count


def _count_label(total: int) -> str:
    return f"{total // 1000}k" if total >= 1000 else str(total)


def _bulk(store: SessionDB, floor: Floor, batches: int, batch: int) -> dict[str, Stats]:
    """append_messages vs executemany, ``batches`` rounds of ``batch``; per-message stats."""
    store.create_session("long-ours", "bench")
    floor.create_session("long-floor", "bench")
    counter = {"ours": 0, "floor": 0}

    def ours() -> None:
        store.append_messages("long-ours", bulk_batch(counter["ours"], batch))
        counter["ours"] += batch

    def raw() -> None:
        floor.append_many("long-floor", bulk_batch(counter["floor"], batch))
        counter["floor"] += batch

    stats = interleaved({"ours": ours, "floor": raw}, rounds=batches, inner=1, warmup=0)
    return {
        k: Stats(v.median / batch, v.low / batch, v.high / batch, v.rounds, v.calls * batch)
        for k, v in stats.items()
    }


# -- the SQLite sections -------------------------------------------------------------------------


def bench_bulk_and_long(report: Report, path: Path, batches: int, batch: int, rounds: int) -> None:
    """Bulk import (append_messages vs executemany) that builds a long session, then loads it."""
    report.begin("write", "read")
    store = SessionDB(path)
    floor = Floor(path)
    per = _bulk(store, floor, batches, batch)
    report.add(
        Row(
            "write",
            f"bulk import ({batch}/transaction)",
            "-",
            per["ours"],
            per["floor"],
            unit="message",
            note="per message, batch generation included for both",
        )
    )
    total = store.message_count("long-ours")
    seed = SeedSessionDB(path)
    label = _count_label(total)
    get = interleaved(
        {
            "ours": lambda: store.get_messages("long-ours"),
            "floor": lambda: seed.get_messages("long-ours"),
        },
        rounds=rounds,
        inner=1,
        warmup=1,
    )
    report.add(Row("read", "get_messages (one session)", label, get["ours"], get["floor"]))
    paged = interleaved(
        {
            "ours": lambda: _consume(store.iter_messages("long-ours", page_size=1000)),
            "floor": lambda: seed.get_messages("long-ours"),
        },
        rounds=rounds,
        inner=1,
        warmup=0,
    )
    report.add(
        Row(
            "read",
            "iter_messages (keyset pages of 1000)",
            label,
            paged["ours"],
            paged["floor"],
            note="floor: one get_messages",
        )
    )
    seed.close()
    floor.close()
    store.close()


def bench_search(report: Report, path: Path, size: str, rounds: int) -> None:
    report.begin("search")
    store = SessionDB(path)
    seed = SeedSessionDB(path)
    floor = Floor(path)
    for name, query in SEARCHES:
        try:
            hits = len(store.search_messages(query))
        except NotImplementedError:
            report.add(Row("search", f"search: {name}", size, None, None, note="not implemented"))
            continue
        seed_hits = len(seed.search_messages(query))
        bare_query = query if name != "CJK" else None

        def bare(q: str | None = bare_query) -> object:
            return floor.search_bare(q) if q is not None else floor.like_bare(CJK_QUERY)

        stats = interleaved(
            {
                "ours": functools.partial(store.search_messages, query),
                "floor": functools.partial(seed.search_messages, query),
                "bare": bare,
            },
            rounds=rounds,
            inner=1,
            warmup=2,
        )
        note = f"{hits} hits (original store {seed_hits}); bare MATCH+snippet {_t(stats['bare'])}"
        if name == "CJK":
            note = f"{hits} hits (original store {seed_hits}); bare LIKE {_t(stats['bare'])}"
        report.add(
            Row(
                "search",
                f"search: {name} `{query}`",
                size,
                stats["ours"],
                stats["floor"],
                note=note,
                extra={"bare": stats["bare"]},
            )
        )
    seed.close()
    floor.close()
    store.close()


def bench_listing(report: Report, path: Path, size: str, rounds: int) -> None:
    report.begin("listing")
    store = SessionDB(path)
    seed = SeedSessionDB(path)
    try:
        store.list_sessions_rich()
    except NotImplementedError:
        report.add(Row("listing", "list_sessions_rich", size, None, None, note="not implemented"))
        seed.close()
        store.close()
        return
    variants: tuple[tuple[str, dict[str, Any]], ...] = (
        ("list_sessions_rich() first page", {}),
        ("list_sessions_rich(source='telegram')", {"source": "telegram"}),
        ("list_sessions_rich(offset=200)", {"offset": 200}),
    )
    for name, kwargs in variants:
        stats = interleaved(
            {
                "ours": functools.partial(store.list_sessions_rich, **kwargs),
                "floor": functools.partial(seed.list_sessions_rich, **kwargs),
            },
            rounds=rounds,
            inner=1,
            warmup=2,
        )
        report.add(
            Row(
                "listing",
                name,
                size,
                stats["ours"],
                stats["floor"],
                note="ours also projects compression tips",
            )
        )
    seed.close()
    store.close()


def bench_export(report: Report, path: Path, size: str, rounds: int, messages: int) -> None:
    report.begin("export", "memory")
    store = SessionDB(path)
    floor = Floor(path)
    stats = interleaved(
        {
            "ours": lambda: _consume(store.iter_export()),
            "floor": lambda: _consume(floor.iter_export()),
        },
        rounds=rounds,
        inner=1,
        warmup=0,
    )
    report.add(
        Row(
            "export",
            "iter_export (stream every session)",
            size,
            stats["ours"],
            stats["floor"],
            note="floor: the original store's per-session loop",
        )
    )
    gc.collect()
    stream_peak = peak_memory(lambda: _consume(store.iter_export()))
    list_peak = peak_memory(lambda: len(store.export_all()))
    report.memory.append(
        {
            "backend": "sqlite",
            "size": size,
            "messages": messages,
            "stream_peak": stream_peak,
            "list_peak": list_peak,
        }
    )
    print(
        f"  export     peak memory {size}: stream {fmt_bytes(stream_peak)}, "
        f"export_all list {fmt_bytes(list_peak)}",
        flush=True,
    )
    floor.close()
    store.close()


# -- PostgreSQL ------------------------------------------------------------------------------------


def _pg_reads(
    report: Report, store: SessionDB, sqlite_path: Path, size: str, rounds: dict[str, int]
) -> int:
    """Search, listing and export of one PostgreSQL database; returns the export peak."""
    seed = SeedSessionDB(sqlite_path)
    floor = Floor(sqlite_path)
    try:
        for label, query in SEARCHES:
            try:
                hits = len(store.search_messages(query))
            except NotImplementedError:
                report.add(Row("pg", f"search: {label}", size, None, None, note="n/a"))
                continue
            stats = interleaved(
                {
                    "ours": functools.partial(store.search_messages, query),
                    "floor": functools.partial(seed.search_messages, query),
                },
                rounds=rounds["search"],
                warmup=2,
            )
            report.add(
                Row(
                    "pg",
                    f"search: {label} `{query}`",
                    size,
                    stats["ours"],
                    stats["floor"],
                    note=f"{hits} hits",
                )
            )
        try:
            store.list_sessions_rich()
        except NotImplementedError:
            report.add(Row("pg", "list_sessions_rich", size, None, None, note="n/a"))
        else:
            stats = interleaved(
                {"ours": store.list_sessions_rich, "floor": seed.list_sessions_rich},
                rounds=rounds["listing"],
                warmup=2,
            )
            report.add(
                Row("pg", "list_sessions_rich() first page", size, stats["ours"], stats["floor"])
            )
        stats = interleaved(
            {
                "ours": lambda: _consume(store.iter_export()),
                "floor": lambda: _consume(floor.iter_export()),
            },
            rounds=rounds["export"],
            warmup=0,
        )
        report.add(
            Row("pg", "iter_export (stream every session)", size, stats["ours"], stats["floor"])
        )
        return peak_memory(lambda: _consume(store.iter_export()))
    finally:
        floor.close()
        seed.close()


def _pg_writes(
    report: Report, store: SessionDB, work: Path, rounds: dict[str, int], bulk: tuple[int, int]
) -> None:
    """append_message per call, bulk import and the long session, against the SQLite floor."""
    floor_path = work / "bench-pg-floor.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{floor_path}{suffix}").unlink(missing_ok=True)
    SessionDB(floor_path).close()
    floor = Floor(floor_path)
    seed = SeedSessionDB(floor_path)
    try:
        store.create_session("append-ours", "bench")
        floor.create_session("append-floor", "bench")
        shapes, shapes_f = itertools.cycle(APPEND_SHAPES), itertools.cycle(APPEND_SHAPES)
        stats = interleaved(
            {
                "ours": lambda: store.append_message("append-ours", **next(shapes)),
                "floor": lambda: floor.append_message("append-floor", **next(shapes_f)),
            },
            rounds=rounds["append"],
            inner=20,
            warmup=50,
        )
        report.add(Row("pg", "append_message (per call)", "-", stats["ours"], stats["floor"]))
        batches, batch = bulk
        per = _bulk(store, floor, batches, batch)
        report.add(
            Row(
                "pg",
                f"bulk import ({batch}/transaction)",
                "-",
                per["ours"],
                per["floor"],
                unit="message",
                note="per message",
            )
        )
        total = store.message_count("long-ours")
        stats = interleaved(
            {
                "ours": lambda: store.get_messages("long-ours"),
                "floor": lambda: seed.get_messages("long-floor"),
            },
            rounds=rounds["long"],
            warmup=1,
        )
        report.add(
            Row(
                "pg",
                "get_messages (one session)",
                _count_label(total),
                stats["ours"],
                stats["floor"],
            )
        )
    finally:
        seed.close()
        floor.close()


def bench_pg(
    report: Report,
    base: str,
    sizes: list[str],
    rounds: dict[str, int],
    sqlite_paths: dict[str, Path],
    bulk: tuple[int, int],
    corpora: dict[str, Corpus],
    work: Path,
) -> None:
    """The same operations on PostgreSQL; the ratio column is against the SQLite floor."""
    report.begin("pg")
    name = f"hermes_bench_{os.getpid()}"
    try:
        for size in sizes:
            url = fresh_pg_database(base, name).render_as_string(hide_password=False)
            store = SessionDB(url)
            try:
                seconds = build(store, corpora[size])
                report.builds.append(("postgresql", size, seconds))
                print(f"  built PostgreSQL {size} in {seconds:.1f} s", flush=True)
                # What autovacuum does soon after a bulk load: without statistics the planner
                # guesses and scans instead of using the GIN index.
                with store.engine.begin() as conn:
                    conn.exec_driver_sql("ANALYZE")
                peak = _pg_reads(report, store, sqlite_paths[size], size, rounds)
            finally:
                store.close()
            report.memory.append(
                {
                    "backend": "postgresql",
                    "size": size,
                    "messages": corpora[size].messages,
                    "stream_peak": peak,
                    "list_peak": None,
                }
            )
        url = fresh_pg_database(base, name).render_as_string(hide_password=False)
        store = SessionDB(url)
        try:
            _pg_writes(report, store, work, rounds, bulk)
        finally:
            store.close()
    finally:
        drop_pg_database(base, name)


# -- the companion benchmarks: other modules run as they are, in fresh processes -----------------


@dataclass(frozen=True)
class Companion:
    """A benchmark module run in a fresh process; its printout becomes a section.

    ``knobs``: module constants set before its ``main`` runs (the smoke run's sizes, for the
    modules without options for them). ``markers``: the printout's section lies between them.
    ``text``: plain lines, shown as a block."""

    key: str
    title: str
    about: str
    argv: tuple[str, ...] = ()
    knobs: tuple[tuple[str, Any], ...] = ()
    markers: tuple[str, str] | None = None
    text: bool = False
    env: tuple[tuple[str, str], ...] = ()


COMPANIONS = (
    "small_reads",
    "cli_startup",
    "cold_start",
    "search_scale",
    "pg_writes",
    "pg_scale",
    "async_lag",
    "ops",
    "import_speed",
    "scale",
    "doctor_scale",
    "adoption",
    "handover",
)
SECTIONS = ("alone", "load", "calls", "pg", *COMPANIONS)

_COMPANION_BOOT = (
    "import importlib, json, sys\n"
    "name, knobs = sys.argv[1], json.loads(sys.argv[2])\n"
    "module = importlib.import_module(name)\n"
    "for key, value in knobs.items():\n"
    "    setattr(module, key, value)\n"
    "sys.argv = [name, *sys.argv[3:]]\n"
    "sys.exit(module.main() or 0)\n"
)


def _scale_argv(mb: str, sessions: str, runs: str) -> tuple[str, ...]:
    """The arguments of a companion on ``bench/scale.py``'s file: its size, its sessions (of
    51 messages each, as the generator makes them) and the runs."""
    messages = str(int(sessions) * 51)
    return ("--size-mb", mb, "--sessions", sessions, "--messages", messages, "--runs", runs)


def companion(
    key: str, *, quick: bool, scale: bool, pg: str | None, search_db: Path | None
) -> Companion | str:
    """The companion ``key`` at this run's sizes, or why it does not run."""
    size = 0 if quick else 2 if scale else 1  # smoke, default, the large sizes
    if key == "small_reads":
        return Companion(
            key,
            "Small reads: CPU per call against the original store",
            "`bench/small_reads.py`: both stores read one file (200 sessions of 40 messages), "
            "rounds interleaved; the median over rounds of the process CPU time per call.",
            knobs=(("CALLS", 200), ("ROUNDS", 3)) if quick else (),
            text=True,
        )
    if key == "cli_startup":
        return Companion(
            key,
            "CLI start-up",
            "`bench/cli_startup.py`: the CPU time of fresh processes (the command's own, "
            "from the operating system's accounting, so other load does not count).",
            argv=("--runs", "5"),
        )
    if key == "cold_start":
        return Companion(
            key,
            "Cold start: a new process to its first answer",
            "`bench/cold_start.py`: fresh processes that open a `state.db` at head and ask "
            "`get_session` once (and `sessions list` on the CLI), hermes_store against the "
            "original store and the least a SQLAlchemy store can pay (its import, an engine, "
            "one SELECT), measured from outside with `wait4`; the target: at most 0.15 s of "
            "CPU over that floor, no Alembic module loaded.",
            argv=("--rounds", "3" if quick else "7"),
        )
    if key == "search_scale":
        if search_db is None:
            return "needs a built database (the `calls` section builds it)"
        return Companion(
            key,
            "Search at scale",
            "`bench/search_scale.py` on the largest database the `calls` section built "
            "(`--sizes ...,1m` for 1M messages): searches interleaved with the original store, "
            "ranking agreement with BM25, the CJK index's share, append CPU with and without "
            "the CJK index, a search over a 50 MB message.",
            argv=(
                ("--db", str(search_db), "--out", "-", "--rounds", ("3", "15", "15")[size])
                + (("--pg", pg) if pg else ())
            ),
            markers=("<!-- search-scale:begin -->", "<!-- search-scale:end -->"),
        )
    if key == "pg_writes":
        if not pg:
            return "needs `--pg`"
        return Companion(
            key,
            "PostgreSQL writes: round trips and 8x4 load against the code before one-statement "
            "writes",
            "`bench/pg_writes.py`: this checkout (`new`) against the commit before one-statement "
            "writes (`old`, from `git archive`), each in its own processes, interleaved: latency "
            "through a proxy adding 5 ms each way (the round trips counted), then 8x4 load.",
            argv=("--url", pg, "--rounds", "1" if quick else "3")
            + (("--calls", "5", "--ops", "5") if quick else ()),
        )
    if key == "pg_scale":
        if not pg:
            return "needs `--pg`"
        messages = ("2000", "50000", "100000")[size]
        return Companion(
            key,
            "PostgreSQL at scale: export, import, search",
            "`bench/pg_scale.py`: a corpus written through the store into a SQLite file, "
            "imported into PostgreSQL (COPY against INSERT batches against SQLite), exported "
            "(server-side cursors against the paged path against the SQLite floor), searched; "
            "`--scale` adds a 1M-message database built on the server.",
            argv=(
                "--pg",
                pg,
                "--out",
                "-",
                "--messages",
                messages,
                "--rounds",
                "1" if quick else "3",
                "--search-rounds",
                ("1", "5", "15")[size],
            )
            + (("--million",) if scale else ()),
            markers=("<!-- pg-scale:begin -->", "<!-- pg-scale:end -->"),
        )
    if key == "async_lag":
        small = (
            ("ROUNDS", 1),
            ("TASKS", 10),
            ("SESSIONS", 20),
            ("MESSAGES_PER_SESSION", 20),
            ("APPEND_TASKS", 20),
            ("APPEND_THREADS", 4),
            ("APPENDS", 200),
            ("IDLE_SECONDS", 0.5),
        )
        return Companion(
            key,
            "asyncio: event-loop lag and PostgreSQL appends",
            "`bench/async_lag.py`: concurrent tasks call the store on one event loop while a "
            "1 ms ticker records how late each tick wakes (AsyncSessionDB, the sync store on "
            "the loop, the ticker alone); appends through AsyncSessionDB against threads. "
            + ("" if pg else "PostgreSQL: its default server, if one answers."),
            knobs=small if quick else (),
            env=(("HERMES_STORE_BENCH_PG_URL", pg),) if pg else (),
        )
    if key == "ops":
        mb = ("16", "256", "1024")[size]
        shipped = ("--contenders", "backup API (flushed every 4 MiB)")
        return Companion(
            key,
            "Operations under load: a backup while 8 processes write",
            f"`bench/ops.py`: 8 processes append (one commit each, FULL) while a backup copies a "
            f"{mb} MB database, against a baseline phase of the same writers and no backup; "
            "phases interleaved, the order rotating. `--scale`: 1 GB and every backup method.",
            argv=("--size-mb", mb, "--rounds", "1" if quick else "3") + (() if scale else shipped),
        )
    if key == "import_speed":
        messages = ("5000", "204000", "1020000")[size]
        return Companion(
            key,
            "Import: an export restored, in messages per second",
            f"`bench/import_speed.py --mix scale`: an export of {int(messages):,} messages of "
            "`bench/scale.py`'s mix (1,020,000 make its 2 GB file) restored with `hermes-store "
            "import` into a new file (built privately, linked in place), against the same "
            "import into an existing empty file (through the store: WAL, FULL)"
            + ("" if size == 2 else " and bare `sqlite3`'s ceilings")
            + "; fresh process per run, each checked exact. `--scale`: 1,020,000 messages.",
            argv=("--mix", "scale", "--messages", messages, "--existing")
            + ("--runs", "1" if quick else "3")
            + (() if size == 2 else ("--ceiling",)),
            text=False,
        )
    if key == "scale":
        mb, sessions, runs = (("32", "300", "1"), ("256", "2500", "1"), ("2048", "20000", "3"))[
            size
        ]
        return Companion(
            key,
            "A state.db that lives for years: cold open, search, list, backup, prune and "
            "online optimize beside a writer",
            f"`bench/scale.py`: a realistic {mb} MB file ({sessions} sessions of ~51 messages "
            "over 12 months: chat turns, 5-50 KB tool outputs, 5% CJK; built with `hermes-store "
            "import`); on a copy of it, each step in its own process beside one writer process "
            "appending every 50 ms: cold open + first `get_session`, searches (a common, a rare "
            "and a CJK word) and the first page of sessions, against the original store on the "
            "same file, the order alternating; `hermes-store backup`; then `sessions prune "
            "--older-than 274` and `db optimize`. The writer's errors, worst wait and p99, the "
            "file's size at start, most and end against a fresh import of what remains. "
            "`--scale`: 2 GB, 3 runs (10 GB by hand: `--size-mb 10240 --sessions 100000 "
            "--messages 5100000`).",
            argv=_scale_argv(mb, sessions, runs),
        )
    if key == "doctor_scale":
        mb, sessions, runs = (("32", "300", "1"), ("256", "2500", "3"), ("2048", "20000", "3"))[
            size
        ]
        return Companion(
            key,
            "doctor on a large file beside a writer",
            f"`bench/doctor_scale.py`: `hermes-store doctor` (bounded: reads only) and "
            f"`doctor --full` (every entry, on a snapshot copy) on a copy of `bench/scale.py`'s "
            f"{mb} MB file, each in its own process beside one writer process appending every "
            "50 ms: the doctor's time, the writer's errors, worst wait and p99. `--scale`: 2 GB.",
            argv=_scale_argv(mb, sessions, runs),
        )
    if key == "adoption":
        rounds, sessions = (("1", "2000"), ("5", "50000"), ("20", "300000"))[size]
        openers = "2" if quick else "8"
        return Companion(
            key,
            f"Opening a big legacy file: {openers} processes at once",
            f"`bench/adoption.py`: {openers} spawned processes open a file the original store "
            "wrote (schema version 3, no full-text index) at the same moment; one adopts it "
            "(rebuilds the index under the write lock) while the others wait; every round "
            "checks they all succeeded and the file is whole.",
            argv=("--rounds", rounds, "--sessions", sessions, "--openers", openers),
        )
    if key == "handover":
        return Companion(
            key,
            "The writer's turn passed between processes, alone",
            "`bench/handover.py`: 4 processes write with the original store's own code, one "
            "write at a time in turn; only the hand-over differs (a pipe ring, a semaphore "
            "ring, the fair writer queue's turn), so the difference is what a turn costs.",
            argv=("--rounds", "1" if quick else "3") + (("--ops", "100") if quick else ()),
            markers=("<!-- handover:begin -->", "<!-- handover:end -->"),
        )
    raise ValueError(f"unknown companion {key!r}")


def _shown(value: str) -> str:
    """An argument as the report shows it (a URL without its password)."""
    if "://" not in value:
        return value
    try:
        return sa.make_url(value).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return value


def run_companion(job: Companion, measured: str) -> Section:
    """Run ``job`` as it is; its printout (headings one level down) as a section."""
    line = stamp.line(measured)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **dict(job.env)}
    command = shlex.join(["python", "-m", f"bench.{job.key}", *(_shown(a) for a in job.argv)])
    if job.knobs:
        command += " (" + ", ".join(f"{k} = {v}" for k, v in job.knobs) + ")"
    print(f"[{job.key}] {command}", flush=True)
    knobs = json.dumps(dict(job.knobs))
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _COMPANION_BOOT, f"bench.{job.key}", knobs, *job.argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        out, err, failed = done.stdout, done.stderr, done.returncode != 0
        why = f"exit {done.returncode}"
    except subprocess.TimeoutExpired as error:
        out, err, failed, why = str(error.stdout or ""), "", True, "no end within an hour"
    seconds = time.perf_counter() - started
    if job.markers and job.markers[0] in out and job.markers[1] in out:
        out = out[out.index(job.markers[0]) + len(job.markers[0]) : out.index(job.markers[1])]
    lines = [f"#{x}" if x.startswith("#") else x for x in out.strip("\n").splitlines()]
    body = "\n".join(lines).strip()
    if job.text and body:
        body = f"```text\n{body}\n```"
    parts = [job.about, f"This section: `{command}`, {seconds:.0f} s.", body]
    if failed:
        tail = "\n".join(err.strip().splitlines()[-12:])
        parts.append(f"**This section failed** ({why}):\n\n```text\n{tail}\n```")
    print(f"[{job.key}] {'FAILED' if failed else 'done'} in {seconds:.0f} s", flush=True)
    return Section(job.key, job.title, line, "\n\n".join(p for p in parts if p), seconds, failed)


# -- machine and report ----------------------------------------------------------------------------


def machine(pg: str | None) -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpus (nproc)": str(stamp.cores()),
        "cpu model": cpu,
        "memory": _memory(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "sqlalchemy": sa.__version__,
    }
    if pg:
        try:
            import psycopg

            info["postgresql"] = pg_server_version(pg)
            info["psycopg"] = psycopg.__version__
        except Exception as error:  # the report still lists the rest
            info["postgresql"] = f"unavailable ({error})"
    return info


def _memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def targets(report: Report) -> list[str]:
    """The targets, checked against this run's figures."""
    lines = ["## Targets", "", "| target | this run | met |", "|---|---|---|"]
    checks = list(report.checks)

    def ratios(section: str) -> list[tuple[str, float]]:
        return [
            (f"{r.operation} ({r.size})", r.ratio)
            for r in report.rows
            if r.section == section and r.ratio is not None
        ]

    for section, label in (("search", "search"), ("listing", "list_sessions_rich")):
        found = ratios(section)
        if found:
            name, worst = max(found, key=lambda item: item[1])
            checks.append(
                (f"{label} never slower than the floor", f"worst {worst:.2f}x: {name}", worst <= 1)
            )
    sqlite_memory = [m for m in report.memory if m["backend"] == "sqlite"]
    if len(sqlite_memory) >= 2:
        small, large = sqlite_memory[0], sqlite_memory[-1]
        growth = large["stream_peak"] / max(1, small["stream_peak"])
        factor = large["messages"] / max(1, small["messages"])
        checks.append(
            (
                "export memory flat in the number of messages",
                f"{fmt_bytes(small['stream_peak'])} at {small['size']}, "
                f"{fmt_bytes(large['stream_peak'])} at {large['size']} "
                f"({growth:.2f}x for {factor:.0f}x the messages)",
                growth < 2,
            )
        )
    lines += [f"| {t} | {v} | {'yes' if met else 'no'} |" for t, v, met in checks]
    if not checks:
        lines.append("| (no section with targets ran) | - | - |")
    return [*lines, ""]


ROW_SECTIONS = (
    ("write", "Bulk writes (SQLite)"),
    ("read", "Reading one long session (SQLite)"),
    ("search", "Search (SQLite)"),
    ("listing", "Listing (SQLite)"),
    ("export", "Export (SQLite)"),
)
FLOOR_NOTE = (
    "**Floor** = raw stdlib `sqlite3` running the original store's own statements with its "
    "pragmas (WAL, `synchronous` default = FULL, `foreign_keys=ON`, `timeout=1.0`, explicit "
    "`BEGIN IMMEDIATE`, PASSIVE checkpoint every 50 writes); for search, listing and message "
    "loading the floor is the original store's own method (`tests/support/seed_store.py`, its "
    "SQL). Medians over many rounds, the contenders alternating; ratio = ours / floor (below "
    "1.00 is faster than the floor). PostgreSQL databases are `ANALYZE`d after loading, as "
    "autovacuum would do."
)
#: The full run at default settings, and how long it takes on the 2-core machine when nothing
#: else runs (the sections' sizes were chosen for it; a busy machine stretches every section).
FULL_RUN = "python -m bench.run --pg postgresql://postgres@127.0.0.1/test"
FULL_RUN_MINUTES = "about 19 minutes, about 12 without `--pg`,"


def render(
    report: Report,
    info: dict[str, str],
    command: str,
    elapsed: float,
    started: tuple[str, stamp.Settled],
    skipped: dict[str, str],
) -> str:
    date, settled = started
    waited = settled.said()
    out = [
        "# Benchmarks",
        "",
        "Generated whole by `python -m bench.run` (`bench/run.py`); do not edit by hand: rerun "
        "it. Every section was measured in the run that wrote this file and says the commit "
        "it measured (`+dirty`: the tree differed from that commit), when, and the machine's "
        "cores and load average at its start. The machine is shared, so figures are noisy: "
        "compare contenders within a table (they are interleaved, round after round).",
        "",
        f"Full run: `{FULL_RUN}` ({FULL_RUN_MINUTES} on the 2-core machine below when nothing "
        "else runs; `--scale` adds the large sizes: a 1 GB backup, 300k-session adoption, 1M "
        "messages on PostgreSQL, a 1,020,000-message import, a 2 GB file pruned and "
        "optimized 3 times, and takes much "
        "longer; `--scale scale` only the 2 GB file). Smoke run: `python -m bench.run "
        "--quick` (under 2 minutes without `--pg` on a quiet machine, 1 round: it proves the "
        "command works, its figures prove nothing). A/B of two "
        "checkouts of hermes_store in the same interleaved rounds: `python -m bench.run "
        "--sections alone,load --ours base=/path/to/other --ours new=.`.",
        "",
        f"This run: `{command}`: commit `{report.measured}`, started {date}, "
        f"{elapsed / 60:.1f} min, {info['cpus (nproc)']} cores, load average "
        f"{settled.load:.1f} at the start" + (f" ({waited})." if waited else "."),
        "",
        "| section | this run |",
        "|---|---|",
    ]
    ran = {s.key: s for s in report.sections}
    for key in SECTIONS:
        if key in ran:
            state = "**failed**" if ran[key].failed else "ran"
            out.append(f"| {key} | {state}, {ran[key].seconds:.0f} s |")
        elif key in skipped:
            out.append(f"| {key} | not run: {skipped[key]} |")
    out += ["", *targets(report), "## Machine", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in info.items()]
    for section in report.sections:
        out += ["", f"## {section.title}", "", section.stamp, "", section.body]
        if section.key == "calls":
            out += _row_tables(report)
    return "\n".join(out) + "\n"


def _rows_table(rows: Sequence[Row], floor: str = "floor") -> list[str]:
    out = [
        f"| operation | size | hermes_store | {floor} | ratio | p10-p90 ours | notes |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ratio = f"**{r.ratio:.2f}x**" if r.ratio is not None else "-"
        spread = f"{fmt_seconds(r.ours.low)}-{fmt_seconds(r.ours.high)}" if r.ours else "-"
        out.append(
            f"| {r.operation} | {r.size} | {_t(r.ours)} | {_t(r.floor)} | {ratio} "
            f"| {spread} | {r.note} |"
        )
    return out


def _memory_table(entries: Sequence[dict[str, Any]]) -> list[str]:
    out = [
        "| backend | database | iter_export (streamed) | export_all (one list) |",
        "|---|---|---:|---:|",
    ]
    for m in entries:
        listed = fmt_bytes(m["list_peak"]) if m["list_peak"] is not None else "-"
        out.append(
            f"| {m['backend']} | {m['size']} messages | {fmt_bytes(m['stream_peak'])} | {listed} |"
        )
    return out


def _builds_table(builds: Sequence[tuple[str, str, float]]) -> list[str]:
    out = ["| backend | size | seconds |", "|---|---|---:|"]
    return out + [f"| {b} | {s} | {sec:.1f} |" for b, s, sec in builds]


def _row_tables(report: Report) -> list[str]:
    """The single-call tables of the SQLite run, each with the stamp of its start."""
    out = ["", FLOOR_NOTE]
    for key, title in ROW_SECTIONS:
        rows = [r for r in report.rows if r.section == key]
        if rows:
            out += ["", f"### {title}", "", report.stamps.get(key, ""), "", *_rows_table(rows)]
    if report.memory:
        out += [
            "",
            "### Export memory (tracemalloc peak while exporting everything)",
            "",
            report.stamps.get("memory", ""),
            "",
            *_memory_table(report.memory),
        ]
    if report.builds:
        out += [
            "",
            "### Building the databases (through the public API)",
            "",
            *_builds_table(report.builds),
        ]
    if report.notes:
        out += ["", *[f"- {n}" for n in report.notes]]
    return out


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    def listed(value: str) -> set[str]:
        names = {n.strip() for n in value.split(",") if n.strip()}
        unknown = names - set(SECTIONS)
        if unknown:
            parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
        return names

    wanted = listed(args.sections) if args.sections else set(SECTIONS)
    wanted -= listed(args.skip)
    if args.no_load:
        wanted -= {"alone", "load"}
    return [key for key in SECTIONS if key in wanted]


def _fresh(path: Path) -> Path:
    for suffix in ("", "-wal", "-shm", "-writer.lock"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", help="comma list of 1k,10k,100k,1m (10k,100k; quick 1k,10k)")
    parser.add_argument("--pg", metavar="URL", help="also run on this PostgreSQL server")
    parser.add_argument(
        "--out", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown report ('-' for none)"
    )
    parser.add_argument("--quick", action="store_true", help="every section small (a smoke run)")
    parser.add_argument(
        "--scale",
        nargs="?",
        const=",".join(COMPANIONS),
        default="",
        metavar="SECTIONS",
        help="the companions' large sizes (all, or a comma list: `--scale scale`)",
    )
    parser.add_argument(
        "--scale-cache",
        metavar="DIR",
        help="scale, doctor_scale: where their built files are kept (reuse a 2 GB build)",
    )
    parser.add_argument("--sections", default="", help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--skip", default="", help="comma list of sections not to run")
    parser.add_argument("--no-load", action="store_true", help="skip the alone and load sections")
    parser.add_argument(
        "--ours",
        action="append",
        default=[],
        metavar="[LABEL=]DIR",
        help="alone/load: hermes_store from this checkout (repeat to A/B; default this one)",
    )
    parser.add_argument("--before", action="store_true", help="load: also queue and group off")
    parser.add_argument(
        "--ring", action="store_true", help="load: also the strictly fair yardsticks (ring, fifo)"
    )
    parser.add_argument("--rounds", type=int, help="load rounds (5; quick 1)")
    parser.add_argument("--alone-rounds", type=int, help="alone rounds (5; quick 1)")
    parser.add_argument("--ops", type=int, help="load: ops per thread at 8x4 (50; quick 3)")
    parser.add_argument("--calls", type=int, help="alone: ops per run (1000; quick 50)")
    parser.add_argument("--workdir", help="folder for the databases (default: a temp folder)")
    parser.add_argument(
        "--settle",
        type=float,
        metavar="SECONDS",
        help="first wait at most this long for the 1-minute load average to fall to half the "
        "cores (300; quick 0: no wait)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep a database already built in --workdir (build 1M once, outside the checkout)",
    )
    args = parser.parse_args(argv)
    q = args.quick
    chosen = _chosen(parser, args)
    large_sizes = {n.strip() for n in args.scale.split(",") if n.strip()}
    if large_sizes - set(COMPANIONS):
        parser.error(f"--scale takes companions: {', '.join(COMPANIONS)}")
    sizes = [s.strip().lower() for s in (args.sizes or ("1k,10k" if q else "10k,100k")).split(",")]
    for size in sizes:
        if size not in SIZES:
            parser.error(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    pg = args.pg
    if pg:
        url = sa.make_url(pg)
        if url.drivername in ("postgresql", "postgres"):
            pg = url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    rounds = {
        "search": 5 if q else 25,
        "listing": 5 if q else 40,
        "export": 1 if q else 3,
        "long": 2 if q else 5,
    }
    bulk = (10, 200) if q else (100, 1000)
    started = time.perf_counter()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out).resolve() if args.out != "-" else None
    ignore = ["docs/benchmarks.md"]  # the report is not the code it measures
    if out_path is not None and out_path.is_relative_to(ROOT):
        ignore.append(str(out_path.relative_to(ROOT)))
    report = Report(measured=stamp.commit(ROOT, ignore))
    settle = args.settle if args.settle is not None else 0.0 if q else 300.0
    settled = stamp.settle(stamp.cores() / 2 if settle > 0 else 0.0, settle)
    began = (stamp.now(), settled)
    info = machine(pg)
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    print(f"measuring commit {report.measured}; sections {', '.join(chosen)}", flush=True)
    skipped: dict[str, str] = {key: "not chosen" for key in SECTIONS if key not in chosen}
    checkouts = load_bench.parse_ours(args.ours)

    if "alone" in chosen:
        print("[alone]", flush=True)
        line, t0 = stamp.line(report.measured), time.perf_counter()
        part = load_bench.alone(
            args.alone_rounds or (1 if q else 5),
            args.calls or (50 if q else 1000),
            work,
            checkouts=checkouts,
        )
        report.checks += part.checks
        report.sections.append(
            Section(
                "alone",
                "One writer alone, per call (SQLite)",
                line,
                part.markdown,
                time.perf_counter() - t0,
                bool(part.failures),
            )
        )
    if "load" in chosen:
        print("[load]", flush=True)
        line, t0 = stamp.line(report.measured), time.perf_counter()
        part = load_bench.compare(
            args.rounds or (1 if q else 5),
            args.ops or (3 if q else 50),
            work,
            checkouts=checkouts,
            before=args.before,
            ring=args.ring,
            pg=pg,
        )
        report.checks += part.checks
        report.sections.append(
            Section(
                "load",
                "Load: writer processes x threads, readers, a hog (SQLite"
                + (", and 8x4 on PostgreSQL)" if pg else ")"),
                line,
                part.markdown,
                time.perf_counter() - t0,
                bool(part.failures),
            )
        )

    paths: dict[str, Path] = {}
    corpora: dict[str, Corpus] = {}
    if {"calls", "pg", "search_scale"} & set(chosen):
        line, t0 = stamp.line(report.measured), time.perf_counter()
        for size in sizes:
            corpora[size] = Corpus(SIZES[size])
            path = work / f"bench-{size}.db"
            if args.reuse and path.exists():
                paths[size] = path
                SessionDB(path).close()  # at head (an older build gains the CJK index here)
                print(f"reusing {path}", flush=True)
                continue
            store = SessionDB(_fresh(path))
            seconds = build(store, corpora[size])
            store.close()
            paths[size] = path
            report.builds.append(("sqlite", size, seconds))
            print(
                f"built {size}: {len(corpora[size].plans)} sessions in {seconds:.1f} s", flush=True
            )
        if "calls" in chosen:
            for size in sizes:
                print(f"[calls {size}]", flush=True)
                bench_search(report, paths[size], size, rounds["search"])
                bench_listing(report, paths[size], size, rounds["listing"])
                bench_export(report, paths[size], size, rounds["export"], corpora[size].messages)
            print("[calls: bulk writes, long session]", flush=True)
            long_path = _fresh(work / "bench-long.db")
            bench_bulk_and_long(report, long_path, bulk[0], bulk[1], rounds["long"])
            if len(report.memory) >= 2:
                small, large = report.memory[0], report.memory[-1]
                growth = large["stream_peak"] / max(1, small["stream_peak"])
                report.notes.append(
                    f"Export memory: streaming {large['size']} messages peaks at {growth:.2f}x "
                    f"the peak for {small['size']} ({large['messages'] // small['messages']}x "
                    "the messages); `iter_export` holds one page of sessions and one session's "
                    "messages at a time, so its peak follows the largest session, not the "
                    "database."
                )
            report.sections.append(
                Section(
                    "calls",
                    "Single calls against the floor (SQLite)",
                    line,
                    f"Databases of {', '.join(sizes)} messages (`bench/corpus.py`), built "
                    "through the public API.",
                    time.perf_counter() - t0,
                )
            )

    if "pg" in chosen:
        if not pg:
            skipped["pg"] = "needs `--pg`"
        else:
            print("[pg]", flush=True)
            line, t0 = stamp.line(report.measured), time.perf_counter()
            rows_before, memory_before = len(report.rows), len(report.memory)
            builds_before = len(report.builds)
            bench_pg(
                report, pg, sizes, {**rounds, "append": 10 if q else 80}, paths, bulk, corpora, work
            )
            body = [
                "The same calls on PostgreSQL (a scratch database per size, dropped afterwards); "
                "the ratio is against the SQLite floor on the same corpus.",
                "",
                *_rows_table(report.rows[rows_before:], "SQLite floor"),
                "",
                "Export memory (tracemalloc peak while exporting everything):",
                "",
                *_memory_table(report.memory[memory_before:]),
                "",
                "Building the databases (through the public API):",
                "",
                *_builds_table(report.builds[builds_before:]),
            ]
            del report.rows[rows_before:], report.memory[memory_before:]
            del report.builds[builds_before:]
            report.sections.append(
                Section(
                    "pg",
                    "Single calls on PostgreSQL",
                    line,
                    "\n".join(body),
                    time.perf_counter() - t0,
                )
            )

    largest = paths[max(paths, key=lambda s: SIZES[s])] if paths else None
    for key in COMPANIONS:
        if key not in chosen:
            continue
        job = companion(key, quick=q, scale=key in large_sizes, pg=pg, search_db=largest)
        if key in ("scale", "doctor_scale") and args.scale_cache and not isinstance(job, str):
            job = dataclasses.replace(job, argv=(*job.argv, "--cache", args.scale_cache))
        if isinstance(job, str):
            skipped[key] = job
            print(f"[{key}] not run: {job}", flush=True)
            continue
        report.sections.append(run_companion(job, report.measured))

    elapsed = time.perf_counter() - started
    shown = [_shown(a) for a in (argv if argv is not None else sys.argv[1:])]
    command = ("python -m bench.run " + " ".join(shown)).strip()
    text = render(report, info, command, elapsed, began, skipped)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text, encoding="utf-8")
        print(f"wrote {out_path} ({elapsed / 60:.1f} min)")
    else:
        print(text)
    failed = [s.key for s in report.sections if s.failed]
    if failed:
        print(f"failed sections: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
