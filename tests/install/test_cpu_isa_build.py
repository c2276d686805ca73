"""Compiles the per-ISA CPU kernels for the instruction sets this build left out.

setup.py compiles the kernels in ``csrc/cpu/kernels/`` for the instruction
set the building CPU runs (cpu_build.py; the README's test command adds
DEFAULT), so on a CPU without AVX512 the AVX512 copy is never compiled by
the build, nor the AVX2 copy on one with it.
Here every kernel source goes through the compiler's front end (``-fsyntax-only``: parsing, overload
resolution and template instantiation, where such a copy's errors arise) for
each instruction set not compiled, with the flags the build would use. A
source passes when the compiler succeeds and prints nothing.

Skipped where every copy was compiled (nothing left to check).
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import sysconfig

import pytest
from torch.utils import cpp_extension

import torch_bn_grad

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import build_sources  # noqa: E402  (the build's own sources)
import cpu_build  # noqa: E402  (the build's own choice of copies and flags)

KERNEL_SOURCES = [os.path.join(ROOT, path) for path in build_sources.kernel_sources()]
LEFT_OUT = [isa for isa in cpu_build.ISA_FLAGS if isa not in torch_bn_grad.compiled_cpu_kernel_isas()]
TIMEOUT_S = 600


def command(source: str, isa: str) -> list[str]:
    headers = [flag for folder in cpp_extension.include_paths() for flag in ("-isystem", folder)]
    return [cpp_extension.get_cxx_compiler(), "-fsyntax-only", "-std=c++20", "-Wall", "-fopenmp",
            f"-I{os.path.join(ROOT, 'csrc')}", "-isystem", sysconfig.get_paths()["include"], *headers,
            *cpu_build.flags(isa, list(cpu_build.ISA_FLAGS)), source]


@pytest.mark.skipif(not LEFT_OUT, reason="every ISA copy of the kernels was compiled by the build")
def test_left_out_isa_copies_compile():
    jobs = [(source, isa) for isa in LEFT_OUT for source in KERNEL_SOURCES]

    def compile_one(job):
        source, isa = job
        proc = subprocess.run(command(source, isa), capture_output=True, text=True, timeout=TIMEOUT_S)
        return job, proc.returncode, proc.stdout + proc.stderr

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_one, jobs))
    failures = [f"{os.path.relpath(source, ROOT)} for {isa} (exit {rc}):\n{output[-4000:]}"
                for (source, isa), rc, output in results if rc != 0 or output.strip()]
    assert not failures, "\n\n".join(failures)
