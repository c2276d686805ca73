"""What the per-call benchmarks (``call_overhead.py``, ``fused_overhead.py``)
share: their command line and their timing, calls alternating between the
variants so that a noisy machine slows them alike."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable


def parse_args(doc: str) -> argparse.Namespace:
    """``--rounds`` (printed rounds), ``--iters`` (calls per variant and round) and
    ``--device``. On CUDA a call is timed without synchronizing: its host time, what
    bounds a small layer's call there (the queue of so few launches never fills)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def alternating_medians_us(steps: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    """Median microseconds per call of each step over `iters` calls each, the
    steps called in turn, in a fresh (seeded) random order every turn: in a
    fixed order one step always ran right after the other's parallel region,
    while its OpenMP workers were still spinning or going to sleep, which
    made one of two identical steps take up to 1.5x the other's time here."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    rng = random.Random(0)
    for _ in range(iters):
        rng.shuffle(order)
        for name in order:
            step = steps[name]
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}
