"""Rows of a few channels walked as one flat run (``tiled_rows`` in
``csrc/cpu/kernels/row_affine.h``): where a chunk's width is not a multiple
of the channel count but the pattern repeats within five chunks (8 or 16
channels: a chunk holds whole rows; 24 or 48 half-precision channels: three
chunks hold 4 or 2 rows; 40 channels: five chunks hold 4 half-precision
rows or 2 float32 rows; 80 half-precision channels 2), the elementwise pass
takes whole chunks across
rows, each lane's coefficients its channel's, instead of a masked partial
chunk a row.

Each ISA copy (chunks of 16 or 32 lanes on AVX512, 8 or 16 on AVX2) is
checked against float64 autograd at one and two threads (``grad_cases``):
row counts that leave a partial chunk at a block's end, blocks that start
mid-chunk, sign bits (relu), a residual, the memory-saving output gate, and
silu (whose gate binds coefficients per chunk and keeps the row walk).
The frozen forward of the flat walk must equal the plane kernels' bit for
bit: both apply the same coefficients with the same arithmetic.
"""

from __future__ import annotations

import pytest
import torch

import torch_bn_grad
from support.grad_cases import check_cases

_CASES = """[
    ((301, 16), torch.float16, None, False, False),
    ((301, 8), torch.bfloat16, None, False, False),
    ((303, 24), torch.bfloat16, None, False, False),
    ((299, 48), torch.float16, None, False, False),
    ((301, 8), torch.float32, None, False, False),
    ((301, 24), torch.float32, None, False, False),
    ((315, 16), torch.bfloat16, "relu", False, True),           # sign bits, a residual
    ((300, 8), torch.float32, "leaky_relu", True, True),        # memory saving: act' from the output
    ((303, 24), torch.float32, "relu", False, False),
    ((301, 24), torch.float16, "silu", False, False),           # silu keeps the row walk
    ((20011, 16), torch.bfloat16, None, False, False),          # many blocks
    ((301, 40), torch.float16, None, False, False),             # five chunks
    ((299, 40), torch.float32, None, False, False),
    ((303, 80), torch.bfloat16, "relu", False, True),
    ((300, 24), torch.bfloat16, "relu", False, True),           # three chunks with a second input
]
"""


def test_narrow_channel_counts_on_every_isa():
    check_cases(_CASES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [8, 16, 24, 40, 48, 80])
def test_flat_walk_matches_the_plane_kernels_bitwise(dtype, channels):
    g = torch.Generator().manual_seed(channels)
    x = (torch.randn(7, channels, 11, 13, generator=g) * 3 + 1).to(dtype)
    gamma, beta = torch.rand(channels, generator=g) + 0.5, torch.randn(channels, generator=g)
    mean, var = torch.randn(channels, generator=g), torch.rand(channels, generator=g) + 0.1
    planes, _, _ = torch_bn_grad.batch_norm_forward(x, gamma, beta, mean, var)
    rows, _, _ = torch_bn_grad.batch_norm_forward(x.contiguous(memory_format=torch.channels_last), gamma, beta, mean, var)
    assert rows.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(rows, planes)
