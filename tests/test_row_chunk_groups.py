"""Rows of channels whose chunks do not fill whole groups of four
(``for_chunk_groups`` in ``csrc/cpu/kernels/row_walk.h``): the two or three
chunks left after the full groups are walked as one last group, in the
statistics' passes and in the grad sums of rows of one group. A chunk is 16
float32 (8 float64) lanes under AVX512 and 8 (4) under AVX2, so each case
takes a group of two or three on one ISA or the other: 16, 24, 32 and 48
channels alone, 96 and 112 after full groups, 40 with a tail past the last
full chunk; plain and fused (the grad sums' epilogue, a residual), rank 2 and 3. grad_cases checks each against float64 autograd and
bitwise at one and two threads.
"""

from __future__ import annotations

from grad_cases import check_cases

_CASES = """[
    ((300, 16), torch.float32, None, False, False),
    ((300, 24), torch.float32, None, False, False),
    ((300, 32), torch.float32, None, False, False),
    ((300, 48), torch.float32, None, False, False),
    ((2500, 48), torch.float32, None, False, False),              # on both threads
    ((300, 96), torch.float32, None, False, False),
    ((300, 112), torch.float32, None, False, False),
    ((300, 40), torch.float32, None, False, False),               # 8 columns past the last full chunk (AVX512)
    ((300, 24), torch.float64, None, False, False),
    ((300, 12), torch.float64, None, False, False),
    ((300, 32, 1), torch.float32, "relu", False, True),           # rank 3, inner 1
    ((300, 48), torch.float32, "leaky_relu", False, False),
]
"""


def test_row_chunk_groups_on_every_isa():
    check_cases(_CASES)
