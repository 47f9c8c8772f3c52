"""A state.db that lives for years: reads, backup, prune and online optimize of a realistic
file, a writer beside each.

    python -m bench.scale --size-mb 2048 --runs 3

The file is what a long-time user's ``state.db`` holds: ``--sessions`` sessions (20,000 for
2 GB) of about 51 messages each over the last 12 months (chat turns of 20-1,500 characters,
tool outputs of 5-50 KB of log lines, 5% of messages with Chinese text), written with
``hermes-store import`` from an export built by the same generator as the import benchmark
(:mod:`bench.exports`), in a fresh process. The share of assistant turns calling a tool
is set so the file reaches about ``--size-mb``. It is built once and cached under ``--cache``
(default: the temp folder's ``hermes-scale-bench``; 10 GB: ``--size-mb 10240 --sessions
100000``, a manual run of hours).

Each run works on a copy of it (synced to disk first), every step in its own process while
ONE writer process appends a message every 50 ms (its own session, started before the step
and stopped after it). First, on the full file, hermes_store and the original store (which
opens the same file) one after the other, the order alternating per run: a cold open + first
``get_session`` (a new process, wall time from its start, as :mod:`bench.cold_start` measures
it); a search for a common word, a rare word and a 3-character Chinese word, and the first page
of ``list_sessions_rich`` (a process per query and store: one untimed call, then the median of
``READ_REPEATS`` timed ones); ``hermes-store backup`` (ours alone: the original store has no
backup). Then ``sessions prune --older-than 274`` (about a quarter of the sessions) and ``db
optimize`` (online), exactly as a user runs them. Per step: its time, the writer's appends,
errors, worst wait and p99; for prune and optimize also the database's bytes (file + WAL) at
the start, the most seen during (sampled every 50 ms) and at the end, and after both the file
against a fresh import of what remains (the survivors exported and imported into a new file).
Printed: the median [min..max] over the runs (prune and optimize also per run), with the load
average when each run began (the machine may be shared).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from bench import cold_start, exports
from bench.timing import percentile, spread

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(tempfile.gettempdir()) / "hermes-scale-bench"
#: The issue's targets: a writer's worst wait, growth during, size against a fresh file.
BOUND_MS = 250.0
MAX_GROWTH = 1.10
MAX_OVER_FRESH = 1.15
#: The two stores of the read steps: this checkout's, and the one it replaces (which opens the
#: same file: ``tests/support/seed_store.py``).
OURS, ORIGINAL = "hermes_store", "original store"
#: The searches: one of the generator's ~100 words (drawn uniformly: in most messages) and a
#: 3-character word of one of its Chinese phrases; the rare word is read from the file.
COMMON_WORD = "timeout"
CJK_WORD = "数据库"
#: Timed calls per search or list process, after one untimed (warming) call.
READ_REPEATS = 3
FIRST_PAGE = 20


def cli(*argv: str, pythonpath: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``hermes-store ARGV`` in a fresh process (a user's command line)."""
    return subprocess.run(
        # -P: the current folder is not put first on the path (a checkout there would win)
        [sys.executable, "-P", "-m", "hermes_store", *argv],
        env=_environment(pythonpath),
        capture_output=True,
        text=True,
        check=False,
    )


def _environment(pythonpath: Path) -> dict[str, str]:
    """This environment with ``pythonpath`` first and no server URL (the file is given)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    env.pop("HERMES_STORE_URL", None)
    return env


def build(path: Path, sessions: int, messages: int, share: float, end: float) -> None:
    """The export written, then imported into ``path`` with ``hermes-store import``."""
    export = path.with_suffix(".jsonl")
    with open(export, "w", encoding="utf-8") as handle:
        records = list(exports.year_export_lines(sessions, messages, share, end))
        for record in reversed(records):  # newest first, as export writes it
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        del records
    done = cli("--db", str(path), "import", str(export), "--batch-size", "200", "--json")
    export.unlink()
    if done.returncode:
        raise SystemExit(f"the import failed ({done.returncode}):\n{done.stderr}")


def cached(cache: Path, size_mb: int, sessions: int, messages: int) -> Path:
    """The realistic file of ``size_mb``, built on first use (its sessions end at the build)."""
    path = cache / f"state-{size_mb}mb-{sessions}s-{messages}m.db"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    building = cache / f".building-{os.getpid()}.db"
    started = time.perf_counter()
    build(building, sessions, messages, exports.tool_share(size_mb, messages), time.time())
    for suffix in ("-wal", "-shm", "-writer.lock"):
        Path(f"{building}{suffix}").unlink(missing_ok=True)
    building.rename(path)
    print(
        f"built {sessions:,} sessions, {messages:,} messages, "
        f"{path.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - started:,.0f} s: {path}",
        file=sys.stderr,
    )
    return path


def disk_bytes(path: Path) -> int:
    """The database's file and WAL, by ``stat``."""
    total = 0
    for name in (str(path), f"{path}-wal"):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(name).st_size
    return total


def sync_to_disk(path: Path) -> None:
    """``path``'s pages written back to the disk: a fresh copy leaves gigabytes of dirty pages,
    and a writer's fsync would wait behind their write-back, a wait counted as the step's."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def writer(path: str, name: str, every: float, ready: Any, stop: Event, out: Any) -> None:
    """Appends a message every ``every`` seconds until ``stop``; says ``ready`` once warm.
    Sends (monotonic start, seconds taken, error or None) of every append, and the ids it
    was told were written (each must survive)."""
    from hermes_store import SessionDB

    store = SessionDB(path)
    store.create_session(name, "gateway")
    samples: list[tuple[float, float, str | None]] = []
    acknowledged: list[int] = []
    ready.put(name)
    following = time.monotonic()
    while not stop.is_set():
        started = time.monotonic()
        try:
            acknowledged.append(store.append_message(name, "user", f"written at {started:.3f}"))
            error = None
        except Exception as failure:  # counted, not hidden: the benchmark reports each one
            error = f"{type(failure).__name__}: {failure}"
        samples.append((started, time.monotonic() - started, error))
        following += every
        stop.wait(max(0.0, following - time.monotonic()))
    store.close()
    out.put((samples, acknowledged))


@dataclass
class Step:
    """One step beside the writer."""

    name: str
    seconds: float = 0.0
    exit_code: int = 0
    appends: int = 0
    errors: list[str] = field(default_factory=list)
    worst_ms: float = 0.0
    p99_ms: float = 0.0
    bytes_start: int = 0
    bytes_max: int = 0
    bytes_end: int = 0
    lost: int = 0
    output: str = ""
    hits: int | None = None


@dataclass
class Outcome:
    """What a step's process did: its exit code and printout, and the step's own figure in
    seconds when the process measures it (else the wall time around it counts)."""

    exit_code: int
    output: str = ""
    seconds: float | None = None
    hits: int | None = None


def beside(path: Path, name: str, action: Callable[[], Outcome], every: float = 0.05) -> Step:
    """``action`` (which runs the step's process) on ``path`` while one writer process appends
    every ``every`` s; the writer's appends from the process's start to its end are the step's."""
    ctx = mp.get_context("spawn")  # a clean interpreter, as a second program would be
    ready, stop, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    tag = f"scale-writer-{name}-{os.getpid()}-{time.monotonic_ns()}"
    process = ctx.Process(target=writer, args=(str(path), tag, every, ready, stop, out))
    process.start()
    ready.get(timeout=600)
    step = Step(name, bytes_start=disk_bytes(path))
    step.bytes_max = step.bytes_start
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(0.05):
            step.bytes_max = max(step.bytes_max, disk_bytes(path))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.5)  # the writer's rhythm settled before the step
    began = time.monotonic()
    done = action()
    ended = time.monotonic()
    time.sleep(0.5)
    stop.set()
    samples, acknowledged = out.get(timeout=600)
    process.join(60)
    watching.set()
    watcher.join()
    step.bytes_max = max(step.bytes_max, disk_bytes(path))
    step.bytes_end = disk_bytes(path)
    step.seconds = ended - began if done.seconds is None else done.seconds
    step.exit_code = done.exit_code
    step.output = done.output
    step.hits = done.hits
    during = [(took, error) for start, took, error in samples if began <= start < ended]
    step.appends = len(during)
    step.errors = [error for _, error in during if error is not None]
    outside = [error for start, _, error in samples if error and not began <= start < ended]
    step.errors += outside  # an error before or after the step counts too
    waits = [took for took, _ in during] or [0.0]
    step.worst_ms = max(waits) * 1000
    step.p99_ms = percentile(waits, 0.99) * 1000
    step.lost = _lost(path, tag, acknowledged)
    return step


def beside_writer(
    path: Path, name: str, argv: list[str], every: float = 0.05, pythonpath: Path = ROOT
) -> Step:
    """``hermes-store ARGV`` on ``path`` (the hermes_store of ``pythonpath``) while one writer
    process appends every ``every`` s."""

    def command() -> Outcome:
        done = cli("--db", str(path), *argv, pythonpath=pythonpath)
        return Outcome(done.returncode, (done.stdout + done.stderr).strip())

    return beside(path, name, command, every)


def _lost(path: Path, session: str, acknowledged: list[int]) -> int:
    """How many acknowledged appends the file does not hold."""
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = connection.execute("SELECT id FROM messages WHERE session_id = ?", (session,))
        held = {row[0] for row in rows}
    finally:
        connection.close()
    return len(set(acknowledged) - held)


def rare_word(path: Path) -> str:
    """An id in the first tool output of ``path`` (32 random bits per log line: one message
    holds it)."""
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = connection.execute(
            "SELECT content FROM messages WHERE role = 'tool' ORDER BY id LIMIT 1"
        ).fetchone()
    finally:
        connection.close()
    found = re.search(r"id=([0-9a-f]{8})", row[0] if row else "")
    if found is None:
        raise SystemExit(f"{path} holds no tool output: a larger --size-mb gives it some")
    return found.group(1)


def read_child(argv: list[str]) -> None:
    """The search or list process: opens ``PATH`` with ``KIND``'s store, calls once untimed
    (the file's pages and the store's first-use costs, as a running agent has them paid), then
    times ``REPEATS`` calls; prints each call's seconds and the rows a call returns (JSON)."""
    kind, path, what, query, repeats = argv
    store: Any
    if kind == OURS:
        from hermes_store import SessionDB

        store = SessionDB(path)
    else:
        from tests.support.seed_store import SeedSessionDB

        store = SeedSessionDB(path)

    def call() -> list[Any]:
        if what == "search":
            return list(store.search_messages(query))
        return list(store.list_sessions_rich(limit=FIRST_PAGE))

    rows = len(call())
    seconds = []
    for _ in range(int(repeats)):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    store.close()
    print(json.dumps({"seconds": seconds, "rows": rows}))


def read_step(path: Path, kind: str, what: str, query: str = "") -> Step:
    """A search (``what="search"``) or the first page of sessions, by ``kind``'s store in a
    process of its own beside the writer; the step's figure: the median of its timed calls."""
    argv = [
        sys.executable,
        "-P",
        "-c",
        "import sys; from bench.scale import read_child; read_child(sys.argv[1:])",
        kind,
        str(path),
        what,
        query,
        str(READ_REPEATS),
    ]

    def run() -> Outcome:
        done = subprocess.run(
            argv, env=_environment(ROOT), capture_output=True, text=True, check=False
        )
        if done.returncode:
            return Outcome(done.returncode, (done.stdout + done.stderr).strip())
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return Outcome(0, "", statistics.median(result["seconds"]), result["rows"])

    return beside(path, f"{what}-{kind}", run)


def cold_open_step(path: Path, kind: str, argv: list[str], env: dict[str, str]) -> Step:
    """One new process that imports ``kind``'s store, opens ``path`` and answers one
    ``get_session``: its wall time from its start (:func:`bench.cold_start.run_once`)."""

    def run() -> Outcome:
        try:
            wall, _, _ = cold_start.run_once(argv, env)
        except SystemExit as failure:
            return Outcome(1, str(failure))
        return Outcome(0, "", wall)

    return beside(path, f"open-{kind}", run)


def backup_step(path: Path, folder: Path) -> Step:
    """``hermes-store backup`` of ``path`` to a new file in ``folder`` (removed after)."""
    target = folder / "backup.db"
    step = beside_writer(path, "backup", ["backup", str(target)])
    for leftover in folder.glob("backup.db*"):
        leftover.unlink()
    return step


def read_steps(copy: Path, folder: Path, ours_first: bool) -> dict[str, dict[str, Step]]:
    """Cold open, the searches, the list and the backup, each row's stores one after the
    other (ours first or the original first), each step beside its own writer."""
    env = cold_start.process_env(folder)
    programs = cold_start.programs(copy, cold_start.middle_session(copy))
    opens = {
        OURS: programs["hermes_store: open + get_session"],
        ORIGINAL: programs["original store: open + get_session"],
    }
    for argv in opens.values():
        cold_start.run_once(argv, env)  # bytecode cached, as an installed package has it
    rare = rare_word(copy)

    def both(make: Callable[[str], Step]) -> dict[str, Callable[[], Step]]:
        return {kind: functools.partial(make, kind) for kind in (OURS, ORIGINAL)}

    rows: dict[str, dict[str, Callable[[], Step]]] = {
        "cold open + first `get_session`": both(
            lambda kind: cold_open_step(copy, kind, opens[kind], env)
        ),
        f"search, a common word `{COMMON_WORD}`": both(
            lambda kind: read_step(copy, kind, "search", COMMON_WORD)
        ),
        f"search, a rare word `{rare}` (a tool output's id)": both(
            lambda kind: read_step(copy, kind, "search", rare)
        ),
        f"search, a 3-character CJK word `{CJK_WORD}`": both(
            lambda kind: read_step(copy, kind, "search", CJK_WORD)
        ),
        f"list: the first page ({FIRST_PAGE} sessions)": both(
            lambda kind: read_step(copy, kind, "list")
        ),
        "backup (`hermes-store backup`)": {OURS: lambda: backup_step(copy, folder)},
    }
    order = (OURS, ORIGINAL) if ours_first else (ORIGINAL, OURS)
    done: dict[str, dict[str, Step]] = {}
    for label, contenders in rows.items():
        for kind in order:
            if kind in contenders:
                done.setdefault(label, {})[kind] = contenders[kind]()
    return done


def fresh_bytes(path: Path, folder: Path) -> int:
    """A fresh import of what ``path`` holds: exported, imported into a new file; its bytes."""
    export = folder / "remains.jsonl"
    fresh = folder / "fresh.db"
    done = cli("--db", str(path), "export", "-o", str(export))
    if done.returncode:
        raise SystemExit(f"the export failed:\n{done.stderr}")
    done = cli("--db", str(fresh), "import", str(export), "--batch-size", "200", "--json")
    if done.returncode:
        raise SystemExit(f"the import failed:\n{done.stderr}")
    size = disk_bytes(fresh)
    for leftover in folder.glob("fresh.db*"):
        leftover.unlink()
    export.unlink()
    return size


@dataclass
class Run:
    load: float
    start_bytes: int
    reads: dict[str, dict[str, Step]]
    prune: Step
    optimize: Step
    fresh: int

    @property
    def end_bytes(self) -> int:
        return self.optimize.bytes_end

    @property
    def growth(self) -> float:
        return max(self.prune.bytes_max, self.optimize.bytes_max) / self.start_bytes

    @property
    def over_fresh(self) -> float:
        return self.end_bytes / self.fresh


def one_run(source: Path, folder: Path, days: int, ours_first: bool = True) -> Run:
    """On a copy of ``source``: the reads and the backup (the full file), then prune, then
    optimize, a writer beside each."""
    copy = folder / "copy.db"
    shutil.copyfile(source, copy)
    sync_to_disk(copy)
    load = os.getloadavg()[0]
    reads = read_steps(copy, folder, ours_first)
    start = disk_bytes(copy)  # the file the prune meets (the reads' writers added a little)
    prune = beside_writer(copy, "prune", ["sessions", "prune", "--older-than", str(days), "--yes"])
    optimize = beside_writer(copy, "optimize", ["db", "optimize"])
    fresh = fresh_bytes(copy, folder)
    for leftover in folder.glob("copy.db*"):
        leftover.unlink()
    return Run(load, start, reads, prune, optimize, fresh)


def _mb(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def _spread(values: list[float], digits: int = 0) -> str:
    return spread(values, f"{{:,.{digits}f}}")


def _seconds(values: list[float]) -> str:
    """Median [min..max] in the unit the median reads best in."""
    middle = statistics.median(values)
    if middle >= 1:
        scale, unit, digits = 1.0, "s", 2
    else:
        scale, unit, digits = 1000.0, "ms", 1 if middle < 0.01 else 0
    return spread(values, f"{{:,.{digits}f}}", scale=scale, unit=f" {unit}")


def _sides(steps: dict[str, list[Step]], of: Callable[[Step], float]) -> str:
    """A figure of each store's steps, median [min..max], shown as ``ours / original``."""
    return " / ".join(_spread([of(step) for step in taken]) for taken in steps.values())


def read_report(runs: list[Run]) -> None:
    """The read steps and the backup: both stores side by side, median [min..max] over runs."""
    print(
        f"\nBefore the prune, on the full file: each step a process of its own beside one writer "
        f"process appending every 50 ms, the two stores one after the other (hermes_store first "
        f"in odd runs, the original store first in even ones). Cold open: a new process from its "
        f"start to its first `get_session` answered (wall time, as `bench/cold_start.py` "
        f"measures it). Search and list: a process per query and store that opens the file, "
        f"calls once untimed (warm, as in a running agent), then times {READ_REPEATS} calls: "
        f"the step's figure is their median. Backup: the CLI's process from start to exit "
        f"(the original store has no backup). Median [min..max] of {len(runs)} run(s); "
        f"ours / original below 1x: hermes_store is faster; the writer's figures as "
        f"hermes_store / the original store:\n"
    )
    print(
        "| step | hermes_store | original store | ours / original | rows (ours / original) "
        "| writer's worst wait ms | writer's errors | exit codes |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label in runs[0].reads:
        steps = {
            kind: [run.reads[label][kind] for run in runs]
            for kind in (OURS, ORIGINAL)
            if kind in runs[0].reads[label]
        }

        ours = _seconds([s.seconds for s in steps[OURS]])
        if ORIGINAL in steps:
            original = _seconds([s.seconds for s in steps[ORIGINAL]])
            ratio = statistics.median([s.seconds for s in steps[OURS]]) / statistics.median(
                [s.seconds for s in steps[ORIGINAL]]
            )
            shown_ratio = f"{ratio:,.2f}x" if ratio >= 0.01 else f"{ratio:,.4f}x"
        else:
            original, shown_ratio = "no backup", ""
        hits = " / ".join(
            str(taken[0].hits) if taken[0].hits is not None else "-" for taken in steps.values()
        )
        exits = " / ".join(",".join(str(s.exit_code) for s in taken) for taken in steps.values())
        worst = _sides(steps, lambda s: s.worst_ms)
        errors = _sides(steps, lambda s: len(s.errors))
        print(
            f"| {label} | {ours} | {original} | {shown_ratio} | {hits} | {worst} | {errors} "
            f"| {exits} |"
        )
    for run in runs:
        for label, by_kind in run.reads.items():
            for kind, step in by_kind.items():
                if step.errors:
                    print(f"\n{label}, {kind}: the writer's errors {step.errors[:3]}")
                if step.exit_code:
                    print(f"\n{label}, {kind} exited {step.exit_code}: {step.output[-600:]}")


def report(runs: list[Run], source: Path) -> None:
    print(
        f"\nA copy of a {disk_bytes(source) / 2**30:.2f} GiB file per run; the load average when "
        f"each run began: {', '.join(f'{run.load:.1f}' for run in runs)}."
    )
    read_report(runs)
    print(
        "\nThen prune (`sessions prune --older-than N`) and `db optimize` (online), one writer "
        f"process appending every 50 ms beside each step; {len(runs)} run(s):\n"
    )
    print(
        "| run | load avg | step | time | exit | appends | errors | worst wait | p99 | "
        "MiB start / max / end | lost |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for number, run in enumerate(runs, 1):
        for step in (run.prune, run.optimize):
            print(
                f"| {number} | {run.load:.1f} | {step.name} | {step.seconds:.1f} s | "
                f"{step.exit_code} | {step.appends} | {len(step.errors)} | "
                f"{step.worst_ms:.0f} ms | {step.p99_ms:.0f} ms | {_mb(step.bytes_start)} / "
                f"{_mb(step.bytes_max)} / {_mb(step.bytes_end)} | {step.lost} |"
            )
        print(
            f"| {number} | | after both | | | | | | | end {_mb(run.end_bytes)}, fresh import "
            f"{_mb(run.fresh)}: {run.over_fresh:.3f}x; most {run.growth:.3f}x the start | |"
        )
    print(f"\nMedian [min..max] of {len(runs)} run(s):\n")
    print("| figure | prune | optimize | target |")
    print("| --- | --- | --- | --- |")
    rows: list[tuple[str, Any, str]] = [
        ("time (s)", lambda s: s.seconds, ""),
        ("writer's errors", lambda s: len(s.errors), "0"),
        ("writer's worst wait (ms)", lambda s: s.worst_ms, f"<= {BOUND_MS:.0f}"),
        ("writer's p99 (ms)", lambda s: s.p99_ms, ""),
        ("most bytes during / start", lambda s: s.bytes_max / s.bytes_start, f"<= {MAX_GROWTH}"),
        ("acknowledged appends lost", lambda s: s.lost, "0"),
    ]
    for label, of, target in rows:
        digits = 3 if "/" in label else 0
        print(
            f"| {label} | {_spread([of(r.prune) for r in runs], digits)} | "
            f"{_spread([of(r.optimize) for r in runs], digits)} | {target} |"
        )
    print(
        f"| file + WAL at the end / fresh import | | "
        f"{_spread([r.over_fresh for r in runs], 3)} | <= {MAX_OVER_FRESH} |"
    )
    print(
        f"| most bytes during either / start | | {_spread([r.growth for r in runs], 3)} | "
        f"<= {MAX_GROWTH} |"
    )
    print("\nThe jobs' own account of their steps (the CLI's line):\n")
    for number, run in enumerate(runs, 1):
        for step in (run.prune, run.optimize):
            held = [line for line in step.output.splitlines() if "write lock" in line]
            print(f"- run {number}, {step.name}: {held[-1].strip() if held else '(none)'}")
    for run in runs:
        for step in (run.prune, run.optimize):
            if step.errors:
                print(f"\n{step.name}: {step.errors[:3]}")
            if step.exit_code:
                print(f"\n{step.name} exited {step.exit_code}: {step.output[-600:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2048)
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--messages", type=int, default=1_020_000)
    parser.add_argument("--older-than", type=int, default=274, help="the prune's days")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--build-only", action="store_true", help="build the cached file, stop")
    args = parser.parse_args()
    source = cached(args.cache, args.size_mb, args.sessions, args.messages)
    if args.build_only:
        print(source)
        return
    folder = Path(tempfile.mkdtemp(prefix="runs-", dir=args.cache))
    try:
        runs = []
        for number in range(args.runs):
            runs.append(one_run(source, folder, args.older_than, ours_first=number % 2 == 0))
            print(f"run {number + 1} done", file=sys.stderr, flush=True)
        report(runs, source)
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
