"""The fused operators' test cases shared by tests/fused/test_batch_norm_act.py,
tests/fused/test_batch_norm_act_compile.py and tests/autograd/test_forward_ad.py:
activations (and torch's composition of each), layouts of ranks 2 to 5, and
float64 inputs already rounded to the dtype under test."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("identity", "relu", "leaky_relu", "silu")
INVERTIBLE = ("identity", "leaky_relu")
SLOPE = 0.2
EPS = 1e-5
# (shape, memory format): ranks 2 to 5, contiguous and channels_last(_3d).
LAYOUTS = {
    "rank2": ((64, 24), torch.contiguous_format),
    "rank3": ((8, 6, 33), torch.contiguous_format),
    "rank4": ((4, 6, 7, 9), torch.contiguous_format),
    "rank4-cl": ((4, 20, 5, 7), torch.channels_last),
    "rank5-cl": ((2, 18, 3, 4, 5), torch.channels_last_3d),
}


def rounded_inputs(layout, dtype, with_residual, seed=0):
    """float64 data already rounded to `dtype` (parameters to their dtype), so that
    the float64 reference measures the computation's error alone."""
    shape, fmt = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(memory_format=fmt)
    r = torch.randn(shape, generator=g, dtype=torch.float64).to(memory_format=fmt) if with_residual else None
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(memory_format=fmt)
    w = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(c, generator=g, dtype=torch.float64)
    rm = torch.randn(c, generator=g, dtype=torch.float64) * 0.1
    rv = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    data = [t.to(dtype).double() if t is not None else None for t in (x, r, dy)]
    return (*data, *(t.to(pdtype).double() for t in (w, b, rm, rv)))


def torch_activation(z, activation, slope=SLOPE):
    """torch's activation `activation` of z (leaky_relu with `slope`)."""
    return {"identity": lambda t: t, "relu": F.relu, "leaky_relu": lambda t: F.leaky_relu(t, slope),
            "silu": F.silu}[activation](z)
