"""The statistics' first pass walked row by row (``stats_walk_rows`` in
``csrc/cpu/kernels/row_statistics.h``): half-precision rows of channels
(channels_last, 2-D inputs) of 512 bytes or more in tensors of 12 MB or more
are read one whole row after another, the run's sums in L1, instead of a line
of each of 8 rows at a time; the sums meet in the same order. Each case takes
that path: plain and fused, a channel count with columns past the last full
chunk (520 = 16 chunks of 32 + 8), and a residual with the sign bits' gate.
"""

from __future__ import annotations

from grad_cases import check_cases

_CASES = """[
    ((25600, 256), torch.float16, None, False, False),
    ((13000, 520), torch.bfloat16, None, False, False),          # 8 columns past the last full chunk
    ((25600, 256), torch.bfloat16, "relu", False, True),         # fused, with a residual
]
"""


def test_stats_row_walk_on_every_isa():
    check_cases(_CASES)
