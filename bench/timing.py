"""Interleaved timing (medians over many rounds) and peak-memory measurement."""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stats:
    """Per-call seconds over ``rounds`` batches: the median and the spread around it."""

    median: float
    low: float
    high: float
    rounds: int
    calls: int

    @classmethod
    def of(cls, per_call: list[float], calls: int) -> Stats:
        ordered = sorted(per_call)
        tenth = max(0, len(ordered) // 10)
        return cls(
            median=statistics.median(ordered),
            low=ordered[tenth],
            high=ordered[-1 - tenth],
            rounds=len(ordered),
            calls=calls,
        )


def interleaved(
    contenders: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    inner: int = 1,
    warmup: int = 1,
) -> dict[str, Stats]:
    """Time each contender ``inner`` calls at a time, alternating them round after round.

    The order rotates every round, so drift on a noisy machine (another job, a CPU frequency
    change, the WAL growing) hits every contender alike; medians ignore the outliers.
    """
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            fn = contenders[name]
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: Stats.of(samples[name], rounds * inner) for name in names}


def peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes Python allocated while ``fn`` ran (tracemalloc), above what it started with."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak - base


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def spread(values: Sequence[float | None], fmt: str, *, scale: float = 1.0, unit: str = "") -> str:
    """``median [min..max]`` of the values given (None and NaN left out), each times ``scale``
    through ``fmt`` (``"{:.0f}"``, ``"{:.2f}x"``), ``unit`` after the median (``" ms"``); "-"
    when none is left. The one formatter of every benchmark's spreads."""
    found = [v * scale for v in values if v is not None and v == v]
    if not found:
        return "-"
    return (
        f"{fmt.format(statistics.median(found))}{unit} "
        f"[{fmt.format(min(found))}..{fmt.format(max(found))}]"
    )
