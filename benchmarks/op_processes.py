"""The op benchmark's ``--processes N``: the same cases timed in N fresh
processes, one after the other, and per case the median over them.

On the 2-vCPU VMs this project is measured on, where a process's memory
lands moved one case's time by up to 2x from one process to the next (same
build, same command, minutes apart), while repeated timings within one
process agreed to a few percent. One process's table can so call a case
slower, or faster, than it is; the median of a few processes is not swayed
by one, and the range of their speedups shows how far to trust a row.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

# The fields of a row that are times or rates, merged as medians.
_MEDIAN_FIELDS = ("native_ms", "ours_ms", "gbps", "bound_pct")


def case_key(row: dict) -> tuple:
    """What names a case: shape, dtype, layout and direction (the device is the run's)."""
    return tuple(row["shape"]), row["dtype"], row["layout"], row["direction"]


def run(script: Path, argv: list[str], processes: int, log: Callable[[str], object] = print) -> list[list[dict]]:
    """The rows (``Result`` as dicts) of `processes` runs of ``python script *argv``,
    each in a fresh process writing its table to a JSON file (``ops.main`` checks
    the count)."""
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            path = Path(tmp) / f"process{i}.json"
            done = subprocess.run([sys.executable, str(script), *argv, "--json", str(path)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"benchmark process {i + 1} of {processes} exited with {done.returncode}:\n"
                                   f"{done.stderr[-4000:]}")
            tables.append(json.loads(path.read_text()))
            log(f"process {i + 1}/{processes} done")
    return tables


def merge(tables: list[list[dict]]) -> list[dict]:
    """One row per case, in the first table's order: the median of each time and
    rate, the median of the speedups as ``speedup`` and their range as
    ``speedup_min`` / ``speedup_max``. Every table must hold the same cases."""
    if not tables:
        raise ValueError("merge: no tables")
    by_case: dict[tuple, list[dict]] = {}
    for table in tables:
        for row in table:
            by_case.setdefault(case_key(row), []).append(row)
    first = [case_key(row) for row in tables[0]]
    if set(first) != set(by_case) or any(len(rows) != len(tables) for rows in by_case.values()):
        raise ValueError("merge: the processes timed different cases")
    merged = []
    for key in first:
        rows = by_case[key]
        speedups = [row["speedup"] for row in rows]
        row = dict(rows[0])
        row.update({field: round(statistics.median(r[field] for r in rows), 4) for field in _MEDIAN_FIELDS})
        row.update(speedup=round(statistics.median(speedups), 3), speedup_min=min(speedups),
                   speedup_max=max(speedups))
        merged.append(row)
    return merged
