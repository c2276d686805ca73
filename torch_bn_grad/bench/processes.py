"""The benchmarks' ``--processes N`` (the operator table and ``--model``): the
same cases timed in N fresh processes, one after the other, and per case the
median over them.

On a VM, where a process's memory lands can move a case's time severalfold
from one process to the next (same build, same command), while repeated
timings within one process agree to a few percent (docs/performance.md). One
process's table can so call a case slower, or faster, than it is; the median
of a few processes is not swayed by one, and the range of their speedups
shows how far to trust a row.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

# Where the parent's torch_bn_grad package lies (the folder holding it), for
# its processes to check they import it: an A/B of an old build against a
# newer one on sys.path would otherwise time the wrong build in every process.
PACKAGE_ROOT_ENV = "TORCH_BN_GRAD_BENCH_PACKAGE_ROOT"

# What a process of :func:`run` runs: the entry point of the package in the
# folder given first, which goes first on sys.path (before the working folder
# and PYTHONPATH), then the benchmark's own arguments.
_PROCESS_CODE = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
                 "from torch_bn_grad.bench import ops; ops.main(sys.argv[1:])")


def package_root(package: ModuleType) -> Path:
    """The folder that holds `package` (torch_bn_grad) as imported."""
    return Path(package.__file__).resolve().parents[1]


def check_package(package: ModuleType) -> None:
    """In a process of :func:`run`: raises unless `package` is the parent's."""
    root = os.environ.get(PACKAGE_ROOT_ENV)
    if root and package_root(package) != Path(root):
        raise RuntimeError(f"benchmark process imported torch_bn_grad from {package_root(package)}, "
                           f"its parent from {root}")


@dataclass(frozen=True)
class Table:
    """What a benchmark's rows hold: the fields that name a case, the times and
    rates merged as medians, and the speedups merged as a median and a range
    (``<speedup>_min`` / ``<speedup>_max``). A field that is None in a row (a
    variant that benchmark did not time) stays None."""

    key: tuple[str, ...]
    medians: tuple[str, ...]
    speedups: tuple[str, ...]

    def case(self, row: dict) -> tuple:
        """The row's key values (JSON's lists as tuples)."""
        return tuple(tuple(v) if isinstance(v, list) else v for v in (row[k] for k in self.key))


# The operator table (ops.Result): the device is the run's.
OPS = Table(key=("shape", "dtype", "layout", "direction"), medians=("native_ms", "ours_ms", "gbps", "bound_pct"),
            speedups=("speedup",))
# The model table (models.ModelResult).
MODELS = Table(key=("model", "mode", "layout", "execution"), medians=("native_ms", "ours_ms", "opaque_ms", "fused_ms"),
               speedups=("speedup", "opaque_speedup", "fused_speedup"))


def run(argv: list[str], processes: int, log: Callable[[str], object] = print) -> list[list[dict]]:
    """The rows (as dicts) of `processes` runs of ``python -m torch_bn_grad.bench
    *argv``, each in a fresh process writing its table to a JSON file. Each
    process imports the torch_bn_grad this one did."""
    import torch_bn_grad

    root = str(package_root(torch_bn_grad))
    env = dict(os.environ, **{PACKAGE_ROOT_ENV: root})
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            path = Path(tmp) / f"process{i}.json"
            done = subprocess.run([sys.executable, "-c", _PROCESS_CODE, root, *argv, "--json", str(path)],
                                  capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"benchmark process {i + 1} of {processes} exited with {done.returncode}:\n"
                                   f"{done.stderr[-4000:]}")
            tables.append(json.loads(path.read_text()))
            log(f"process {i + 1}/{processes} done")
    return tables


def merge(tables: list[list[dict]], kind: Table) -> list[dict]:
    """One row per case, in the first table's order: the median of each time and
    rate, the median of each speedup and its range. Every table must hold the
    same cases."""
    if not tables:
        raise ValueError("merge: no tables")
    by_case: dict[tuple, list[dict]] = {}
    for table in tables:
        for row in table:
            by_case.setdefault(kind.case(row), []).append(row)
    first = [kind.case(row) for row in tables[0]]
    if set(first) != set(by_case) or any(len(rows) != len(tables) for rows in by_case.values()):
        raise ValueError("merge: the processes timed different cases")
    merged = []
    for key in first:
        rows = by_case[key]
        row = dict(rows[0])
        for field in kind.medians:
            if row[field] is not None:
                row[field] = round(statistics.median(r[field] for r in rows), 4)
        for field in kind.speedups:
            if row[field] is not None:
                values = [r[field] for r in rows]
                row.update({field: round(statistics.median(values), 3), f"{field}_min": min(values),
                            f"{field}_max": max(values)})
        merged.append(row)
    return merged
