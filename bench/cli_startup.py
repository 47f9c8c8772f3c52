"""CPU time of ``hermes-store --help`` (and of a fresh ``import hermes_store.cli``).

    .venv/bin/python -m bench.cli_startup [--runs 9]

Each run is a fresh process; its user+system CPU is read with
``resource.getrusage(RUSAGE_CHILDREN)`` before and after, so other load on the machine does
not count (wall-clock would). Prints the median and [min..max] over the runs; the target is a
median under 0.3 s. Runs the console script from this interpreter's environment, else
``python -m hermes_store``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
from pathlib import Path

TARGET_S = 0.3


def child_cpu(argv: list[str]) -> float:
    """User + system CPU seconds of one run of ``argv`` (which must exit 0)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(argv: list[str], runs: int) -> tuple[float, float, float]:
    samples = [child_cpu(argv) for _ in range(runs)]
    return statistics.median(samples), min(samples), max(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per row (>= 5)")
    runs = max(5, parser.parse_args().runs)
    script = Path(sys.executable).with_name("hermes-store")
    help_argv = (
        [str(script), "--help"]
        if script.exists()
        else [sys.executable, "-m", "hermes_store", "--help"]
    )
    rows = {
        "hermes-store --help": help_argv,
        "hermes-store sessions prune --help": [*help_argv[:-1], "sessions", "prune", "--help"],
        "python -c 'import hermes_store.cli'": [sys.executable, "-c", "import hermes_store.cli"],
        "python -c 'pass' (interpreter floor)": [sys.executable, "-c", "pass"],
    }
    print(f"| command | CPU median [min..max], {runs} runs |")
    print("| --- | --- |")
    medians = {}
    for name, argv in rows.items():
        median, low, high = measure(argv, runs)
        medians[name] = median
        print(f"| `{name}` | {median * 1000:.0f} ms [{low * 1000:.0f}..{high * 1000:.0f}] |")
    help_ms = medians["hermes-store --help"] * 1000
    verdict = "under" if help_ms < TARGET_S * 1000 else "OVER"
    print(f"\n`--help`: median {help_ms:.0f} ms of CPU, {verdict} the {TARGET_S:g} s target")
    if not script.exists():
        print("(console script not installed: measured python -m hermes_store)")


if __name__ == "__main__":
    main()
