"""Accuracy against torch's native batch norm, on ordinary and ill-conditioned data.

For float32, float16 and bfloat16 data this measures the maximum absolute error
of every output (dst, mean, variance; diff_src, diff_gamma, diff_beta) against
the float64 reference (reference.py), for this library and for
``torch.ops.aten.native_batch_norm`` / ``native_batch_norm_backward`` on the
same inputs in the same dtypes, in both kernel families (contiguous NCHW:
per-channel planes; channels_last: channels innermost).

Both libraries run on the device asked for (CPU, or CUDA where torch's native op is
cuDNN's or ATen's CUDA kernel); the reference is always float64 on the CPU.
Run ``python -m tests.support.accuracy [cpu|cuda]`` to print the table (markdown).

Native takes and returns ``invstd = (variance + eps)^-1/2`` (float32) where we
take and return the variance; its variance is read back as
``invstd^-2 - eps`` in float64, and its backward gets ``invstd`` computed in
float64 from the same float32 variance we get, then rounded to float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

import torch_bn_grad
from .reference import reference_backward, reference_forward

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("contiguous", "channels_last")
OUTPUTS = ("dst", "mean", "variance", "diff_src", "diff_gamma", "diff_beta")
SHAPE = (16, 4, 64, 64)
EPS = 1e-5
HALF_RANGE = 6e4  # float16 tops out at 65504

# (x, dy) in float64 for each kind of data.
DATA: dict[str, Callable[[tuple[int, ...], torch.Generator], tuple[Tensor, Tensor]]] = {
    "ordinary": lambda s, g: (_randn(s, g), _randn(s, g)),
    "offset 1000": lambda s, g: (1000 + _randn(s, g), _randn(s, g)),
    "variance ~1e-6": lambda s, g: (1 + 1e-3 * _randn(s, g), _randn(s, g)),
    "near half range": lambda s, g: (_uniform(s, g, HALF_RANGE), _uniform(s, g, HALF_RANGE)),
    # Magnitudes log-uniform over 2^-12..2^12: the plain runs of half-precision
    # sums (plane_kernels.h) round when a run mixes terms 2^10 apart.
    "mixed magnitudes": lambda s, g: (_log_uniform(s, g, 12), _randn(s, g)),
}


def _randn(shape, g):
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _log_uniform(shape, g, octaves):
    """Random signs times 2^u, u uniform in [-octaves, octaves]."""
    u = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * octaves
    sign = torch.randint(0, 2, shape, generator=g).to(torch.float64) * 2 - 1
    return sign * torch.exp2(u)


def _uniform(shape, g, bound):
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * bound


@dataclass
class Errors:
    """Maximum absolute errors of one output against the float64 reference."""

    ours: float  # nan or inf when an output is not finite
    native: float
    ulp: float  # spacing of the output's dtype at the reference's largest magnitude

    def allowed_excess(self) -> float:
        """How much ours may exceed native.

        Both at rounding level (native within one ulp of the largest output):
        half an ulp, because there the worst of some 10^5 elements, each a few
        float32 operations rounded once to the output dtype, is ~1 ulp for both
        libraries, and which one lands 0.1 ulp higher is chance. Otherwise
        none.
        """
        return self.ulp / 2 if self.native <= self.ulp else 0.0

    def ours_no_worse(self) -> bool:
        if not math.isfinite(self.native):
            return math.isfinite(self.ours)
        return self.ours <= self.native + self.allowed_excess()


def _ulp(dtype: torch.dtype, value: float) -> float:
    if value == 0 or not math.isfinite(value):
        return 0.0
    _, exponent = math.frexp(value)  # value = f * 2^exponent, f in [0.5, 1)
    return math.ldexp(torch.finfo(dtype).eps, exponent - 1)


def _max_error(actual: Tensor, expected: Tensor) -> float:
    """Largest absolute difference; nan or inf when `actual` has such a value."""
    return (actual.double() - expected).abs().max().item()


def measure(dtype: torch.dtype, kind: str, layout: str, shape=SHAPE, seed: int = 0,
            device: str = "cpu") -> dict[str, Errors]:
    """Errors of every output, ours and native on `device`, for one dtype, kind of data and layout."""
    g = torch.Generator().manual_seed(seed)
    x64, dy64 = DATA[kind](shape, g)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = x64.to(dtype=dtype, memory_format=fmt)
    dy = dy64.to(dtype=dtype, memory_format=fmt)
    c = shape[1]
    gamma = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).float()
    beta = torch.randn(c, generator=g, dtype=torch.float64).float()

    ref_dst, ref_mean, ref_var = reference_forward(x, gamma, beta, None, None, EPS, "NCX")
    # The backward's inputs: the exact batch statistics, rounded to float32.
    mean_in, var_in = ref_mean.float(), ref_var.float()
    ref_grads = reference_backward(x, dy, mean_in, var_in, gamma, EPS, "NCX", True)

    invstd_in = (var_in.double() + EPS).rsqrt().float()
    # .to keeps the memory format, so channels_last stays channels_last on the device.
    x, dy, gamma, beta, mean_in, var_in, invstd_in = (
        t.to(device) for t in (x, dy, gamma, beta, mean_in, var_in, invstd_in))

    ours = torch_bn_grad.batch_norm_forward(x, gamma, beta, epsilon=EPS)
    ours += torch_bn_grad.batch_norm_backward(x, dy, mean_in, var_in, gamma, epsilon=EPS)

    n_dst, n_mean, n_invstd = torch.ops.aten.native_batch_norm(x, gamma, beta, None, None, True, 0.0, EPS)
    native = (n_dst, n_mean, n_invstd.double() ** -2 - EPS)
    native += torch.ops.aten.native_batch_norm_backward(
        dy, x, gamma, None, None, mean_in, invstd_in, True, EPS, [True, True, True]
    )
    ours, native = (tuple(t.cpu() for t in outputs) for outputs in (ours, native))

    out_dtypes = (dtype, torch.float32, torch.float32, dtype, torch.float32, torch.float32)
    refs = (ref_dst, ref_mean, ref_var) + tuple(ref_grads)
    return {
        name: Errors(_max_error(o, r), _max_error(n, r), _ulp(dt, r.abs().max().item()))
        for name, o, n, r, dt in zip(OUTPUTS, ours, native, refs, out_dtypes)
    }


def table(device: str = "cpu") -> str:
    """The whole comparison on `device` as a markdown table: `ours / native` per output."""
    lines = [
        "| dtype | data | layout | " + " | ".join(OUTPUTS) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in OUTPUTS) + " |",
    ]
    for dtype in DTYPES:
        for kind in DATA:
            for layout in LAYOUTS:
                errors = measure(dtype, kind, layout, device=device)
                cells = [f"{e.ours:.2e} / {e.native:.2e}" + ("" if e.ours_no_worse() else " (!)") for e in errors.values()]
                lines.append(f"| {str(dtype)[6:]} | {kind} | {layout} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    name = torch.cuda.get_device_name() if where == "cuda" else "CPU"
    print(f"Maximum absolute error vs float64, ours / native on {name} (torch {torch.__version__}), "
          f"shape {SHAPE}, eps {EPS}; (!) marks ours worse.")
    print(table(where))
