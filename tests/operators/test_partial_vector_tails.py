"""Data whose rows do not fill whole vectors: channel counts and plane lengths
of every tail, on every compiled ISA copy of the CPU kernels, against float64.

Rows of channels whose last chunk is partial (``PartialChunk`` in
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

Rows of channels whose chunks do not fill whole groups of four
(``for_chunk_groups`` in ``csrc/cpu/kernels/row_walk.h``): the two or three
chunks left after the full groups are walked as one last group, in the
statistics' passes and in the grad sums of rows of one group. A chunk is 16
float32 (8 float64) lanes under AVX512 and 8 (4) under AVX2, so each case
takes a group of two or three on one ISA or the other: 16, 24, 32 and 48
channels alone, 96 and 112 after full groups, 40 with a tail past the last
full chunk; plain and fused (the grad sums' epilogue, a residual), rank 2 and 3. grad_cases checks each against float64 autograd and
bitwise at one and two threads.

Plane rows of every tail length, on every compiled ISA copy of the kernels.

A plane row (one channel's ``inner`` elements) is walked in chunks of one
vector of the data type; its last chunk is partial unless ``inner`` is a
multiple of the chunk. 16-bit data on AVX2 loads partial chunks with masked
32-bit loads plus the odd last element (vec_io.h), and plain batch norm
writes a row's partial end as the full chunk ending there (plane_kernels.h).
Rows of 1 to 40 elements, and 17 outer rows (segment reductions), cover every
tail length of 8-, 16- and 32-element chunks, checked against float64 in the
process of each ISA.
"""

from __future__ import annotations


from support.grad_cases import check_cases
from support.isa_runs import run_on_every_isa


# ------------------------------------------------------------------ rows of channels with a partial last chunk
_ROW_TAIL_CASES = """[
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


def test_channel_counts_with_a_partial_last_vector():
    check_cases(_ROW_TAIL_CASES)


# ------------------------------------------------------------------ rows whose chunks leave a partial group of four
_CHUNK_GROUP_CASES = """[
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


def test_channel_counts_with_a_partial_group_of_vectors():
    check_cases(_CHUNK_GROUP_CASES)


# ------------------------------------------------------------------ plane rows of every tail length
_SCRIPT = r"""
import json, torch, torch_bn_grad
import torch.nn.functional as F
g = torch.Generator().manual_seed(11)
worst = {}
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    eps_d = max(torch.finfo(dtype).eps, 1e-5)  # float32: well within its rounding of these sums
    for outer in (3, 17):
        for n in range(1, 41):
            x = (torch.randn(outer, 3, n, generator=g) * 2 + 1).to(dtype)
            dy = torch.randn(outer, 3, n, generator=g).to(dtype)
            w = torch.rand(3, generator=g) + 0.5
            b = torch.randn(3, generator=g)
            xd = x.double().requires_grad_()
            wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
            ref = F.batch_norm(xd, None, None, wd, bd, training=True, eps=1e-5)
            ref_dx, ref_dw, ref_db = torch.autograd.grad(ref, (xd, wd, bd), dy.double())
            y, mean, var = torch_bn_grad.batch_norm_forward(x, w, b)
            frozen, _, _ = torch_bn_grad.batch_norm_forward(x, w, b, mean, var)
            dx, dw, db = torch_bn_grad.batch_norm_backward(x, dy, mean, var, w)
            def excess(ours, want, rel):
                # error beyond rel * |want| + rel (within the dtype's rounding when <= 0)
                return float(((ours.double() - want).abs() - rel * (want.abs() + 1)).max())
            name = f"{dtype}".replace("torch.", "") + f" {outer}x3x{n}"
            worst[name] = max(
                excess(y, ref.detach(), eps_d),
                excess(frozen, ref.detach(), eps_d),
                excess(dx, ref_dx, 4 * eps_d),
                excess(dw, ref_dw, 1e-4),
                excess(db, ref_db, 1e-4),
            )
print(json.dumps({"isa": torch_bn_grad.cpu_kernel_isa(), "worst": worst}))
"""


def test_plane_rows_of_every_tail_length():
    runs = run_on_every_isa(_SCRIPT)
    for isa, run in runs.items():
        bad = {case: err for case, err in run["worst"].items() if err > 0}
        assert not bad, (isa, bad)
