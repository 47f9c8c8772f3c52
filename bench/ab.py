"""A/B: the same calls timed on two checkouts of hermes_store, interleaved round after round.

Why: a change to the write path must be judged against the code it replaces, on the same
machine in the same minutes. Each round starts one fresh process per checkout (in alternating
order), with ``PYTHONPATH`` pointing at that checkout, on a fresh SQLite file; the process
times every operation and prints JSON. The table gives, per operation, each side's median
over the rounds with [min..max], and B's median over A's.

    python -m bench.ab --a /path/to/previous-main --b . --rounds 5
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
from collections.abc import Callable
from pathlib import Path

from bench.timing import spread

#: Calls per operation in one round (after a warm-up of a tenth as many).
CALLS = {
    "append_message": 600,
    "update_token_counts": 600,
    "get_session": 1000,
    "search_messages": 200,
    "list_sessions_rich": 200,
}
#: Messages in the corpus that search and listing read (20 sessions).
CORPUS = 2000
WORDS = [
    *("deploy", "migration", "schema", "gateway", "token", "budget", "retry", "lock", "index"),
    *("search", "title", "lineage", "session", "message", "reasoning", "cost", "counter"),
    *("backup", "restore", "prune", "vacuum", "checkpoint"),
]


def _worker(path: Path) -> dict[str, dict[str, float]]:
    """Runs inside the process of one checkout: time each operation, wall and CPU per call."""
    from hermes_store import SessionDB

    db = SessionDB(path)
    results: dict[str, dict[str, float]] = {}

    def timed(name: str, call: Callable[[int], object]) -> None:
        calls = CALLS[name]
        for i in range(calls // 10):
            call(i)
        samples: list[float] = []
        cpu = time.process_time()
        for i in range(calls):
            start = time.perf_counter()
            call(i)
            samples.append(time.perf_counter() - start)
        cpu = time.process_time() - cpu
        results[name] = {"median": statistics.median(samples), "cpu": cpu / calls}

    db.create_session("ab-write", "bench")
    timed(
        "append_message",
        lambda i: db.append_message("ab-write", "user", f"{WORDS[i % len(WORDS)]} message {i}"),
    )
    timed("update_token_counts", lambda i: db.update_token_counts("ab-write", input_tokens=3))
    for s in range(20):
        sid = f"ab-read-{s}"
        db.create_session(sid, "cli" if s % 2 else "telegram")
        text = " ".join(WORDS[(s + j) % len(WORDS)] for j in range(8))
        db.append_messages(sid, [{"role": "user", "content": text}] * (CORPUS // 20))
    timed("get_session", lambda i: db.get_session(f"ab-read-{i % 20}"))
    timed("search_messages", lambda i: db.search_messages(WORDS[i % len(WORDS)], limit=20))
    timed("list_sessions_rich", lambda i: db.list_sessions_rich(limit=20))
    db.close()
    return results


def _run_side(checkout: Path, python: str) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="hermes-ab-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
        out = subprocess.run(
            [python, "-c", _BOOT, str(Path(tmp) / "state.db")],
            env=env,
            cwd=tmp,
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


_BOOT = (
    "import importlib.util, json, sys; from pathlib import Path;"
    f"spec = importlib.util.spec_from_file_location('ab', {str(Path(__file__).resolve())!r});"
    "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod);"
    "print(json.dumps(mod._worker(Path(sys.argv[1]))))"
)


def _fmt(values: list[float], scale: float = 1e6) -> str:
    return spread(values, "{:.1f}", scale=scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, type=Path, help="checkout A (the baseline)")
    parser.add_argument("--b", required=True, type=Path, help="checkout B (the change)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"A": [], "B": []}
    for round_index in range(args.rounds):
        order = [("A", args.a), ("B", args.b)]
        if round_index % 2:
            order.reverse()
        for side, checkout in order:
            runs[side].append(_run_side(checkout, args.python))
            print(f"round {round_index + 1} {side} done", file=sys.stderr)
    print(f"A = {args.a}, B = {args.b}, {args.rounds} interleaved rounds, one process each")
    print()
    print(
        "| operation | A wall µs/call | B wall µs/call | B/A"
        " | A CPU µs/call | B CPU µs/call | B/A |"
    )
    print("|---|---|---|---|---|---|---|")
    for op in CALLS:
        walls = {s: [r[op]["median"] for r in runs[s]] for s in runs}
        cpus = {s: [r[op]["cpu"] for r in runs[s]] for s in runs}
        wall_ratio = statistics.median(walls["B"]) / statistics.median(walls["A"])
        cpu_ratio = statistics.median(cpus["B"]) / statistics.median(cpus["A"])
        print(
            f"| {op} | {_fmt(walls['A'])} | {_fmt(walls['B'])} | {wall_ratio:.2f}x"
            f" | {_fmt(cpus['A'])} | {_fmt(cpus['B'])} | {cpu_ratio:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
