"""CUDA only (conftest.py collects this file only where CUDA is available):
every CUDA variant (``torch_bn_grad.config.cuda_variants``, docs/design.md
"CUDA variants") gives bitwise the default path's results (outputs, gradients,
running statistics) on shapes of each launch path (the persistent kernels and
the two-kernel one), every data dtype, both memory layouts, plain and fused
modules, and saves the launches it is meant to save. One GPU run of this file
checks every variant; scripts/gpu_check.sh's ``variants`` stage then times them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torch_bn_grad
from torch_bn_grad import config

VARIANTS = config.cuda_variant_names()


@contextlib.contextmanager
def variants_on(names):
    before = config.cuda_variants
    config.cuda_variants = names
    try:
        yield
    finally:
        config.cuda_variants = before


# (id, module factory, input shape, memory format, input dtype, module dtype, residual)
CASES = [
    ("2d-persistent", lambda: torch_bn_grad.nn.BatchNorm2d(16), (4, 16, 8, 8), torch.contiguous_format,
     torch.float32, torch.float32, False),
    ("2d-two-kernel", lambda: torch_bn_grad.nn.BatchNorm2d(64), (32, 64, 28, 28), torch.contiguous_format,
     torch.float32, torch.float32, False),
    ("2d-channels-last", lambda: torch_bn_grad.nn.BatchNorm2d(64), (32, 64, 28, 28), torch.channels_last,
     torch.float32, torch.float32, False),
    ("2d-channels-last-small", lambda: torch_bn_grad.nn.BatchNorm2d(256), (8, 256, 7, 7), torch.channels_last,
     torch.float32, torch.float32, False),
    ("1d-rows-bfloat16", lambda: torch_bn_grad.nn.BatchNorm1d(1024), (4096, 1024), torch.contiguous_format,
     torch.bfloat16, torch.bfloat16, False),
    ("1d-rows-float16-float32-buffers", lambda: torch_bn_grad.nn.BatchNorm1d(512), (256, 512),
     torch.contiguous_format, torch.float16, torch.float32, False),
    ("1d-few-rows-float64", lambda: torch_bn_grad.nn.BatchNorm1d(33), (3, 33), torch.contiguous_format,
     torch.float64, torch.float64, False),
    ("1d-ncl-float16", lambda: torch_bn_grad.nn.BatchNorm1d(24), (5, 24, 37), torch.contiguous_format,
     torch.float16, torch.float16, False),
    ("3d", lambda: torch_bn_grad.nn.BatchNorm3d(8), (2, 8, 5, 4, 3), torch.contiguous_format,
     torch.float32, torch.float32, False),
    ("2d-cumulative", lambda: torch_bn_grad.nn.BatchNorm2d(32, momentum=None), (16, 32, 14, 14),
     torch.contiguous_format, torch.float32, torch.float32, False),
    ("2d-no-affine", lambda: torch_bn_grad.nn.BatchNorm2d(32, affine=False), (16, 32, 14, 14),
     torch.channels_last, torch.bfloat16, torch.float32, False),
    ("act-relu-residual", lambda: torch_bn_grad.nn.BatchNormAct2d(64), (32, 64, 14, 14), torch.channels_last,
     torch.float32, torch.float32, True),
    ("act-leaky-bfloat16", lambda: torch_bn_grad.nn.BatchNormAct2d(16, activation="leaky_relu"), (4, 16, 8, 8),
     torch.contiguous_format, torch.bfloat16, torch.bfloat16, False),
    # Two-kernel columns whose tiles the last block finishes (13 and 25 row splits), and planes whose
    # channels have 256 partials (the block merge).
    ("2d-channels-last-late", lambda: torch_bn_grad.nn.BatchNorm2d(512), (32, 512, 7, 7), torch.channels_last,
     torch.float32, torch.float32, False),
    ("2d-channels-last-late-bfloat16", lambda: torch_bn_grad.nn.BatchNorm2d(512), (64, 512, 7, 7),
     torch.channels_last, torch.bfloat16, torch.float32, False),
    ("act-relu-residual-late", lambda: torch_bn_grad.nn.BatchNormAct2d(512), (32, 512, 7, 7), torch.channels_last,
     torch.float16, torch.float16, True),
    ("2d-planes-block-merge", lambda: torch_bn_grad.nn.BatchNorm2d(4), (16, 4, 512, 512), torch.contiguous_format,
     torch.float32, torch.float32, False),
]

# Each variant alone, then all of them at once (they touch the same kernels: the
# forward's running update is stored where the last block stores the coefficients).
VARIANT_SETS = [frozenset({name}) for name in VARIANTS] + [frozenset(VARIANTS)]


def _steps(case, variants):
    """Three training steps of a fresh module of `case` (same seed each time)
    under `variants`: each step's output and input gradient, then the
    parameter gradients and buffers."""
    _, factory, shape, fmt, dtype, module_dtype, residual = case
    torch.manual_seed(0)
    module = factory().to("cuda", module_dtype)
    with torch.no_grad():
        if module.weight is not None:
            module.weight.uniform_(0.5, 1.5)
            module.bias.uniform_(-0.5, 0.5)
    results = []
    g = torch.Generator(device="cuda").manual_seed(1)
    with variants_on(variants):
        for step in range(3):
            x = (torch.randn(shape, device="cuda", generator=g) * (1 + step) + 0.5).to(dtype)
            x = x.contiguous(memory_format=fmt) if x.dim() == 4 else x
            x.requires_grad_()
            extra = (torch.randn(x.shape, device="cuda", generator=g).to(dtype),) if residual else ()
            y = module(x, *extra)
            y.backward(torch.randn(y.shape, device="cuda", generator=g).to(y.dtype))
            results += [y.detach(), x.grad]
    params = [p.grad for p in module.parameters()]
    torch.cuda.synchronize()
    return results + params + [b.clone() for b in module.buffers()]


@pytest.mark.parametrize("variants", VARIANT_SETS, ids=lambda v: "+".join(sorted(v)))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_variant_is_bitwise_the_default(case, variants):
    default = _steps(case, frozenset())
    chosen = _steps(case, variants)
    assert len(default) == len(chosen)
    for i, (a, b) in enumerate(zip(default, chosen)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()), i


def _kernels_in_forward(module, x, variants) -> int:
    with variants_on(variants):
        module(x)  # warm-up: the plan, the allocator
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            module(x)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.parametrize("shape", [(4, 16, 8, 8), (32, 64, 28, 28)], ids=["persistent", "two-kernel"])
def test_fused_update_takes_one_launch_fewer(shape):
    module = torch_bn_grad.nn.BatchNorm2d(shape[1]).cuda()
    x = torch.randn(shape, device="cuda")
    default = _kernels_in_forward(module, x, frozenset())
    fused = _kernels_in_forward(module, x, {"fused_update"})
    assert fused == default - 1, (default, fused)


def _kernels_in_backward(module, x, variants) -> int:
    """Kernels of one backward of `module` at `x` under `variants`, after a warm-up step."""
    with variants_on(variants):
        module(x).sum().backward()
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = module(x)
        dy = torch.ones_like(y)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y.backward(dy)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_param_dtype_grads_drops_the_casts(dtype, fused):
    module = (torch_bn_grad.nn.BatchNormAct2d(64) if fused else torch_bn_grad.nn.BatchNorm2d(64)).to("cuda", dtype)
    x = torch.randn(8, 64, 14, 14, device="cuda", dtype=dtype, requires_grad=True)
    default = _kernels_in_backward(module, x, frozenset())
    uncast = _kernels_in_backward(module, x, {"param_dtype_grads"})
    assert uncast == default - (4 if fused else 3), (default, uncast)


# (shape, memory format, launches saved a direction): two-kernel planes; columns of 13 row splits;
# columns of 98, more than a thread of the last block merges (the coefficient kernel's warps do).
LAST_BLOCK_CASES = [
    ((32, 64, 28, 28), torch.contiguous_format, 1),
    ((32, 512, 7, 7), torch.channels_last, 1),
    ((32, 64, 28, 28), torch.channels_last, 0),
]


@pytest.mark.parametrize("shape,fmt,saved", LAST_BLOCK_CASES, ids=["planes", "columns", "columns-many-splits"])
def test_last_block_coefficients_takes_one_launch_fewer(shape, fmt, saved):
    module = torch_bn_grad.nn.BatchNorm2d(shape[1]).cuda()
    x = torch.randn(shape, device="cuda").contiguous(memory_format=fmt).requires_grad_()
    variant = {"last_block_coefficients"}
    assert _kernels_in_forward(module, x, variant) == _kernels_in_forward(module, x, frozenset()) - saved
    assert _kernels_in_backward(module, x, variant) == _kernels_in_backward(module, x, frozenset()) - saved
