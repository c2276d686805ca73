"""The row kernels' statistics (``csrc/cpu/kernels/row_statistics.h``): blocks
of four heads or more (a head: 32 rows, 8 of a 7x7 plane's segment rows) are
summed in one pass about their head's mean, and summed again in two passes
where that centre lies more than a deviation from a channel's mean (half
precision of 12 MB or more too, whose first of two passes walks rows). Mean and variance stay within one float32
ulp of the float64 reference, on every ISA copy, where the first rows are far
from the rest (the centre refused: accepted, the variance of these cases is
off by about four ulps) and on data far from zero (the moments come from the
sums of x - centre, whose rounding is at the deviations' scale).
"""

from __future__ import annotations

from support.isa_runs import run_on_every_isa

_SCRIPT = r"""
import json, torch, torch_bn_grad
g = torch.Generator().manual_seed(5)

def case(shape, dtype, far_rows=0, offset=0.0, channels_last=False):
    x = torch.randn(shape, generator=g, dtype=torch.float64) + offset
    x[:far_rows] += 1000.0  # the first rows of the first block
    x = x.to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    dims = [d for d in range(x.dim()) if d != 1]
    exact = x.double()
    ref_mean, ref_var = exact.mean(dims), exact.var(dims, unbiased=False)
    _, mean, var = torch_bn_grad.batch_norm_forward(x)
    ulp = lambda t: torch.finfo(torch.float32).eps * t.abs()  # one ulp or more
    return max(float(((mean.double() - ref_mean).abs() / ulp(ref_mean)).max()),
               float(((var.double() - ref_var).abs() / ulp(ref_var)).max()))

worst = {
    "far first rows 16384x4": case((16384, 4), torch.float32, far_rows=32),
    "far first rows 4096x1024": case((4096, 1024), torch.float32, far_rows=32),
    "far first rows 1024x8x7x7 (segments)": case((1024, 8, 7, 7), torch.float32, far_rows=32),
    "far first rows 4096x64 bfloat16": case((4096, 64), torch.bfloat16, far_rows=32),
    "far first rows 8192x1024 float16 (12 MB or more)": case((8192, 1024), torch.float16, far_rows=32),
    "far first rows 32x64x7x7 (segments, a head of 8 rows)": case((32, 64, 7, 7), torch.float32, far_rows=8),
    "offset 1000 4096x256": case((4096, 256), torch.float32, offset=1000.0),
    "offset 1000 64x16x32x32 channels_last": case((64, 16, 32, 32), torch.float32, offset=1000.0, channels_last=True),
    "offset 100 4096x128 float16": case((4096, 128), torch.float16, offset=100.0),
    "offset 100 8192x1024 bfloat16 (12 MB or more)": case((8192, 1024), torch.bfloat16, offset=100.0),
    "offset 100 32x2048x7x7 float16 (segments)": case((32, 2048, 7, 7), torch.float16, offset=100.0),
}
print(json.dumps({"isa": torch_bn_grad.cpu_kernel_isa(), "worst": worst}))
"""


def test_row_statistics_within_an_ulp_of_the_reference():
    for isa, run in run_on_every_isa(_SCRIPT).items():
        for name, ulps in run["worst"].items():
            assert ulps <= 1.0, f"{isa}: {name}: {ulps:.2f} float32 ulps from the reference"
