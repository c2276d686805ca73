"""Rows of channels whose last chunk is partial (``PartialChunk`` in
``csrc/cpu/kernels/row_walk.h``, ``affine_chunk`` in ``row_affine.h``): the
columns past a block's last full chunk are read as one chunk whose lanes
past the block load as zero, in the statistics' two passes, the grad sums
and the elementwise pass, walked by chunks or by rows, plain and fused.

A chunk is 16 float32 or 32 half-precision lanes under AVX512 and 8 or 16
under AVX2, so the channel counts below leave partial chunks of many widths
on both: rows narrower than one chunk (1, 7, 20), rows of full chunks and a
tail (40, 100), a second column block of 16 (1040 = 1024 + 16), segment
blocks of 7x7 planes (21 channels: 980 columns, then 49), and tensors of
12 MB or more, whose statistics (half precision) and grad sums walk rows.
The activations take act' from the input (silu: each partial chunk's
coefficients loaded for its lanes only), the sign bits (relu) and the
output (memory-saving leaky_relu). grad_cases checks each against float64
autograd and bitwise at one and two threads.
"""

from __future__ import annotations

from grad_cases import check_cases

_CASES = """[
    ((300, 1), torch.float32, None, False, False),
    ((300, 7), torch.float32, None, False, False),
    ((300, 20), torch.float16, None, False, False),
    ((300, 40), torch.bfloat16, None, False, False),
    ((300, 100), torch.float32, None, False, False),
    ((300, 7), torch.float64, None, False, False),
    ((100, 1040), torch.float16, None, False, False),            # column blocks of 1024 and 16
    ((17, 21, 7, 7), torch.float16, None, False, False),         # segment blocks of 980 and 49 columns
    ((17, 21, 7, 7), torch.float32, "relu", False, True),        # segments, sign bits, a residual
    ((300, 20), torch.float16, "silu", False, True),
    ((300, 100, 1), torch.float32, "silu", False, False),
    ((300, 40), torch.bfloat16, "relu", False, True),
    ((300, 20), torch.float32, "leaky_relu", True, True),        # memory saving: act' from the output
    ((6300, 1000), torch.float16, None, False, False),           # statistics and grad sums by rows
    ((3200, 1000), torch.float32, "silu", False, False),         # grad sums by rows
]
"""


def test_row_tails_on_every_isa():
    check_cases(_CASES)
