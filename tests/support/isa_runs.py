"""Running a test script once per compiled ISA copy of the CPU kernels.

The kernels are compiled once per instruction set (default, AVX2, AVX512:
those setup.py built) and the copy is chosen at import from
``ATEN_CPU_CAPABILITY``, so each copy needs a process
of its own: the script runs in a subprocess per ISA this CPU supports and
prints one JSON object, which must name the ISA that ran (``"isa"``, from
``torch_bn_grad.cpu_kernel_isa()``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torch_bn_grad

_ORDER = ["default", "avx2", "avx512"]


def capabilities() -> list[str]:
    """The compiled ISA copies this CPU can run, the scalar default first."""
    supported = torch.backends.cpu.get_cpu_capability().lower()
    runnable = _ORDER[: _ORDER.index(supported) + 1] if supported in _ORDER else ["default"]
    compiled = {isa.lower() for isa in torch_bn_grad.compiled_cpu_kernel_isas()}
    return [isa for isa in runnable if isa in compiled]


def run_on_every_isa(script: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    """`script`'s JSON output per ISA, each checked to have run on that ISA;
    `env` adds to the environment of its processes."""
    runs = {}
    for capability in capabilities():
        process_env = dict(os.environ, **(env or {}), ATEN_CPU_CAPABILITY=capability)
        proc = subprocess.run([sys.executable, "-c", script], env=process_env, capture_output=True, text=True)
        assert proc.returncode == 0, (capability, proc.stderr)
        run = json.loads(proc.stdout)
        assert run["isa"] == capability.upper(), (capability, run["isa"])
        runs[capability] = run
    return runs


def runs_to_compare(script: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    """`run_on_every_isa`, lowest ISA first, for a test that compares the
    copies: skipped where this build compiled one copy only (the README's
    test command builds DEFAULT beside the CPU's own)."""
    runs = run_on_every_isa(script, env)
    if len(runs) < 2:
        pytest.skip(f"one ISA copy of the kernels compiled ({', '.join(runs)}): nothing to compare")
    return runs
