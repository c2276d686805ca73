"""``python -m torch_bn_grad.bench`` runs from an install without the source
tree, as from a wheel: the README's commands (the operator table, ``--model``,
``--processes``, ``--json``) need only what the package ships.

The install is made as a wheel's contents are: ``setup.py build_py`` copies the
packages that setup.py names, and the compiled extension the tests import is
copied beside them (building it again would take minutes). The benchmark then
runs with ``python -S`` from that folder, so that sys.path holds the copy and
torch's site-packages but neither the checkout nor an editable install's hook;
a ``benchmarks`` package that raises on import stands beside the copy, so that
any import of the checkout's benchmarks fails the run.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_bn_grad

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "torch_bn_grad" / "bench"
TORCH_SITE = Path(torch.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding torch_bn_grad as a wheel installs it, and a poisoned ``benchmarks``."""
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    extension = Path(torch_bn_grad._C.__file__)  # this Python's (a tree may hold another's beside it)
    shutil.copy2(extension, site / "torch_bn_grad" / extension.name)
    (site / "benchmarks").mkdir()
    (site / "benchmarks" / "__init__.py").write_text(
        "raise ImportError('torch_bn_grad.bench imported the checkout\\'s benchmarks package')\n")
    return site


def _run(site: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -S *args`` in `site`, with only `site` and torch's site-packages on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(TORCH_SITE)])
    return subprocess.run([sys.executable, "-S", *args], cwd=site, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_install_holds_the_bench_and_not_the_checkout(site):
    assert sorted(p.name for p in (site / "torch_bn_grad" / "bench").glob("*.py")) == sorted(
        p.name for p in BENCH.glob("*.py"))
    done = _run(site, "-c", "import json, sys, torch_bn_grad; print(json.dumps([torch_bn_grad.__file__, sys.path]))")
    assert done.returncode == 0, done.stderr[-3000:]
    package_file, path = json.loads(done.stdout)
    assert Path(package_file).parent == site / "torch_bn_grad"
    assert str(ROOT) not in path and not any(Path(p).resolve() == ROOT for p in path if p)


def test_help_prints_the_usage_of_every_readme_option(site):
    done = _run(site, "-m", "torch_bn_grad.bench", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: python -m torch_bn_grad.bench")
    for option in ("--device", "--json", "--processes", "--model", "--fuse", "--batch-size", "--dtypes"):
        assert option in done.stdout, option


def test_operator_table_in_processes_writes_json(site, tmp_path):
    path = tmp_path / "ops.json"
    done = _run(site, "-m", "torch_bn_grad.bench", "--shapes", "4x8x3x3", "--dtypes", "float32", "--layouts",
                "contiguous", "--directions", "forward", "--min-run-time", "0.01", "--processes", "2",
                "--json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "median of 2 processes" in done.stdout
    (row,) = json.loads(path.read_text())
    assert (row["shape"], row["dtype"], row["direction"]) == ([4, 8, 3, 3], "float32", "forward")
    assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]


def test_model_table_writes_json(site, tmp_path):
    path = tmp_path / "models.json"
    done = _run(site, "-m", "torch_bn_grad.bench", "--model", "resnet18", "--fuse", "--batch-size", "2",
                "--resolution", "32", "--iters", "1", "--rounds", "1", "--warmup", "1", "--executions", "eager",
                "--modes", "eval", "--layouts", "contiguous", "--num-classes", "10", "--json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(path.read_text())
    assert (row["model"], row["mode"], row["execution"]) == ("resnet18", "eval", "eager")
    assert row["ours_ms"] > 0 and row["fused_ms"] > 0


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (absolute imports, those inside functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_package_bench_imports_nothing_from_the_checkout():
    sources = sorted(BENCH.glob("*.py"))
    assert {p.stem for p in sources} >= {"__init__", "__main__", "ops", "models", "processes"}
    for source in sources:
        checkout = {name for name in _imported_modules(source) if name.split(".")[0] == "benchmarks"}
        assert not checkout, f"{source.relative_to(ROOT)} imports {sorted(checkout)}"
