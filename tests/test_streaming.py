"""Large outputs, which the CPU kernels write with streaming stores.

An elementwise pass that moves 48 MB or more (its inputs and output) writes
its output with non-temporal stores where lines (plane rows, or rows of
channels) start on a cache line (``streams_output`` in
``csrc/cpu/kernels/partition.h``), one intrinsic per ISA; rows of 16
channels, walked as one flat run (``tiled_rows``), where the run does. The outputs here
are 24 MB or more, so that the forward's and eval's passes (x and out)
stream as well as the backward's (x, dy and dx). Each ISA copy runs in
its own process (``ATEN_CPU_CAPABILITY``) and is checked against float64
autograd of ``torch.nn.functional.batch_norm``: forward (batch and frozen
statistics), and backward, for NCHW planes, channels_last rows and
BatchNorm1d rows, float32 and bfloat16: a wrong, misplaced or dropped
streaming store shows as errors far above the tolerances (a store off by a
factor of 1 + 1e-4 fails).
"""

from __future__ import annotations

from isa_runs import run_on_every_isa

_SCRIPT = r"""
import json, torch, torch.nn.functional as F, torch_bn_grad
g = torch.Generator().manual_seed(11)
cases = [((32, 64, 56, 56), torch.float32, False), ((32, 64, 56, 56), torch.float32, True),
         ((6272, 1024), torch.float32, False), ((32, 64, 80, 80), torch.bfloat16, False),
         ((32, 64, 80, 80), torch.bfloat16, True), ((64, 16, 112, 112), torch.bfloat16, True)]
errors = []
for shape, dtype, channels_last in cases:
    assert 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() >= 48 << 20
    x = (torch.randn(shape, generator=g) * 2 + 1).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    if channels_last:
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    C = shape[1]
    gamma, beta = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
    dst, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, beta, epsilon=1e-5)
    frozen, _, _ = torch_bn_grad.batch_norm_forward(x, gamma, beta, mean, var, epsilon=1e-5)
    dx, dgamma, dbeta = torch_bn_grad.batch_norm_backward(x, dy, mean, var, gamma, epsilon=1e-5)
    xd = x.double().requires_grad_()
    gd, bd = gamma.double().requires_grad_(), beta.double().requires_grad_()
    ref = F.batch_norm(xd, None, None, gd, bd, training=True, eps=1e-5)
    ref_dx, ref_dg, ref_db = torch.autograd.grad(ref, (xd, gd, bd), dy.double())
    ref_frozen = F.batch_norm(x.double(), mean.double(), var.double(), gamma.double(), beta.double(),
                              training=False, eps=1e-5)
    def err(a, b):
        return ((a.double() - b) / (b.abs() + 1)).abs().max().item()
    errors.append({"case": f"{shape} {dtype} channels_last={channels_last}",
                   "dst_is_channels_last": dst.is_contiguous(memory_format=torch.channels_last) if channels_last else None,
                   "dst": err(dst, ref.detach()), "frozen": err(frozen, ref_frozen),
                   "dx": err(dx, ref_dx), "dgamma": err(dgamma, ref_dg), "dbeta": err(dbeta, ref_db)})
print(json.dumps({"isa": torch_bn_grad.cpu_kernel_isa(), "errors": errors}))
"""


def test_large_outputs_on_every_isa():
    for capability, run in run_on_every_isa(_SCRIPT).items():
        for case in run["errors"]:
            half = "bfloat16" in case["case"]
            # Relative to |reference| + 1: one rounding of the output (bfloat16's is 2^-8).
            bound = 2 ** -7 if half else 1e-5
            for name in ("dst", "frozen", "dx"):
                assert case[name] < bound, (capability, case)
            for name in ("dgamma", "dbeta"):
                assert case[name] < 1e-4, (capability, case)
            assert case["dst_is_channels_last"] in (None, True), (capability, case)
