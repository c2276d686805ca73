"""Compiles every CUDA source with the machine's nvcc, for sm_80.

This runs without a GPU or a CUDA build of torch: torch's CPU wheel ships the
ATen/c10 CUDA headers. A source passes when nvcc succeeds and prints nothing
at all, so any warning (ours, nvcc's or ptxas') fails the test. One
architecture, the oldest the build targets (the sources have no
architecture-specific code), and all sources at once, one nvcc per CPU: on
2 CPUs the whole check takes about as long as the longest source.

torch's headers are passed with -isystem, so that a warning of torch's own
headers (they warn under C++17, for instance) cannot fail the test; csrc/
stays a plain -I, so warnings in this project's code still fail. The standard
is C++20, as in the extension build.
The flags are those of the extension build (setup.py and torch's
COMMON_NVCC_FLAGS) plus -Wall for the host compiler.

Skipped only when nvcc is found neither in PATH nor under CUDA_HOME.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
sys.path.insert(0, ROOT)
import build_sources  # noqa: E402  (the build's own sources)

CUDA_SOURCES = [os.path.join(ROOT, path) for path in build_sources.cuda_sources()]
ARCH = "80"
# Allow for a slow, busy machine.
TIMEOUT_S = 1200


def find_nvcc() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        return nvcc
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or cpp_extension.CUDA_HOME
    if cuda_home:
        candidate = os.path.join(cuda_home, "bin", "nvcc")
        if os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found (looked in PATH and CUDA_HOME/CUDA_PATH): CUDA sources not compiled")


def nvcc_command(source: str, output: str) -> list[str]:
    cmd = [NVCC, "-c", source, "-o", output, "-std=c++20", "-O3",
           "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DTORCH_BN_GRAD_WITH_CUDA",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           "-Xcompiler", "-Wall", "-Xcompiler", "-fPIC", "-I", CSRC]
    cmd += cpp_extension.COMMON_NVCC_FLAGS
    for include in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]:
        cmd += ["-isystem", include]
    return cmd + ["-gencode", f"arch=compute_{ARCH},code=sm_{ARCH}"]


def test_cuda_sources_exist():
    assert CUDA_SOURCES, f"no .cu files under {os.path.join(CSRC, 'cuda')}"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """source -> (command, output file, CompletedProcess), every source compiled at once."""
    folder = tmp_path_factory.mktemp("cuda_objects")

    def compile_one(source):
        output = str(folder / (os.path.basename(source) + ".o"))
        cmd = nvcc_command(source, output)
        try:
            return cmd, output, subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:  # that source's test fails, saying so; the others still report
            return cmd, output, subprocess.CompletedProcess(cmd, -1, "", f"timed out after {TIMEOUT_S} s")

    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(CUDA_SOURCES, pool.map(compile_one, CUDA_SOURCES)))


@pytest.mark.parametrize("source", CUDA_SOURCES, ids=os.path.basename)
def test_cuda_source_compiles_without_warnings(source, compiled):
    cmd, output, result = compiled[source]
    log = (result.stdout + result.stderr).strip()
    described = " ".join(cmd)
    assert result.returncode == 0, f"nvcc failed ({result.returncode}):\n{described}\n\n{log}"
    assert not log, f"nvcc printed output (warnings fail this test):\n{described}\n\n{log}"
    assert os.path.getsize(output) > 0
