"""The load benchmark: writer processes appending to one shared session and incrementing its
counters (several threads each, every thread on its own store) while readers search and list.

``python -m bench.load --rounds 3`` runs the contenders interleaved, round after round (the
order rotates each round, so drift on a shared machine hits all alike), on a fresh database
per run, and prints a markdown table of medians with [min..max] over the rounds:

- ``ours``: hermes_store as it is (the fair writer queue and group commit on);
- ``ours, sync=NORMAL``: the same opened with ``synchronous="normal"`` (the opt-in);
- ``before``: hermes_store with the queue and group commit off (``HERMES_STORE_WRITE_QUEUE=0``,
  ``HERMES_STORE_GROUP_COMMIT=0`` in the worker processes), i.e. the code before the queue:
  every writer meets SQLite's busy handler;
- ``original``: the original store (``tests/support/seed_store.py``, raw ``sqlite3``).

Sets: ``8x4+2r`` (8 processes x 4 threads, 2 reader processes), ``16x1``, ``1x1`` (one
writer alone: the commit ceiling the other sets share), and ``mixed``
(8 x 4 of the contender plus 2 original-store processes x 4 threads on the same file; with
the contender ``original`` every process is the original store: the run of the same size the
original processes' latency is compared with). Ratios are taken per round against the
original store in the same round (``mixed``: against ``original``). Units per commit: the
write units of our writer processes over their commits (group commit makes it above 1).
``--out docs/benchmarks.md`` rewrites that file's load section with the report.
Real processes (``fork``: cheap on two cores; the queue's fork hook gives children their own
lock descriptors); totals are checked exactly after every run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

from bench.corpus import COMMON_WORD
from bench.timing import percentile
from hermes_store import HermesStoreError, SessionDB

SHARED = "load-shared"
ORIGINAL = "original"
NORMAL = "ours, sync=NORMAL"
KINDS = ("ours", NORMAL, "before", ORIGINAL)


@dataclass(frozen=True)
class Group:
    """``processes`` writer processes of one kind, ``threads`` threads x ``ops`` each."""

    kind: str
    processes: int
    threads: int
    ops: int

    @property
    def writes(self) -> int:
        return self.processes * self.threads * self.ops * 2


@dataclass
class LoadResult:
    """What one load run measured (latencies of the first group; ``others`` for the rest)."""

    backend: str
    writers: int
    threads: int
    ops: int
    seconds: float
    write_latencies: list[float] = field(default_factory=list)
    other_latencies: list[float] = field(default_factory=list)
    read_latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reads_unavailable: bool = False
    totals_ok: bool = False
    totals: dict[str, Any] = field(default_factory=dict)
    cpu_seconds: float = 0.0  #: CPU time of the first group's writer processes
    queue_fallbacks: int = 0
    units: int = 0  #: write units of the first group's processes (ours only)
    commits: int = 0  #: their commits (a group commit counts once)

    @property
    def units_per_commit(self) -> float:
        return self.units / self.commits if self.commits else float("nan")

    @property
    def writes(self) -> int:
        return len(self.write_latencies)

    def summary(self) -> dict[str, float]:
        w = self.write_latencies
        r = self.read_latencies
        all_writes = len(w) + len(self.other_latencies)
        return {
            "write_p50_ms": percentile(w, 0.50) * 1000,
            "write_mean_ms": statistics.fmean(w) * 1000 if w else float("nan"),
            "write_p99_ms": percentile(w, 0.99) * 1000,
            "write_max_ms": (max(w) if w else float("nan")) * 1000,
            "writes_per_s": all_writes / self.seconds if self.seconds else float("nan"),
            "cpu_ms_per_write": self.cpu_seconds / len(w) * 1000 if w else float("nan"),
            "read_p50_ms": percentile(r, 0.50) * 1000,
            "read_p99_ms": percentile(r, 0.99) * 1000,
            "reads": float(len(r)),
            "reads_per_s": len(r) / self.seconds if self.seconds else float("nan"),
        }


def _setup(kind: str) -> None:
    """Per-process switches for a contender (run in the worker, before any store is opened)."""
    if kind == "before":
        os.environ["HERMES_STORE_WRITE_QUEUE"] = "0"
        os.environ["HERMES_STORE_GROUP_COMMIT"] = "0"


def _open(url: str, kind: str) -> Any:
    """hermes_store, or the original store's own class (``tests/support/seed_store.py``)."""
    if kind in (ORIGINAL, "seed"):
        from tests.support.seed_store import SeedSessionDB

        return SeedSessionDB(url)
    if kind == NORMAL:
        return SessionDB(url, synchronous="normal")
    return SessionDB(url)


def _writer(
    url: str, kind: str, worker: int, threads: int, ops: int, start: Barrier, out: Any, group: int
) -> None:
    _setup(kind)
    stores = [_open(url, kind) for _ in range(threads)]  # every thread on its own store
    latencies: list[list[float]] = [[] for _ in range(threads)]
    errors: list[str] = []

    def work(thread: int) -> None:
        store, mine = stores[thread], latencies[thread]
        for op in range(ops):
            t0 = time.perf_counter()
            try:
                store.append_message(SHARED, "user", f"load {worker} {thread} {op} {COMMON_WORD}")
                t1 = time.perf_counter()
                store.update_token_counts(SHARED, input_tokens=1, output_tokens=2)
                t2 = time.perf_counter()
            except Exception as error:  # counted, reported, and the totals check fails
                errors.append(f"{kind} writer {worker}: {error!r}")
                continue
            mine.extend((t1 - t0, t2 - t1))

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    start.wait()
    cpu0 = time.process_time()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    cpu = time.process_time() - cpu0
    fallbacks = units = commits = 0
    uow = getattr(stores[0], "uow", None)  # one per file per process, shared by the stores
    if uow is not None:
        counts = uow.stats
        units = counts.write_units
        commits = counts.groups + counts.write_units - counts.grouped_units
    for store in stores:
        write_queue = getattr(getattr(store, "uow", None), "write_queue", None)
        if write_queue is not None:
            stats = write_queue.stats()  # one queue per file per process
            fallbacks = stats.fallbacks
        store.close()
    flat = [x for mine in latencies for x in mine]
    out.put(("writer", group, flat, errors, (units, commits), cpu, fallbacks))


def _reader(url: str, kind: str, worker: int, start: Barrier, stop: Event, out: Any) -> None:
    _setup(kind)
    store = _open(url, kind)
    latencies: list[float] = []
    errors: list[str] = []
    start.wait()
    turn = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            if turn % 2 == 0:
                store.search_messages(COMMON_WORD, limit=20)
            else:
                store.list_sessions_rich(limit=20)
        except Exception as error:
            errors.append(f"reader {worker}: {error!r}")
            continue
        finally:
            turn += 1
        latencies.append(time.perf_counter() - t0)
    store.close()
    out.put(("reader", -1, latencies, errors, (0, 0), 0.0, 0))


def prepare(url: str) -> None:
    """A database at head with the shared session and a little searchable history."""
    store = SessionDB(url)
    try:
        store.create_session(SHARED, "load")
        for index in range(20):
            sid = f"load-history-{index}"
            store.create_session(sid, "cli")
            store.append_messages(
                sid,
                [
                    {"role": "user", "content": f"history {COMMON_WORD} {index} {n}"}
                    for n in range(25)
                ],
            )
    finally:
        store.close()


def run_groups(
    url: str, label: str, groups: Sequence[Group], *, readers: int = 0, reader_kind: str = "ours"
) -> LoadResult:
    """Run the writer groups (and readers) at once against ``url`` (prepared); check totals."""
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    out = ctx.Queue()
    writers = sum(g.processes for g in groups)
    start = ctx.Barrier(writers + readers + 1)
    stop = ctx.Event()
    procs = [
        ctx.Process(target=_writer, args=(url, g.kind, w, g.threads, g.ops, start, out, index))
        for index, g in enumerate(groups)
        for w in range(g.processes)
    ]
    procs += [
        ctx.Process(target=_reader, args=(url, reader_kind, r, start, stop, out))
        for r in range(readers)
    ]
    for proc in procs:
        proc.start()
    start.wait(timeout=120)
    began = time.perf_counter()
    first = groups[0]
    result = LoadResult(label, first.processes, first.threads, first.ops, 0.0)
    pending_writers = writers
    pending = len(procs)
    while pending:
        try:
            role, group, latencies, errors, counts, cpu, fallbacks = out.get(timeout=300)
        except queue.Empty:
            result.errors.append("a worker did not report within 300 s")
            break
        pending -= 1
        result.errors.extend(errors)
        if role == "writer":
            if group == 0:
                result.write_latencies.extend(latencies)
                result.cpu_seconds += cpu
                result.queue_fallbacks += fallbacks
                result.units += counts[0]
                result.commits += counts[1]
            else:
                result.other_latencies.extend(latencies)
            pending_writers -= 1
            if pending_writers == 0:
                result.seconds = time.perf_counter() - began
                stop.set()
        else:
            result.read_latencies.extend(latencies)
    stop.set()
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            result.errors.append(f"{proc.name} exited with {proc.exitcode}")
    _check_totals(url, result, sum(g.writes for g in groups) // 2)
    return result


def run_load(
    url: str,
    backend: str,
    *,
    writers: int = 8,
    readers: int = 2,
    threads: int = 4,
    ops: int = 100,
    kind: str = "ours",
) -> LoadResult:
    """One run of the classic shape (``bench.run``); ``kind="seed"``: the original store."""
    kind = ORIGINAL if kind == "seed" else kind
    label = backend if kind == "ours" else f"{backend}, seed (floor)"
    return run_groups(
        url, label, [Group(kind, writers, threads, ops)], readers=readers, reader_kind=kind
    )


def _check_totals(url: str, result: LoadResult, expected: int) -> None:
    store = SessionDB(url)
    try:
        session = store.get_session(SHARED)
        rows = store.message_count(SHARED)
    except HermesStoreError as error:
        result.errors.append(f"totals: {error!r}")
        return
    finally:
        store.close()
    assert session is not None
    result.totals = {
        "expected": expected,
        "message_count": session["message_count"],
        "rows": rows,
        "input_tokens": session["input_tokens"],
        "output_tokens": session["output_tokens"],
    }
    result.totals_ok = (
        session["message_count"] == rows == expected
        and session["input_tokens"] == expected
        and session["output_tokens"] == 2 * expected
    )


# -- the interleaved comparison (python -m bench.load) -----------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One set: how the writers are made up for a contender, and who the ratios compare to."""

    name: str
    contenders: tuple[str, ...]
    baseline: str
    groups: Callable[[str, int], list[Group]]
    readers: int
    ops: int


def scenarios(ops: int) -> list[Scenario]:
    """``ops``: operations per thread at 8 x 4 (the other sets do as many writes in all)."""
    return [
        Scenario("8x4+2r", KINDS, ORIGINAL, lambda k, n: [Group(k, 8, 4, n)], 2, ops),
        Scenario("16x1", KINDS, ORIGINAL, lambda k, n: [Group(k, 16, 1, n)], 0, 2 * ops),
        # One writer alone: no waiting at all, so its writes/s is the file's commit ceiling.
        Scenario("1x1", KINDS, ORIGINAL, lambda k, n: [Group(k, 1, 1, n)], 0, 32 * ops),
        Scenario(
            "mixed 8x4 + 2x4 original",
            ("ours", "before", ORIGINAL),
            ORIGINAL,
            lambda k, n: [Group(k, 8, 4, n), Group(ORIGINAL, 2, 4, n)],
            0,
            ops,
        ),
    ]


METRICS = (
    ("p50 ms", "write_p50_ms", "{:.1f}"),
    ("mean ms", "write_mean_ms", "{:.1f}"),
    ("p99 ms", "write_p99_ms", "{:.0f}"),
    ("max ms", "write_max_ms", "{:.0f}"),
    ("writes/s", "writes_per_s", "{:.0f}"),
    ("CPU ms/write", "cpu_ms_per_write", "{:.2f}"),
    ("reads/s", "reads_per_s", "{:.0f}"),
)


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return (
        f"{fmt.format(statistics.median(values))} "
        f"[{fmt.format(min(values))}..{fmt.format(max(values))}]"
    )


def compare(rounds: int, ops: int, work: Path, only: set[str] | None = None) -> str:
    """Run every scenario's contenders interleaved for ``rounds`` rounds; a markdown report."""
    runs: dict[tuple[str, str], list[LoadResult]] = {}
    ratio: dict[tuple[str, str, str], list[float]] = {}
    loads: list[float] = []
    plan = [s for s in scenarios(ops) if only is None or s.name.split()[0] in only]
    started = time.perf_counter()
    for round_ in range(rounds):
        for scenario in plan:
            order = list(scenario.contenders)
            order = order[round_ % len(order) :] + order[: round_ % len(order)]
            this_round: dict[str, dict[str, float]] = {}
            for kind in order:
                path = work / f"load-{round_}-{scenario.name.split()[0]}-{KINDS.index(kind)}.db"
                prepare(str(path))
                groups = scenario.groups(kind, scenario.ops)
                reader_kind = kind if kind != NORMAL else "ours"
                loads.append(os.getloadavg()[0])
                result = run_groups(
                    str(path), kind, groups, readers=scenario.readers, reader_kind=reader_kind
                )
                runs.setdefault((scenario.name, kind), []).append(result)
                this_round[kind] = result.summary()
                s = this_round[kind]
                print(
                    f"round {round_ + 1} {scenario.name:>10} {kind:>18}: "
                    f"p50 {s['write_p50_ms']:.1f} p99 {s['write_p99_ms']:.0f} "
                    f"max {s['write_max_ms']:.0f} ms, {s['writes_per_s']:.0f} w/s, "
                    f"errors {len(result.errors)}, totals {'ok' if result.totals_ok else 'WRONG'}"
                    f", queue fallbacks {result.queue_fallbacks}"
                    f", units/commit {result.units_per_commit:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
                for file in work.glob(f"{path.name}*"):
                    file.unlink()
            base = this_round[scenario.baseline]
            for kind, s in this_round.items():
                for _, key, _ in METRICS:
                    if base[key]:
                        ratio.setdefault((scenario.name, kind, key), []).append(s[key] / base[key])
            if scenario.name.startswith("mixed"):  # the 2 original processes, beside each kind
                base_max = max(runs[(scenario.name, ORIGINAL)][-1].other_latencies, default=0)
                for kind in scenario.contenders:
                    mine = max(runs[(scenario.name, kind)][-1].other_latencies, default=0)
                    if base_max:
                        ratio.setdefault((scenario.name, kind, "original_max"), []).append(
                            mine / base_max
                        )
    seconds = time.perf_counter() - started
    load_avg = _spread(loads, "{:.1f}")
    lines = [
        f"Load: {rounds} interleaved rounds, {seconds:.0f} s, {os.cpu_count()} CPUs, "
        f"1-minute load average at the start of each run {load_avg} (shared machine: numbers "
        f"are noisy). Each op = append_message + update_token_counts on one shared session, "
        f"both timed; each writer thread has its own store; readers (8x4+2r) search and list "
        f"in a loop with the contender's own store class. median [min..max] over rounds; "
        f"ratio = contender / baseline in the same round (the original store; durability "
        f"FULL except the NORMAL opt-in).",
        "",
        "| set | contender | writes | "
        + " | ".join(name for name, _, _ in METRICS)
        + " | ratio p99 | ratio max | ratio writes/s | units/commit | errors | totals exact"
        " | queue fallbacks |",
        "|---|---|---:|" + "---:|" * len(METRICS) + "---:|---:|---:|---:|---:|---|---:|",
    ]
    for scenario in plan:
        for kind in scenario.contenders:
            results = runs[(scenario.name, kind)]
            cells = [_spread([r.summary()[key] for r in results], fmt) for _, key, fmt in METRICS]
            ratios = [
                "-" if kind == scenario.baseline
                else _spread(ratio[(scenario.name, kind, key)], "{:.2f}x")
                for key in ("write_p99_ms", "write_max_ms", "writes_per_s")
            ]  # fmt: skip
            per_commit = (
                _spread([r.units_per_commit for r in results], "{:.2f}")
                if results[0].commits
                else "-"
            )
            lines.append(
                f"| {scenario.name} | {kind} | {results[0].writes} | "
                + " | ".join([*cells, *ratios, per_commit])
                + f" | {sum(len(r.errors) for r in results)} "
                f"| {'yes' if all(r.totals_ok for r in results) else 'NO'} "
                f"| {sum(r.queue_fallbacks for r in results)} |"
            )
    mixed = [(name, kind) for name, kind in runs if name.startswith("mixed")]
    if mixed:
        lines += [
            "",
            "In the mixed set the table's latencies are those of the contender's 8x4 writers "
            "(writes/s counts all). The 2 original-store processes beside them (with "
            "`original`, every process is the original store: the run of the same size):",
            "",
            "| set | beside | original p99 ms | original max ms | ratio max vs all-original |",
            "|---|---|---:|---:|---:|",
        ]
        for name, kind in mixed:
            rs = runs[(name, kind)]
            p99 = _spread([percentile(r.other_latencies, 0.99) * 1000 for r in rs], "{:.0f}")
            top = _spread([max(r.other_latencies, default=0) * 1000 for r in rs], "{:.0f}")
            versus = (
                "-" if kind == ORIGINAL else _spread(ratio[(name, kind, "original_max")], "{:.2f}x")
            )
            lines.append(f"| {name} | {kind} | {p99} | {top} | {versus} |")
    return "\n".join(lines)


SECTION = "## Load: interleaved rounds (`python -m bench.load`)"


def write_section(doc: Path, report: str, command: str) -> None:
    """Replace the load section of ``doc`` (from a ``## Load`` heading to the next ``## ``)
    with ``report``; append the section when the file has none."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    section = f"{SECTION}\n\nThis run: `{command}`.\n\n{report}\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("## Load")), None)
    if start is None:
        doc.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    doc.write_text("".join(lines[:start]) + section + "\n" + "".join(lines[end:]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=12, help="operations per thread at 8x4")
    parser.add_argument("--sets", default="", help="comma list of 8x4+2r,16x1,1x1,mixed (all)")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--out", default="", help="rewrite this file's load section (a .md)")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hermes-load-"))
    work.mkdir(parents=True, exist_ok=True)
    only = {s.strip() for s in args.sets.split(",") if s.strip()} or None
    report = compare(args.rounds, args.ops, work, only)
    print(report)
    if args.out:
        command = "python -m bench.load " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(Path(args.out), report, command.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
