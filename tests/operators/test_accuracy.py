"""Every output is at least as accurate as torch's native batch norm on the same device, for
float32, float16 and bfloat16, on ordinary and ill-conditioned data, in both
kernel families (see tests/support/accuracy.py; `python -m tests.support.accuracy` prints the table)."""

from __future__ import annotations

import math

import pytest

from support.accuracy import DATA, DTYPES, LAYOUTS, measure
from support.reference import DEVICES


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(DATA))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("device", DEVICES)
def test_no_less_accurate_than_native(device, dtype, kind, layout):
    errors = measure(dtype, kind, layout, device=device)
    for name, e in errors.items():
        assert math.isfinite(e.ours), f"{name}: ours is not finite"
        assert e.ours_no_worse(), f"{name}: ours {e.ours:.3e} > native {e.native:.3e} (+ {e.allowed_excess():.1e})"
