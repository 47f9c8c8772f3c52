"""``hermes-store doctor`` on a realistic large file, one writer appending every 50 ms beside it.

    python -m bench.doctor_scale --size-mb 2048 --runs 3 [--before DIR [--before-runs 1]]

The file is :mod:`bench.scale`'s (built once, cached under ``--cache``). One copy of it is
checked by ``doctor`` (the bounded default) and ``doctor --full`` (every entry, on a snapshot
copy), each in its own process exactly as a user runs it, while ONE writer process appends a
message every 50 ms (see :func:`bench.scale.beside_writer`). Rounds are interleaved, the order
rotating; per contender: the doctor's time and exit code, the writer's appends, errors, worst
wait and p99, as median [min..max] over the rounds, with the load average when each round began.
``--before DIR`` adds another checkout's ``doctor`` (its ``PYTHONPATH``) to the first
``--before-runs`` rounds (a doctor that takes minutes is measured once by default).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.scale import BOUND_MS, CACHE, ROOT, Step, beside_writer, cached, sync_to_disk
from bench.timing import spread


@dataclass
class Contender:
    name: str
    argv: list[str]
    pythonpath: Path
    rounds: int


def _spread(values: list[float]) -> str:
    return spread(values, "{:,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2048)
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--messages", type=int, default=1_020_000)
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--before", type=Path, help="another checkout, measured beside this one")
    parser.add_argument("--before-runs", type=int, default=1, help="rounds that run --before")
    parser.add_argument("--no-full", action="store_true", help="skip `doctor --full`")
    args = parser.parse_args()
    source = cached(args.cache, args.size_mb, args.sessions, args.messages)
    contenders = [Contender("doctor", ["doctor", "--json"], ROOT, args.runs)]
    if not args.no_full:
        contenders.append(
            Contender("doctor --full", ["doctor", "--full", "--json"], ROOT, args.runs)
        )
    if args.before is not None:
        contenders.append(
            Contender(
                "doctor (before)",
                ["doctor", "--json"],
                args.before.resolve(),
                min(args.runs, args.before_runs),
            )
        )
    folder = Path(tempfile.mkdtemp(prefix="doctor-", dir=args.cache))
    results: dict[str, list[tuple[float, Step]]] = {c.name: [] for c in contenders}
    try:
        copy = folder / "copy.db"
        shutil.copyfile(source, copy)  # the doctor writes nothing; the writers add a session each
        sync_to_disk(copy)  # on disk before the first round
        for number in range(args.runs):
            shift = number % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                if len(results[contender.name]) >= contender.rounds:
                    continue
                load = os.getloadavg()[0]
                step = beside_writer(
                    copy, contender.name, contender.argv, pythonpath=contender.pythonpath
                )
                results[contender.name].append((load, step))
                print(
                    f"round {number + 1}: {contender.name} {step.seconds:.1f} s, worst wait "
                    f"{step.worst_ms:.0f} ms, {len(step.errors)} error(s)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(folder)
    print(
        f"\n`hermes-store doctor` on a copy of a {source.stat().st_size / 2**20:,.0f} MiB file "
        f"({args.sessions:,} sessions, {args.messages:,} messages), one writer process appending "
        "every 50 ms beside it; rounds interleaved:\n"
    )
    print("| contender | round | load avg | time | exit | appends | errors | worst wait | p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, steps in results.items():
        for number, (load, step) in enumerate(steps, 1):
            print(
                f"| {name} | {number} | {load:.1f} | {step.seconds:.1f} s | {step.exit_code} | "
                f"{step.appends} | {len(step.errors)} | {step.worst_ms:.0f} ms | "
                f"{step.p99_ms:.0f} ms |"
            )
    print("\nMedian [min..max]:\n")
    print("| contender | rounds | time (s) | writer's errors | worst wait (ms) | p99 (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, steps in results.items():
        only = [step for _, step in steps]
        print(
            f"| {name} | {len(only)} | {_spread([s.seconds for s in only])} | "
            f"{_spread([len(s.errors) for s in only])} | {_spread([s.worst_ms for s in only])} | "
            f"{_spread([s.p99_ms for s in only])} |"
        )
    print(f"\nTarget: 0 writer errors, worst wait <= {BOUND_MS:.0f} ms.")
    for name, steps in results.items():
        for _, step in steps:
            if step.errors:
                print(f"\n{name}: {step.errors[:3]}")
            if step.exit_code:
                print(f"\n{name} exited {step.exit_code}: {step.output[-600:]}")


if __name__ == "__main__":
    main()
