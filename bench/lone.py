"""One writer alone: hermes_store's single-call writes against the original store and the floor.

    python -m bench.lone --rounds 7 --calls 300

Four contenders in one process, each on a file of its own, interleaved block after block (the
order rotates each round): ``ours`` (``SessionDB``, ``synchronous=FULL``), ``original`` (the
original store, ``tests/support/seed_store.py``: raw ``sqlite3``, ``BEGIN IMMEDIATE`` + insert
+ update + commit), ``floor`` (the same statements with nothing around them,
``bench/floor.py``) and ``unit`` (the original's statements run as a unit of ours,
``uow.run(fn, driver_only=True)``: what the Unit of Work costs, without the store's argument
checks). Per round and contender: the median wall time of one call and the CPU time
per call (``time.process_time`` over the block). The table gives medians over the rounds with
[min..max], and ours over the original and over the floor, paired per round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.floor import BUMP_COUNTERS, INSERT_MESSAGE, Floor, SeedSessionDB
from bench.timing import spread
from hermes_store import SessionDB

#: The original store's counter update (its update_token_counts with only input tokens).
_BUMP_TOKENS = (
    "UPDATE sessions SET input_tokens = input_tokens + ?, output_tokens = output_tokens + ?,"
    " cache_read_tokens = cache_read_tokens + ?, cache_write_tokens = cache_write_tokens + ?,"
    " reasoning_tokens = reasoning_tokens + ?,"
    " estimated_cost_usd = COALESCE(estimated_cost_usd, 0) + COALESCE(?, 0),"
    " actual_cost_usd = CASE WHEN ? IS NULL THEN actual_cost_usd"
    " ELSE COALESCE(actual_cost_usd, 0) + ? END,"
    " cost_status = COALESCE(?, cost_status), cost_source = COALESCE(?, cost_source),"
    " pricing_version = COALESCE(?, pricing_version),"
    " billing_provider = COALESCE(billing_provider, ?),"
    " billing_base_url = COALESCE(billing_base_url, ?),"
    " billing_mode = COALESCE(billing_mode, ?), model = COALESCE(model, ?) WHERE id = ?"
)


def _floor_tokens(floor: Floor, session_id: str) -> None:
    conn = floor.conn
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(_BUMP_TOKENS, (3, 0, 0, 0, 0, None, None, None, *[None] * 7, session_id))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    floor._wrote()


def _unit_append(conn: Any, session_id: str, text: str) -> int:
    """The original store's append, run as a unit of ours (its statements, on the driver)."""
    driver = conn.connection.driver_connection
    cursor = driver.execute(
        INSERT_MESSAGE,
        (session_id, "user", text, None, None, None, time.time(), None, None, None, None, None),
    )
    driver.execute(BUMP_COUNTERS, (0, session_id))
    return int(cursor.lastrowid or 0)


def _unit_tokens(conn: Any, session_id: str) -> None:
    driver = conn.connection.driver_connection
    driver.execute(_BUMP_TOKENS, (3, 0, 0, 0, 0, None, None, None, *[None] * 7, session_id))


def _block(call: Callable[[int], object], calls: int, start: int) -> tuple[float, float]:
    """Median wall seconds of one call, and CPU seconds per call, over ``calls`` calls."""
    samples: list[float] = []
    cpu = time.process_time()
    for i in range(start, start + calls):
        began = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - began)
    return statistics.median(samples), (time.process_time() - cpu) / calls


def run(rounds: int, calls: int, work: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    ours = SessionDB(work / "ours.db")
    unit = SessionDB(work / "unit.db")
    SeedSessionDB(work / "floor.db").close()
    original = SeedSessionDB(work / "original.db")
    floor = Floor(work / "floor.db")
    ours.create_session("s", "bench")
    unit.create_session("s", "bench")
    original.create_session("s", "bench")
    floor.create_session("s", "bench")
    ops: dict[str, dict[str, Callable[[int], object]]] = {
        "append_message": {
            "ours": lambda i: ours.append_message("s", "user", f"message {i}"),
            "original": lambda i: original.append_message("s", "user", f"message {i}"),
            "floor": lambda i: floor.append_message("s", "user", f"message {i}"),
            "unit": lambda i: unit.uow.run(
                lambda conn: _unit_append(conn, "s", f"message {i}"), driver_only=True
            ),
        },
        "update_token_counts": {
            "ours": lambda i: ours.update_token_counts("s", input_tokens=3),
            "original": lambda i: original.update_token_counts("s", input_tokens=3),
            "floor": lambda i: _floor_tokens(floor, "s"),
            "unit": lambda i: unit.uow.run(lambda conn: _unit_tokens(conn, "s"), driver_only=True),
        },
    }
    results: dict[str, dict[str, list[tuple[float, float]]]] = {
        op: {name: [] for name in contenders} for op, contenders in ops.items()
    }
    for op, contenders in ops.items():
        names = list(contenders)
        for name in names:  # warm-up
            _block(contenders[name], max(1, calls // 10), 0)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                results[op][name].append(_block(contenders[name], calls, round_index * calls))
    stats = ours.stats()
    queue = ours.uow.write_queue
    print(f"ours: {stats.write_units} write units, {stats.groups} groups", end="")
    if queue is not None:
        print(f", queue turns {queue.stats().turns}", end="")
    print()
    ours.close()
    unit.close()
    original.close()
    floor.close()
    return results


def _spread(values: list[float], scale: float = 1e6, unit: str = "") -> str:
    return spread(values, "{:.2f}" if unit else "{:.1f}", scale=scale, unit=unit)


def report(results: dict[str, dict[str, list[tuple[float, float]]]]) -> str:
    lines = [
        "| operation | contender | wall µs/call | CPU µs/call | wall / original | CPU / original"
        " | wall / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for op, by_name in results.items():
        base, floor = by_name["original"], by_name["floor"]
        for name, runs in by_name.items():
            walls = [w for w, _ in runs]
            cpus = [c for _, c in runs]
            to_original = [w / b[0] for (w, _), b in zip(runs, base, strict=True)]
            cpu_original = [c / b[1] for (_, c), b in zip(runs, base, strict=True)]
            to_floor = [w / f[0] for (w, _), f in zip(runs, floor, strict=True)]
            lines.append(
                f"| {op} | {name} | {_spread(walls)} | {_spread(cpus)} | "
                f"{_spread(to_original, 1, 'x')} | {_spread(cpu_original, 1, 'x')} | "
                f"{_spread(to_floor, 1, 'x')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hermes-lone-") as tmp:
        print(report(run(args.rounds, args.calls, Path(tmp))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
