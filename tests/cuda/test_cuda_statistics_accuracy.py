"""The CUDA kernels' per-thread statistics (``csrc/math/compensated.h``: compensated
sums of x - centre and (x - centre)^2 about the channel's first value, block
partials merged with Chan's formula) checked on the host against float64, on
inputs that break plain float32 accumulation: a large common offset (mean 1e4
with unit noise, mean 1e3 with variance 1e-6), values near the float16 range
limit, bfloat16 data, float64 data with an offset of 1e9, an outlier as the
centre. ``tests/support/native/compensated_driver.cpp`` runs the kernels' schedule
(blocks, threads reading strided vectors, lanes folded, a reduction tree) with
g++; no GPU is needed. Skipped without a C++ compiler.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from fractions import Fraction

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "tests", "support", "native", "compensated_driver.cpp")
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or c++) in PATH")


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> str:
    exe = str(tmp_path_factory.mktemp("compensated") / "driver")
    # -ffp-contract=off: no a * b + c fused behind our back (the device code uses __fmul_rn for that).
    subprocess.run([CXX, "-std=c++20", "-O2", "-ffp-contract=off", "-Wall", "-Werror", "-I",
                    os.path.join(ROOT, "csrc"), DRIVER, "-o", exe], check=True, capture_output=True, text=True)
    return exe


def _run(driver, tmp_path, mode, values, blocks, threads, lanes, extra=()):
    data = np.concatenate([np.asarray(v) for v in values])
    path = tmp_path / "data.bin"
    data.tofile(path)
    kind = "d" if data.dtype == np.float64 else "f"
    out = subprocess.run([driver, kind, mode, str(path), str(len(values[0])), str(blocks), str(threads),
                          str(lanes), *map(repr, extra)], check=True, capture_output=True, text=True).stdout
    return [float(v) for v in out.split()]


def _data(case: str, n: int) -> np.ndarray:
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(n, generator=g, dtype=torch.float64)
    if case == "offset 1e4, unit noise":
        x = (1e4 + noise).float()
    elif case == "offset 1e3, variance 1e-6":
        x = (1e3 + 1e-3 * noise).float()
    elif case == "near the float16 range limit":
        x = (6.0e4 + 2e3 * noise).clamp(max=65504).half().float()
    elif case == "bfloat16, offset 1e3":
        x = (1e3 + 4 * noise).bfloat16().float()
    elif case == "float64, offset 1e9":
        x = 1e9 + 1e-3 * noise
    elif case == "outlier as the centre":
        x = (1e4 + noise).float()
        x[0] = 1e4 + 3e3
    else:  # ordinary
        x = noise.float()
    return x.numpy()


def _exact_moments(x: np.ndarray) -> tuple[float, float]:
    """Mean and m2 in exact rational arithmetic, rounded once to float64."""
    c = Fraction(float(x[0])) if len(x) else Fraction(0)
    d = [Fraction(float(v)) - c for v in x]
    s1, s2, n = sum(d), sum(v * v for v in d), len(x)
    return float(c + s1 / n), float(s2 - s1 * s1 / n)


CASES = ["ordinary", "offset 1e4, unit noise", "offset 1e3, variance 1e-6", "near the float16 range limit",
         "bfloat16, offset 1e3", "float64, offset 1e9", "outlier as the centre"]
# (blocks, threads, lanes): the planes' schedule (one block), split channels, columns of 4 float32 lanes.
SCHEDULES = [(1, 256, 4), (7, 256, 4), (3, 64, 1)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES)
def test_moments_match_float64(driver, tmp_path, case, schedule):
    x = _data(case, 50_003)
    mean, m2, count = _run(driver, tmp_path, "moments", [x], *schedule)
    ref_mean, ref_m2 = _exact_moments(x)
    assert count == len(x)
    # float64 results, far below a float32 rounding of the mean or the variance
    # (the mean is exact to within a few float64 roundings of the data's scale).
    scale = float(np.abs(x).max())
    assert abs(mean - ref_mean) <= 1e-14 * scale
    # Blocks merge as float64 moments (Chan's formula, as on the CPU): each
    # merge's delta of block means carries their float64 rounding, which only
    # float64 data with an offset of 1e12 deviations (the 1e9 case) notices.
    blocks, n = schedule[0], len(x)
    merges = (blocks - 1) * 16 * math.sqrt(n * blocks) * math.sqrt(ref_m2 / n) * 2**-53 * abs(ref_mean)
    assert abs(m2 - ref_m2) <= 1e-9 * ref_m2 + merges


def test_welford_in_float32_fails_the_same_input():
    """The inputs are hard: float32 Welford per thread (a plain CUDA accumulation) is off by far more."""
    x = _data("offset 1e3, variance 1e-6", 50_003)
    mean, m2 = np.float32(0), np.float32(0)
    for i, v in enumerate(x[:4096], 1):
        d = v - mean
        mean = np.float32(mean + d / np.float32(i))
        m2 = np.float32(m2 + d * (v - mean))
    ref = x[:4096].astype(np.float64)
    ref_m2 = math.fsum((ref - ref.mean()) ** 2)
    assert abs(float(m2) - ref_m2) > 1e-3 * ref_m2


def test_no_values_gives_zero_moments(driver, tmp_path):
    assert _run(driver, tmp_path, "moments", [np.zeros(0, np.float32)], 1, 256, 4) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grad_sums_match_float64(driver, tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    n = 50_003
    x = (1e4 + torch.randn(n, generator=g, dtype=torch.float64)).numpy().astype(dtype)
    dy = (100 + torch.randn(n, generator=g, dtype=torch.float64)).numpy().astype(dtype)
    mean = dtype(math.fsum(x.astype(np.float64)) / n)  # the kernels' centre: the mean rounded to A
    sum_dy, sum_dy_xc = _run(driver, tmp_path, "grad", [x, dy], 7, 256, 4, extra=(float(mean),))
    xc = (x - mean).astype(np.float64)  # exact in A (Sterbenz), as the kernel takes it
    terms = dy.astype(np.float64) * xc
    assert sum_dy == pytest.approx(math.fsum(dy.astype(np.float64)), rel=1e-13)
    # Each product is rounded once to A (as on the CPU); the sum of them is compensated.
    eps = float(np.finfo(dtype).eps)
    assert abs(sum_dy_xc - math.fsum(terms)) <= eps * math.fsum(np.abs(terms))
