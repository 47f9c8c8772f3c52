"""Import speed: a realistic export restored into a new database, in messages per second.

    .venv/bin/python -m bench.import_speed [--messages 100000] [--runs 3] [--backend sqlite]

The export is what an agent's ``state.db`` holds (built once per size and seed, cached under
the temp folder): sessions with a system prompt of a few KB, chat turns (user 20-400
characters, assistant 50-1,500, some with reasoning), assistant turns that call a tool followed
by the tool's output of 5-50 KB (log lines, paths, numbers), 5% of all messages carrying
Chinese text, titles, parents, counters and costs with every digit. Each run imports it into a
new database (a new SQLite file, or an emptied PostgreSQL database) with ``hermes-store
import`` (into a new SQLite file: ``transfer.import_new_file``, built privately and linked in
place), in a fresh process, and is checked: the database then exports the same bytes, and the
full-text index passes FTS5's integrity check. Printed: per run the wall time, the CPU time of
the process, messages/s on the wall clock and on CPU; then the median [min..max] of the runs
(``--before DIR`` runs another checkout in the same, interleaved rounds; ``--existing`` the
import into an existing empty file, through the store; ``--mix scale`` uses
``bench/scale.py``'s 2 GB mix instead: 1,020,000 messages make its 2 GB file).

``--ceiling`` adds, in the same rounds, what bare ``sqlite3`` does with the same messages (read
from the file before the clock starts, inserted in id order in one transaction, FTS5 with its
default settings): ``raw rows`` (the messages table only), ``raw fts`` (the full-text table
only) and ``raw rows+fts`` (both: what no import of this schema can beat on one core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import exports
from bench.timing import spread

ROOT = Path(__file__).resolve().parents[1]


def build_export(path: Path, messages: int, seed: int, tool_calls_per_turn: float = 0.4) -> None:
    """Write the export file (newest session first, as ``export`` writes it)."""
    _write_newest_first(path, list(exports.agent_export_lines(messages, seed, tool_calls_per_turn)))


def _write_newest_first(path: Path, records: list[dict[str, Any]]) -> None:
    """The records as an export file, newest session first (as ``export`` writes them)."""
    partial = path.with_suffix(".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        for record in reversed(records):
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    partial.replace(path)


def build_scale_export(path: Path, messages: int) -> None:
    """The export of ``bench/scale.py``'s realistic file at ``messages`` (2 GB per 1,020,000:
    sessions of ~51 messages over 12 months, 5-50 KB tool outputs, 5% CJK)."""
    size_mb = max(1, round(messages * SCALE_MB_PER_MESSAGE))
    sessions = max(1, messages // 51)
    share = exports.tool_share(size_mb, messages)
    _write_newest_first(
        path, list(exports.year_export_lines(sessions, messages, share, time.time()))
    )


#: ``bench/scale.py``'s file: 2,048 MB for 1,020,000 messages.
SCALE_MB_PER_MESSAGE = 2048 / 1_020_000


def cached_export(messages: int, seed: int, tool_calls_per_turn: float, mix: str = "agent") -> Path:
    """The export file for these parameters, built once under the temp folder."""
    folder = Path(tempfile.gettempdir()) / "hermes-import-bench"
    folder.mkdir(exist_ok=True)
    name = f"{mix}-{messages}" if mix == "scale" else f"{messages}-{seed}-{tool_calls_per_turn:g}"
    path = folder / f"export-{name}.jsonl"
    if not path.exists():
        started = time.perf_counter()
        if mix == "scale":
            build_scale_export(path, messages)
        else:
            build_export(path, messages, seed, tool_calls_per_turn)
        print(f"(built {path.name}: {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return path


def fresh_target(backend: str, folder: Path, run: int) -> str:
    """A new database: a SQLite file that does not exist yet, or an emptied PostgreSQL one."""
    if backend == "sqlite":
        return str(folder / f"run-{run}.db")
    import sqlalchemy as sa

    base = sa.make_url(os.environ["HERMES_STORE_TEST_PG_URL"])
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql('DROP DATABASE IF EXISTS "hermes_import_bench" WITH (FORCE)')
        conn.exec_driver_sql('CREATE DATABASE "hermes_import_bench"')
    admin.dispose()
    return base.set(database="hermes_import_bench").render_as_string(hide_password=False)


def import_once(target: str, export: Path, pythonpath: Path) -> tuple[float, float]:
    """``hermes-store --db TARGET import EXPORT`` in a fresh process: its wall and CPU seconds
    (user + system, from ``wait4``)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "HERMES_HOME": str(export.parent)}
    env.pop("HERMES_STORE_URL", None)
    argv = [sys.executable, "-m", "hermes_store", "--db", target, "import", str(export), "--json"]
    started = time.perf_counter()
    child = subprocess.Popen(
        argv, env=env, cwd=export.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert child.stdout is not None and child.stderr is not None
    out, err = child.stdout.read(), child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the import failed:\n{err.decode()}")
    json.loads(out)
    return wall, usage.ru_utime + usage.ru_stime


def check_exact(target: str, export: Path) -> None:
    """The database exports what the file holds, value for value (floats bit for bit), and its
    full-text indexes are sound."""
    from hermes_store import SessionDB

    with SessionDB(target) as store, open(export, "rb") as handle:
        exported = {record["id"]: record for record in store.iter_export()}
        for line in handle:
            record = json.loads(line)
            got = exported.pop(record["id"])
            for key, value in record.items():
                if got[key] != value:  # type: ignore[literal-required]
                    raise SystemExit(f"{record['id']}: {key} differs after the import")
        if exported:
            raise SystemExit(f"{len(exported)} sessions the file does not hold")
        if not store.check_search_index():
            raise SystemExit("the full-text index failed its check after the import")


RAW_SIDES = ("raw rows", "raw fts", "raw rows+fts")
#: The import as a restore runs it: into a file that does not exist yet.
NEW_FILE = "hermes_store, into a new file"
#: What an import into a new SQLite file should reach on the 2-core machine (messages/s).
TARGET_RATE = 20_000
#: The side importing into a database that exists (empty, at head): the import through the
#: store (WAL, FULL), as every import ran before a new file was built privately.
EXISTING = "hermes_store, into an existing file"


def _create_empty(target: str, pythonpath: Path) -> None:
    """An empty database at head at ``target``, made by a process of that checkout."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    env.pop("HERMES_STORE_URL", None)
    argv = [sys.executable, "-P", "-m", "hermes_store", "--db", target, "db", "upgrade"]
    subprocess.run(argv, env=env, check=True, capture_output=True)


_RAW_SCHEMA = (
    "CREATE TABLE messages (id INTEGER PRIMARY KEY, content TEXT)",
    "CREATE VIRTUAL TABLE messages_fts USING fts5(content, content=messages, content_rowid=id)",
)


def raw_insert(export: Path, target: Path, what: str) -> None:
    """(child process) Insert the export's messages with bare ``sqlite3``, WAL and
    ``synchronous=FULL`` as the store writes; print the insert's wall and CPU seconds."""
    import sqlite3

    with open(export, "rb") as handle:
        rows = sorted(
            (message["id"], message["content"])
            for line in handle
            for message in json.loads(line)["messages"]
        )
    conn = sqlite3.connect(target, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    for statement in _RAW_SCHEMA:
        conn.execute(statement)
    started, cpu = time.perf_counter(), time.process_time()
    conn.execute("BEGIN")
    if "rows" in what:
        conn.executemany("INSERT INTO messages (id, content) VALUES (?, ?)", rows)
    if "fts" in what:
        conn.executemany("INSERT INTO messages_fts (rowid, content) VALUES (?, ?)", rows)
    conn.execute("COMMIT")
    conn.close()
    print(json.dumps([time.perf_counter() - started, time.process_time() - cpu]))


def raw_once(target: str, export: Path, what: str) -> tuple[float, float]:
    """:func:`raw_insert` in a fresh process: its wall and CPU seconds."""
    argv = [sys.executable, "-m", "bench.import_speed", "--raw", what, str(export), target]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    wall, cpu = json.loads(out)
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument(
        "--tool-calls", type=float, default=0.4, help="share of assistant turns calling a tool"
    )
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--before", type=Path, help="another checkout, in the same rounds")
    parser.add_argument(
        "--ceiling", action="store_true", help="bare sqlite3 on the same messages, same rounds"
    )
    parser.add_argument(
        "--mix",
        choices=("agent", "scale"),
        default="agent",
        help="agent: this module's export (heavy tool outputs); scale: bench/scale.py's 2 GB mix",
    )
    parser.add_argument(
        "--existing",
        action="store_true",
        help="also into an existing empty database (the import through the store, WAL+FULL)",
    )
    parser.add_argument("--raw", nargs=3, metavar=("WHAT", "EXPORT", "DB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        raw_insert(Path(args.raw[1]), Path(args.raw[2]), args.raw[0])
        return
    export = cached_export(args.messages, args.seed, args.tool_calls, args.mix)
    sides = {NEW_FILE: ROOT}
    if args.existing and args.backend == "sqlite":
        sides[EXISTING] = ROOT
    if args.before is not None:
        sides["before"] = args.before.resolve()
    if args.ceiling and args.backend == "sqlite":
        sides.update({side: ROOT for side in RAW_SIDES})
    megabytes = export.stat().st_size / 1e6
    load_before = os.getloadavg()[0]
    samples: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="import-bench-") as scratch:
        names = list(sides)
        for run in range(max(3, args.runs)):
            for side in names[run % len(names) :] + names[: run % len(names)]:
                target = fresh_target(args.backend, Path(scratch), run)
                if side in RAW_SIDES:
                    wall, cpu = raw_once(target, export, side.split()[1])
                else:
                    if side == EXISTING:
                        _create_empty(target, sides[side])
                    wall, cpu = import_once(target, export, sides[side])
                    check_exact(target, export)
                samples[side].append((wall, cpu))
                print(
                    f"run {run + 1} {side}: {wall:.1f} s wall, {cpu:.1f} s CPU, "
                    f"{args.messages / wall:,.0f} messages/s ({args.messages / cpu:,.0f} per "
                    f"CPU second), load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                )
                if args.backend == "sqlite":
                    for suffix in ("", "-wal", "-shm", "-writer.lock"):
                        Path(f"{target}{suffix}").unlink(missing_ok=True)
    mix = (
        "`bench/scale.py`'s 2 GB mix"
        if args.mix == "scale"
        else f"an assistant turn calls a tool {args.tool_calls:.0%} of the time"
    )
    print(
        f"Import of {args.messages:,} messages ({megabytes:,.0f} MB of JSON Lines; {mix}) into "
        f"a new {args.backend} database with `hermes-store import` (`{EXISTING}`: into an "
        f"empty database made first with `db upgrade`), each checked exact (the database "
        f"exports the file's values, the full-text indexes pass FTS5's integrity check), "
        f"fresh process per run, {max(3, args.runs)} "
        f"interleaved rounds, median [min..max]; load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end:\n"
    )
    print("| side | messages/s (wall) | messages/s per CPU second | MB/s (wall) |")
    print("| --- | --- | --- | --- |")
    for side, runs in samples.items():
        rate = [args.messages / wall for wall, _ in runs]
        per_cpu = [args.messages / cpu for _, cpu in runs]
        mbs = [megabytes / wall for wall, _ in runs]
        print(f"| {side} | {_spread(rate)} | {_spread(per_cpu)} | {_spread(mbs, '.1f')} |")
    if args.backend == "sqlite":
        rate = statistics.median(args.messages / wall for wall, _ in samples[NEW_FILE])
        met = "met" if rate >= TARGET_RATE else "NOT met"
        print(
            f"\nInto a new file: {rate:,.0f} messages/s (median): the {TARGET_RATE:,} "
            f"messages/s target {met}."
        )


def _spread(values: list[float], spec: str = ",.0f") -> str:
    return spread(values, "{:" + spec + "}")


if __name__ == "__main__":
    main()
