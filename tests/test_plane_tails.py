"""Plane rows of every tail length, on every compiled ISA copy of the kernels.

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

import pytest

from isa_runs import run_on_every_isa

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
