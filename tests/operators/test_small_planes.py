"""Short planes reduced as segment rows.

Planes under 256 bytes (7x7 and smaller, float32 and half precision; 4x4 and
smaller in float64) with 16 or more outer rows are reduced by the row kernels
over the array seen as ``[outer, channels * inner]``, each channel a segment of
``inner`` columns (``reduces_as_segments`` in ``csrc/cpu/kernels/partition.h``).
Every case below takes that path: several column blocks with a partial last
one, segments shorter than a vector with the rows' scalar tail running across
channels, several row blocks merged, 1-D and 3-D data, and the fused
operators' backward, whose gates either accept such chunks (the output, the
memory-saving mode, the sign bits of 7x7 planes) or keep the plane kernels
(silu's recomputed input). Each ISA copy runs in its own process, against float64 autograd of
the unfused composition, and the results must be bitwise equal at one and at
two threads.
"""

from __future__ import annotations

from support.grad_cases import check_cases

_CASES = """[
    ((32, 301, 7, 7), torch.float32, None, False, False),   # 15 column blocks, the last partial
    ((40, 3, 5, 5), torch.bfloat16, None, False, False),    # 75 columns: a scalar tail across channels
    ((17, 33, 7, 7), torch.float16, None, False, False),
    ((24, 7, 4, 4), torch.float64, None, False, False),
    ((300, 21, 3, 3), torch.float32, None, False, False),   # four row blocks
    ((64, 6, 10), torch.float32, None, False, False),       # BatchNorm1d
    ((16, 4, 2, 3, 5), torch.float32, None, False, False),  # BatchNorm3d
    ((32, 40, 7, 7), torch.float32, "relu", False, True),
    ((32, 40, 7, 7), torch.bfloat16, "relu", False, False),
    ((32, 40, 7, 7), torch.float32, "leaky_relu", True, False),
    ((32, 40, 7, 7), torch.float32, "identity", True, True),
    ((32, 40, 7, 7), torch.float32, "silu", False, True),
    # 4 MB or more: the forward writes sign bits of its 7x7 planes, which
    # the backward's chunks read across planes
    ((32, 700, 7, 7), torch.float32, "relu", False, True),
    ((32, 1400, 7, 7), torch.bfloat16, "leaky_relu", False, False),
]
"""


def test_small_planes_on_every_isa():
    check_cases(_CASES)
