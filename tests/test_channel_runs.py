"""The backward in channel runs.

Where planes are short (under 1 KiB, or under 4 KiB on a 4 MB tensor), are
reduced as planes, and the backward's operands do not fit in the L3 (32 MB),
each thread reduces a run of adjacent channels, finishes them and runs their
elementwise pass while they are still in its L2 (``channel_run_channels`` in
``csrc/cpu/kernels/partition.h``). Every case below takes that path but the
last, whose odd channel count keeps 14x14 planes in the whole-array pass: a
last run shorter than the others, runs of 7x7 planes of eight channels each
(where the fused forward's sign bits start on a byte), 28x28 half-precision
planes, and the fused operators' gates (sign bits, the output in the
memory-saving mode, the recomputed input of silu, with a residual).
"""

from __future__ import annotations

from grad_cases import check_cases

_CASES = """[
    ((16, 1024, 14, 14), torch.float32, None, False, False),     # runs of 14 channels, the last of 2
    ((16, 1024, 14, 14), torch.float32, "relu", False, True),    # sign bits, 2 planes to a unit
    ((8, 8192, 7, 7), torch.float32, "relu", False, False),      # 7x7 planes of 8 rows: units of 8 planes
    ((16, 520, 28, 28), torch.bfloat16, "leaky_relu", False, False),
    ((8, 1040, 28, 28), torch.float32, "identity", True, True),  # memory saving: the output read back
    ((16, 1024, 14, 14), torch.float32, "silu", False, True),
    ((32, 513, 14, 14), torch.float32, "relu", False, False),    # odd channels: the whole-array pass
]
"""


def test_channel_runs_on_every_isa():
    check_cases(_CASES)
