"""Whole training steps under each memory allocator: ``examples/speed.py``
(torch's BatchNorm against ours, same model and weights, steps interleaved in
one process) run in a fresh subprocess per configuration:

* allocator: glibc; glibc with ``THP_MEM_ALLOC_ENABLE=1`` (torch's CPU
  allocator asks for huge pages); glibc told to keep what it maps
  (``glibc-kept``: ``GLIBC_KEEPS_MEMORY``, no large block a fresh mapping and
  none returned to the system, so no output faults its pages in again on
  every step); jemalloc or tcmalloc preloaded
  (``LD_PRELOAD``); an allocator whose library is missing is skipped, with a note;
* our CPU output cache: on (the default) or off (``TORCH_BN_GRAD_OUTPUT_CACHE_MB=0``).

It prints one table: per configuration, the median over ``--repeats`` runs of
speed.py's median step time with torch's BatchNorm (native), with ours, and
their ratio native / ours (above 1: ours is faster). Configurations alternate
within each repeat, so that slow drifts of a shared machine spread over all.

    python benchmarks/allocators.py [--repeats 3] [--batch-size 128] [--image-size 48] [--timing-steps 30]
                                    [--threads N] [--allocators glibc,thp,jemalloc,tcmalloc] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SPEED = ROOT / "examples" / "speed.py"
LIB = Path("/usr/lib/x86_64-linux-gnu")
# glibc's tunables (mallopt's, read at start-up) that keep every block in its heap
# (never a fresh mapping) and never hand memory back to the system.
GLIBC_KEEPS_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TRIM_THRESHOLD_": "8000000000",
                      "MALLOC_TOP_PAD_": "536870912"}
# name -> (environment added, library that must exist or None)
ALLOCATORS: dict[str, tuple[dict[str, str], Optional[Path]]] = {
    "glibc": ({}, None),
    "thp": ({"THP_MEM_ALLOC_ENABLE": "1"}, None),
    "glibc-kept": (GLIBC_KEEPS_MEMORY, None),
    "jemalloc": ({"LD_PRELOAD": str(LIB / "libjemalloc.so.2")}, LIB / "libjemalloc.so.2"),
    "tcmalloc": ({"LD_PRELOAD": str(LIB / "libtcmalloc_minimal.so.4")}, LIB / "libtcmalloc_minimal.so.4"),
}
CACHE = {"on": {}, "off": {"TORCH_BN_GRAD_OUTPUT_CACHE_MB": "0"}}
# Every variable a configuration sets, cleared first so that the caller's environment does not leak in.
_CONTROLLED = ("LD_PRELOAD", "THP_MEM_ALLOC_ENABLE", "TORCH_BN_GRAD_OUTPUT_CACHE_MB", *GLIBC_KEEPS_MEMORY)
_STEP = re.compile(r"median training step .*: torch BatchNorm ([0-9.]+) ms, torch_bn_grad ([0-9.]+) ms")


@dataclass
class Row:
    """One configuration: medians over its runs."""

    allocator: str
    cache: str
    native_ms: float = 0.0
    ours_ms: float = 0.0
    ratio: float = 0.0
    runs: list = field(default_factory=list)  # (native ms, ours ms) per run


def environment(allocator: str, cache: str) -> dict[str, str]:
    """The subprocess's environment for one configuration."""
    env = {k: v for k, v in os.environ.items() if k not in _CONTROLLED}
    # This source tree's torch_bn_grad, as with an editable install (speed.py's own folder comes first).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env.update(ALLOCATORS[allocator][0])
    env.update(CACHE[cache])
    return env


def parse(output: str) -> tuple[float, float]:
    """(torch BatchNorm ms, ours ms) from speed.py's output."""
    match = _STEP.search(output)
    if match is None:
        raise RuntimeError(f"no 'median training step' line in examples/speed.py's output:\n{output}")
    return float(match.group(1)), float(match.group(2))


def run_once(allocator: str, cache: str, train_args: list[str]) -> tuple[float, float]:
    """One run of examples/speed.py in a subprocess; (native ms, ours ms)."""
    done = subprocess.run([sys.executable, str(SPEED), *train_args], env=environment(allocator, cache),
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"examples/speed.py failed under {allocator}, cache {cache} "
                           f"(exit {done.returncode}):\n{done.stdout}{done.stderr}")
    return parse(done.stdout)


def preloads(library: Path) -> bool:
    """Whether a Python started with LD_PRELOAD=`library` has it mapped (the loader may refuse it)."""
    probe = "import sys; sys.stdout.write(open('/proc/self/maps').read())"
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "LD_PRELOAD": str(library)},
                          capture_output=True, text=True)
    return done.returncode == 0 and library.name in done.stdout


def available(names: list[str], log=print) -> list[str]:
    """The allocators among `names` whose library is there and loads; a note for each that is not."""
    kept = []
    for name in names:
        library = ALLOCATORS[name][1]
        if library is not None and not library.is_file():
            log(f"note: skipping {name}: {library} not found (e.g. apt-get install "
                f"{'libjemalloc2' if name == 'jemalloc' else 'libtcmalloc-minimal4'})")
            continue
        if library is not None and not preloads(library):
            log(f"note: skipping {name}: LD_PRELOAD={library} does not load into {sys.executable}")
            continue
        kept.append(name)
    return kept


def run(allocators: list[str], repeats: int, train_args: list[str], log=print) -> list[Row]:
    """Every configuration `repeats` times, alternating; one row per configuration."""
    rows = [Row(a, c) for a in available(allocators, log) for c in CACHE]
    for repeat in range(repeats):
        for row in rows:
            row.runs.append(run_once(row.allocator, row.cache, train_args))
            log(f"  run {repeat + 1}/{repeats} {row.allocator:>10} cache {row.cache:>3}: "
                f"native {row.runs[-1][0]:.2f} ms, ours {row.runs[-1][1]:.2f} ms")
    for row in rows:
        row.native_ms = statistics.median(n for n, _ in row.runs)
        row.ours_ms = statistics.median(o for _, o in row.runs)
        row.ratio = round(statistics.median(n / o for n, o in row.runs), 3)
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"{'allocator':>10} {'cache':>5} {'native ms':>10} {'ours ms':>9} {'native/ours':>11}"]
    lines += [f"{r.allocator:>10} {r.cache:>5} {r.native_ms:>10.2f} {r.ours_ms:>9.2f} {r.ratio:>10.3f}x" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allocators", default=",".join(ALLOCATORS), help="subset of " + ",".join(ALLOCATORS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of speed.py per configuration")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=48)
    parser.add_argument("--timing-steps", type=int, default=30, help="speed.py's timed steps per model")
    parser.add_argument("--samples", type=int, default=512, help="speed.py's synthetic data set size")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", metavar="FILE", help="write the rows (with every run) as JSON")
    args = parser.parse_args(argv)
    unknown = set(args.allocators.split(",")) - set(ALLOCATORS)
    if unknown:
        parser.error(f"unknown allocators {sorted(unknown)}; choose from {', '.join(ALLOCATORS)}")
    train_args = ["--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
                  "--timing-steps", str(args.timing_steps),
                  "--samples", str(max(args.samples, args.batch_size * 4 // 3 + 1))]
    if args.threads:
        train_args += ["--threads", str(args.threads)]
    print(f"examples/speed.py {' '.join(train_args)}, {args.repeats} runs per configuration")
    rows = run(args.allocators.split(","), args.repeats, train_args)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
