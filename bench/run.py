"""One command, side by side in one run: hermes_store against the raw-sqlite3 floor.

    .venv/bin/python -m bench.run [--sizes 10k,100k[,1m]] [--pg URL] [--out docs/benchmarks.md]

Builds databases of 10k and 100k messages (1M with ``--sizes 10k,100k,1m``), then times, with
contenders interleaved round after round and medians reported: ``append_message`` per call,
bulk import, search (common word, rare word, phrase, CJK), ``list_sessions_rich``,
``get_messages`` of a 100k-message session, ``iter_export`` streaming with its peak memory, and
a multi-process load run (write latency p50/p99/max); with ``--pg`` the same on PostgreSQL.
Writes the tables and the machine to ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python bench/run.py``: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench import load as load_bench
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
class Report:
    rows: list[Row] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    loads: list[load_bench.LoadResult] = field(default_factory=list)
    builds: list[tuple[str, str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

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


def bench_append(report: Report, path: Path, rounds: int, label: str = "sqlite") -> None:
    """append_message per call: ours, the lean floor, and the original store class, on one file."""
    store = SessionDB(path)
    floor = Floor(path)
    seed = SeedSessionDB(path)
    for sid in ("append-ours", "append-floor", "append-seed"):
        store.create_session(sid, "bench")
    shapes = itertools.cycle(APPEND_SHAPES)
    shapes_f = itertools.cycle(APPEND_SHAPES)
    shapes_s = itertools.cycle(APPEND_SHAPES)
    stats = interleaved(
        {
            "ours": lambda: store.append_message("append-ours", **next(shapes)),
            "floor": lambda: floor.append_message("append-floor", **next(shapes_f)),
            "seed": lambda: seed.append_message("append-seed", **next(shapes_s)),
        },
        rounds=rounds,
        inner=20,
        warmup=50,
    )
    counts = {sid: store.message_count(sid) for sid in ("append-ours", "append-floor")}
    note = f"seed class {fmt_seconds(stats['seed'].median)}; {counts['append-ours']} appends each"
    report.add(
        Row(
            "write",
            "append_message (per call)",
            "-",
            stats["ours"],
            stats["floor"],
            note=note,
            extra={"seed": stats["seed"]},
        )
    )
    seed.close()
    floor.close()
    store.close()


def bench_bulk_and_long(report: Report, path: Path, batches: int, batch: int, rounds: int) -> None:
    """Bulk import (append_messages vs executemany) that builds a long session, then loads it."""
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
                "ours": lambda q=query: store.search_messages(q),
                "floor": lambda q=query: seed.search_messages(q),
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
    store = SessionDB(path)
    seed = SeedSessionDB(path)
    try:
        store.list_sessions_rich()
    except NotImplementedError:
        report.add(Row("listing", "list_sessions_rich", size, None, None, note="not implemented"))
        seed.close()
        store.close()
        return
    variants = (
        ("list_sessions_rich() first page", {}),
        ("list_sessions_rich(source='telegram')", {"source": "telegram"}),
        ("list_sessions_rich(offset=200)", {"offset": 200}),
    )
    for name, kwargs in variants:
        stats = interleaved(
            {
                "ours": lambda kw=kwargs: store.list_sessions_rich(**kw),
                "floor": lambda kw=kwargs: seed.list_sessions_rich(**kw),
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
                    "ours": lambda q=query: store.search_messages(q),
                    "floor": lambda q=query: seed.search_messages(q),
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
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpus (nproc)": str(len(os.sched_getaffinity(0))),
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
    """The issue's targets, checked against this run's figures."""
    lines = ["## Targets", "", "| target | this run | met |", "|---|---|---|"]

    def ratios(section: str, prefix: str = "") -> list[tuple[str, float]]:
        return [
            (f"{r.operation} ({r.size})", r.ratio)
            for r in report.rows
            if r.section == section and r.operation.startswith(prefix) and r.ratio is not None
        ]

    append = ratios("write", "append_message")
    if append:
        worst = max(ratio for _, ratio in append)
        lines.append(f"| append_message <= 1.2x the floor | {worst:.2f}x | "
                     f"{'yes' if worst <= 1.2 else 'no'} |")  # fmt: skip
    for section, label in (("search", "search"), ("listing", "list_sessions_rich")):
        found = ratios(section)
        if found:
            name, worst = max(found, key=lambda item: item[1])
            lines.append(f"| {label} never slower than the floor | worst {worst:.2f}x: {name} "
                         f"| {'yes' if worst <= 1.0 else 'no'} |")  # fmt: skip
    sqlite_memory = [m for m in report.memory if m["backend"] == "sqlite"]
    if len(sqlite_memory) >= 2:
        small, large = sqlite_memory[0], sqlite_memory[-1]
        growth = large["stream_peak"] / max(1, small["stream_peak"])
        factor = large["messages"] / max(1, small["messages"])
        lines.append(
            f"| export memory flat in the number of messages | {fmt_bytes(small['stream_peak'])}"
            f" at {small['size']}, {fmt_bytes(large['stream_peak'])} at {large['size']} "
            f"({growth:.2f}x for {factor:.0f}x the messages) | {'yes' if growth < 2 else 'no'} |"
        )
    for load in report.loads:
        lines.append(
            f"| load ({load.backend}): zero errors, exact totals | {len(load.errors)} errors, "
            f"totals {'exact' if load.totals_ok else 'WRONG'} "
            f"| {'yes' if not load.errors and load.totals_ok else 'no'} |"
        )
    return [*lines, ""]


def render(report: Report, info: dict[str, str], command: str, elapsed: float) -> str:
    out = [
        "# Benchmarks",
        "",
        "Generated by `bench/run.py` in one run; do not edit by hand. Every figure is the "
        "median over many interleaved rounds (contenders alternate round after round, so "
        "drift on a noisy machine hits both alike). **Floor** = raw stdlib `sqlite3` running "
        "the original store's own statements with its pragmas (WAL, `synchronous` default = "
        "FULL, `foreign_keys=ON`, `timeout=1.0`, explicit `BEGIN IMMEDIATE`, PASSIVE "
        "checkpoint every 50 writes); for search, listing and message loading the floor is "
        "the original store's own method (`tests/support/seed_store.py`, its SQL). "
        "Ratio = ours / floor "
        "(lower is better; below 1.00 is faster than the floor). The PostgreSQL databases are "
        "`ANALYZE`d after loading, as autovacuum would do.",
        "",
        f"This run: `{command}` ({elapsed / 60:.1f} min). To reproduce: "
        "`.venv/bin/python -m bench.run` (SQLite: 10k and 100k messages, about 5 minutes); "
        "add `--pg postgresql://USER@HOST/DB` for the PostgreSQL rows and the PostgreSQL load "
        "run (a scratch database is created on that server and dropped afterwards), "
        "`--sizes 10k,100k,1m` for the 1M-message database, `--quick` for a smoke run, "
        "`--out -` to leave this file alone.",
        "",
        *targets(report),
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    out += [f"| {k} | {v} |" for k, v in info.items()]
    sections = (
        ("write", "Writes (SQLite)"),
        ("read", "Reading one long session (SQLite)"),
        ("search", "Search (SQLite)"),
        ("listing", "Listing (SQLite)"),
        ("export", "Export (SQLite)"),
        ("pg", "PostgreSQL (ratio against the SQLite floor)"),
    )
    for key, title in sections:
        rows = [r for r in report.rows if r.section == key]
        if not rows:
            continue
        out += [
            "",
            f"## {title}",
            "",
            "| operation | size | hermes_store | floor | ratio | p10-p90 ours | notes |",
            "|---|---|---:|---:|---:|---|---|",
        ]
        for r in rows:
            ratio = f"**{r.ratio:.2f}x**" if r.ratio is not None else "-"
            spread = f"{fmt_seconds(r.ours.low)}-{fmt_seconds(r.ours.high)}" if r.ours else "-"
            out.append(
                f"| {r.operation} | {r.size} | {_t(r.ours)} | {_t(r.floor)} | {ratio} "
                f"| {spread} | {r.note} |"
            )
    if report.memory:
        out += [
            "",
            "## Export memory (tracemalloc peak while exporting everything)",
            "",
            "| backend | database | iter_export (streamed) | export_all (one list) |",
            "|---|---|---:|---:|",
        ]
        for m in report.memory:
            listed = fmt_bytes(m["list_peak"]) if m["list_peak"] is not None else "-"
            out.append(
                f"| {m['backend']} | {m['size']} messages | {fmt_bytes(m['stream_peak'])} "
                f"| {listed} |"
            )
    if report.loads:
        out += [
            "",
            "## Load: 8 writer processes x threads, 2 processes searching and listing",
            "",
            "| backend | writers x threads x ops | writes | p50 | p99 | max | writes/s "
            "| reads (p50) | errors | totals exact |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---|",
        ]
        for load in report.loads:
            s = load.summary()
            reads = (
                "unavailable"
                if load.reads_unavailable and not load.read_latencies
                else (f"{int(s['reads'])} ({s['read_p50_ms']:.1f} ms)")
            )
            out.append(
                f"| {load.backend} | {load.writers} x {load.threads} x {load.ops} | {load.writes} "
                f"| {s['write_p50_ms']:.2f} ms | {s['write_p99_ms']:.1f} ms "
                f"| {s['write_max_ms']:.1f} ms | {s['writes_per_s']:.0f} | {reads} "
                f"| {len(load.errors)} | {'yes' if load.totals_ok else 'NO'} |"
            )
        out += [
            "",
            "Each op is one `append_message` and one incremental `update_token_counts`"
            " on the same shared session (both timed as writes). Latency includes waiting "
            "for the lock across processes (SQLite: BEGIN IMMEDIATE + jittered retry).",
        ]
    if report.builds:
        out += [
            "",
            "## Building the databases (through the public API)",
            "",
            "| backend | size | seconds |",
            "|---|---|---:|",
        ]
        out += [f"| {b} | {s} | {sec:.1f} |" for b, s, sec in report.builds]
    if report.notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10k,100k", help="comma list of 1k,10k,100k,1m")
    parser.add_argument("--pg", metavar="URL", help="also run on this PostgreSQL server")
    parser.add_argument(
        "--out", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown report ('-' for none)"
    )
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--no-load", action="store_true", help="skip the load benchmark")
    parser.add_argument("--workdir", help="folder for the databases (default: a temp folder)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep a database already built in --workdir (build 1M once, outside the checkout)",
    )
    args = parser.parse_args(argv)
    sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    for size in sizes:
        if size not in SIZES:
            parser.error(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    q = args.quick
    rounds = {
        "append": 10 if q else 80,
        "search": 5 if q else 25,
        "listing": 5 if q else 40,
        "export": 1 if q else 3,
        "long": 2 if q else 5,
    }
    bulk = (10, 200) if q else (100, 1000)
    started = time.perf_counter()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    report = Report()
    info = machine(args.pg)
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)

    paths: dict[str, Path] = {}
    corpora: dict[str, Corpus] = {}
    for size in sizes:
        corpora[size] = Corpus(SIZES[size])
        path = work / f"bench-{size}.db"
        if args.reuse and path.exists():
            paths[size] = path
            SessionDB(path).close()  # at head (an older build gains the CJK index here)
            print(f"reusing {path}", flush=True)
            continue
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        store = SessionDB(path)
        seconds = build(store, corpora[size])
        store.close()
        paths[size] = path
        report.builds.append(("sqlite", size, seconds))
        print(f"built {size}: {len(corpora[size].plans)} sessions in {seconds:.1f} s", flush=True)

    for size in sizes:
        print(f"[{size}]", flush=True)
        bench_search(report, paths[size], size, rounds["search"])
        bench_listing(report, paths[size], size, rounds["listing"])
        bench_export(report, paths[size], size, rounds["export"], corpora[size].messages)
    print("[writes]", flush=True)
    bench_append(report, paths[sizes[0]], rounds["append"])
    long_path = work / "bench-long.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{long_path}{suffix}").unlink(missing_ok=True)
    bench_bulk_and_long(report, long_path, bulk[0], bulk[1], rounds["long"])
    if len(report.memory) >= 2:
        small, large = report.memory[0], report.memory[-1]
        growth = large["stream_peak"] / max(1, small["stream_peak"])
        report.notes.append(
            f"Export memory: streaming {large['size']} messages peaks at {growth:.2f}x the peak "
            f"for {small['size']} ({large['messages'] // small['messages']}x the messages); "
            "`iter_export` holds one page of sessions and one session's messages at a time, "
            "so its peak follows the largest session, not the database."
        )

    if args.pg:
        print("[postgresql]", flush=True)
        bench_pg(report, args.pg, sizes, rounds, paths, bulk, corpora, work)

    if not args.no_load:
        print("[load]", flush=True)
        ops = 25 if q else 100
        path = work / "bench-load.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        load_bench.prepare(str(path))
        report.loads.append(load_bench.run_load(str(path), "sqlite", ops=ops))
        floor_path = work / "bench-load-floor.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{floor_path}{suffix}").unlink(missing_ok=True)
        load_bench.prepare(str(floor_path))
        report.loads.append(load_bench.run_load(str(floor_path), "sqlite", ops=ops, kind="seed"))
        if args.pg:
            name = f"hermes_bench_load_{os.getpid()}"
            url = fresh_pg_database(args.pg, name).render_as_string(hide_password=False)
            try:
                load_bench.prepare(url)
                report.loads.append(load_bench.run_load(url, "postgresql", ops=ops))
            finally:
                drop_pg_database(args.pg, name)
        for load in report.loads:
            print(
                f"  load {load.backend}: {load.summary()} errors={len(load.errors)} "
                f"totals_ok={load.totals_ok} {load.errors[:3]}",
                flush=True,
            )

    elapsed = time.perf_counter() - started
    shown = [
        a if a != args.pg else sa.make_url(a).render_as_string(hide_password=True)
        for a in (argv if argv is not None else sys.argv[1:])
    ]
    command = "python -m bench.run " + " ".join(shown)
    text = render(report, info, command.strip(), elapsed)
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        old = out.read_text(encoding="utf-8") if out.exists() else ""
        begin, end = "<!-- search-scale:begin -->", "<!-- search-scale:end -->"
        if begin in old and end in old:  # keep bench.search_scale's section
            text += "\n" + old[old.index(begin) : old.index(end) + len(end)] + "\n"
        out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out} ({elapsed / 60:.1f} min)")
    failed = [load for load in report.loads if load.errors or not load.totals_ok]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
