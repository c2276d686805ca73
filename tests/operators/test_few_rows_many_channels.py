"""Few rows of many channels (``for_each_column_block`` in
``csrc/cpu/kernels/partition.h``): when every channel lies in one row block,
a thread reduces a 1024-channel column block, finishes its channels and runs
its elementwise pass in one parallel region. Each case takes that path with
more than one column block: on both threads (32K elements or more, each
channel's finish counted as 16 in the training operators) and on the calling
thread, a last block narrower than the others, plain and fused
(a residual, the sign bits' gate), the frozen forward included (grad_cases
checks it against the reference and bitwise at one and two threads).
"""

from __future__ import annotations

from support.grad_cases import check_cases

_CASES = """[
    ((16, 4100), torch.float32, None, False, False),             # 5 column blocks, the last of 4, in parallel
    ((6, 4096), torch.float32, None, False, False),              # training on both threads, frozen on the calling one
    ((6, 1100), torch.float32, None, False, False),              # on the calling thread, the last block of 76 (2 rows: ill-conditioned)
    ((40, 2056), torch.bfloat16, "relu", False, True),           # fused, with a residual
    ((24, 3000, 1), torch.float16, "silu", False, False),        # rank 3, inner 1
    ((9, 2500), torch.float64, None, False, False),
]
"""


def test_few_rows_of_many_channels_on_every_isa():
    check_cases(_CASES)
