"""Masked batch norm (padded batches): equal to gather -> float64 batch norm ->
scatter, whatever the padding holds or how long it is, for every dtype and
layout, in the functional form, the modules and the operators; on the CPU and,
where one is available, on CUDA (the ``device`` fixture, conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import functional as F
from support.isa_runs import run_on_every_isa
from support.masked_reference import LAYOUTS, close, gathered_forward, laid_out, lengths_mask, padded_batch, parameters
from support.reference import DTYPES, stats_dtype

FORWARD = torch.ops.torch_bn_grad.batch_norm_masked_forward.default
BACKWARD = torch.ops.torch_bn_grad.batch_norm_masked_backward.default


def run_masked(x, mask, weight, bias, dy, eps=1e-5):
    """dst, mean, variance, count, and the gradients of sum(dst * dy)."""
    x = x.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    b = bias.detach().requires_grad_()
    dst, mean, var, count = FORWARD(x, mask, w, b, None, None, eps)
    dst.backward(dy)
    return dst, mean, var, count, x.grad, w.grad, b.grad


def on(device, *tensors):
    return tuple(t.to(device) for t in tensors)


def run_reference(x, mask, weight, bias, dy, eps=1e-5):
    x = x.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = bias.detach().double().requires_grad_()
    dst, mean, var, count = gathered_forward(x, mask, w, b, eps)
    dst.backward(dy.double())
    return dst, mean, var, count, x.grad, w.grad, b.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", LAYOUTS)
@pytest.mark.parametrize("random_mask", [False, True])
def test_matches_gathered_float64_batch_norm(device, dtype, shape, layout, random_mask):
    x, mask = on(device, *padded_batch(shape, dtype, seed=1, offset=3.0, random_mask=random_mask))
    x = laid_out(x, layout)
    weight, bias = on(device, *parameters(shape[1], dtype))
    dy = laid_out(torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device, dtype), layout)
    ours = run_masked(x, mask, weight, bias, dy)
    ref = run_reference(x, mask, weight, bias, dy)
    dst, mean, var, count, dx, dw, db = ours
    close(dst, ref[0], dtype)
    assert dst.stride() == x.stride() or layout == "contiguous"
    assert dst.dtype == dtype and mean.dtype == stats_dtype(dtype)
    close(mean, ref[1], dtype)
    close(var, ref[2], dtype)
    assert count.dtype == torch.float64 and count.item() == ref[3]
    scale = math.sqrt(ref[3])  # the sums of count terms
    close(dx, ref[4], dtype, 4.0)
    close(dw, ref[5], dtype, scale)
    close(db, ref[6], dtype, scale)
    padded = ~mask.unsqueeze(1).expand_as(x)
    assert (dst[padded] == 0).all() and (dx[padded] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_dim_input_with_a_mask_per_sample(device, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 9, generator=g).to(device, dtype)
    mask = (torch.rand(37, generator=g) < 0.7).to(device)
    weight, bias = on(device, *parameters(9, dtype))
    dy = torch.randn(37, 9, generator=g).to(device, dtype)
    ours, ref = run_masked(x, mask, weight, bias, dy), run_reference(x, mask, weight, bias, dy)
    for a, e, scale in zip(ours[:3] + ours[4:], ref[:3] + ref[4:], (1, 1, 1, 4, 6, 6)):
        close(a, e, dtype, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", [((4, 6, 37), "contiguous"), ((4, 6, 37), "transposed"),
                                          ((3, 5, 9, 4), "channels_last"), ((5, 7), "contiguous")])
@pytest.mark.parametrize("pad_value", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_padding_content_changes_nothing(device, dtype, shape, layout, pad_value):
    """NaN, inf or 1e30 in the padding (of the input and of the upstream gradient) give
    bitwise the results of zeros there: outputs, gradients, running statistics."""
    if len(shape) == 2:
        g = torch.Generator().manual_seed(4)
        x0 = torch.randn(shape, generator=g).to(dtype)
        mask = torch.rand(shape[0], generator=g) < 0.6
    else:
        x0, mask = padded_batch(shape, dtype, seed=4)
    x0, mask = on(device, x0, mask)
    valid = mask.unsqueeze(1).expand(shape)
    x0 = laid_out(x0, layout)
    dy0 = laid_out(torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(device, dtype), layout)
    # 1e30 as the largest finite value of dtype (float16: 65504), so that it stays finite there.
    fill = pad_value if not math.isfinite(pad_value) else min(pad_value, torch.finfo(dtype).max)
    results = []
    for value in (0.0, fill):
        x = laid_out(torch.where(valid, x0, value), layout)
        dy = laid_out(torch.where(valid, dy0, value), layout)
        m = torch_bn_grad.nn.BatchNorm1d(shape[1]) if len(shape) <= 3 else torch_bn_grad.nn.BatchNorm2d(shape[1])
        m = m.to(device, stats_dtype(dtype))
        xr = x.detach().requires_grad_()
        out = m(xr, mask)
        out.backward(dy)
        results.append((out, xr.grad, m.weight.grad, m.bias.grad, m.running_mean, m.running_var))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_padding_length_changes_nothing(device):
    """The same sequences padded to 30 or to 64 frames: the same results (within rounding)."""
    g = torch.Generator().manual_seed(6)
    lengths = [30, 11, 23, 17]
    x30, dy30, mask30 = on(device, torch.randn(4, 8, 30, generator=g), torch.randn(4, 8, 30, generator=g),
                           lengths_mask(lengths, 30))
    x64 = torch.nn.functional.pad(x30, (0, 34), value=5.0)
    dy64 = torch.nn.functional.pad(dy30, (0, 34), value=-7.0)
    mask64 = lengths_mask(lengths, 64).to(device)
    outs = []
    for x, dy, mask in ((x30, dy30, mask30), (x64, dy64, mask64)):
        m = torch_bn_grad.nn.BatchNorm1d(8).to(device)
        xr = x.clone().requires_grad_()
        out = m(xr, mask)
        out.backward(dy)
        outs.append((out[..., :30], xr.grad[..., :30], m.weight.grad, m.bias.grad, m.running_mean, m.running_var))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_without_valid_positions(device, dtype):
    """Zeros out, zero gradients, running statistics untouched, nothing raised."""
    x = torch.randn(3, 4, 10).to(device, dtype)
    x[0, 0, 0] = float("nan")
    mask = torch.zeros(3, 10, dtype=torch.bool, device=device)
    m = torch_bn_grad.nn.BatchNorm1d(4).to(device, stats_dtype(dtype))
    with torch.no_grad():
        m.running_mean.fill_(0.25)
        m.running_var.fill_(2.0)
    xr = x.clone().requires_grad_()
    out = m(xr, mask)
    out.backward(torch.randn_like(out))
    assert (out == 0).all() and (xr.grad == 0).all()
    assert (m.weight.grad == 0).all() and (m.bias.grad == 0).all()
    assert (m.running_mean == 0.25).all() and (m.running_var == 2.0).all()
    assert m.num_batches_tracked.item() == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_match_torch_on_the_gathered_batch(device, dtype, momentum):
    """Module training steps: running statistics as torch's BatchNorm1d on the valid
    positions alone (unbiased variance of the valid count), then eval outputs."""
    ours = torch_bn_grad.nn.BatchNorm1d(6, momentum=momentum).to(device, stats_dtype(dtype))
    ref = torch.nn.BatchNorm1d(6, momentum=momentum).double()
    for step in range(3):
        x, mask = padded_batch((5, 6, 33), dtype, seed=10 + step, offset=2.0)
        ours(*on(device, x, mask))
        ref(x.double().movedim(1, -1)[mask])  # (valid, C)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype != torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ours.running_mean.double().cpu(), ref.running_mean, **tol)
    torch.testing.assert_close(ours.running_var.double().cpu(), ref.running_var, **tol)
    assert ours.num_batches_tracked.item() == 3
    ours.eval()
    ref.eval()
    x, mask = padded_batch((5, 6, 33), dtype, seed=20, pad_value=float("nan"))
    out = ours(*on(device, x, mask)).cpu()
    expected = torch.zeros(x.shape, dtype=torch.float64).movedim(1, -1)
    expected[mask] = ref(x.double().movedim(1, -1)[mask])
    close(out, expected.movedim(-1, 1), dtype, 2.0)


@pytest.mark.parametrize("module", [torch_bn_grad.nn.BatchNorm1d, torch_bn_grad.nn.BatchNorm2d,
                                    torch_bn_grad.nn.BatchNorm3d, torch_bn_grad.nn.SyncBatchNorm])
def test_modules_take_a_mask(device, module):
    rank = {torch_bn_grad.nn.BatchNorm2d: 4, torch_bn_grad.nn.BatchNorm3d: 5}.get(module, 3)
    shape = (3, 4, 12, 3, 2)[:rank]
    x, mask = on(device, *padded_batch(shape, torch.float32, seed=7))
    m = module(4).to(device)
    out = m(x, mask)
    expected = gathered_forward(x, mask, m.weight, m.bias, m.eps)[0]
    torch.testing.assert_close(out.double(), expected.detach(), atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "silu", "identity"])
def test_fused_modules_give_zero_at_padding_whatever_the_residual(device, activation):
    x, mask = on(device, *padded_batch((3, 4, 20), torch.float32, seed=8))
    residual = torch.randn(3, 4, 20).to(device)
    residual_nan = torch.where(mask.unsqueeze(1), residual, float("nan"))
    m = torch_bn_grad.nn.BatchNormAct1d(4, activation=activation).to(device)
    xr = x.clone().requires_grad_()
    rr = residual_nan.clone().requires_grad_()
    out = m(xr, rr, mask=mask)
    out.backward(torch.randn_like(out))
    bn = gathered_forward(x, mask, m.weight, m.bias, m.eps)[0].float()
    expected = torch_bn_grad._rules.activation.activate(bn + residual, activation, m.negative_slope)
    expected = torch.where(mask.unsqueeze(1), expected, 0)
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=5e-5)
    padded = ~mask.unsqueeze(1).expand_as(x)
    assert (out[padded] == 0).all() and (xr.grad[padded] == 0).all() and (rr.grad[padded] == 0).all()
    assert torch.isfinite(m.weight.grad).all()
    torch.testing.assert_close(
        torch_bn_grad.functional.batch_norm_act(x, None, None, m.weight, m.bias, True, residual=residual_nan,
                                                activation=activation, mask=mask),
        out.detach())


def test_functional_matches_the_module():
    x, mask = padded_batch((4, 5, 16), torch.float32, seed=9)
    m = torch_bn_grad.nn.BatchNorm1d(5)
    rm, rv = torch.zeros(5), torch.ones(5)
    out = F.batch_norm(x, rm, rv, m.weight, m.bias, training=True, mask=mask)
    assert torch.equal(out, m(x, mask))
    assert torch.equal(rm, m.running_mean) and torch.equal(rv, m.running_var)
    m.eval()
    assert torch.equal(F.batch_norm(x, rm, rv, m.weight, m.bias, mask=mask), m(x, mask))


def test_results_do_not_depend_on_the_thread_count():
    x, mask = padded_batch((8, 16, 300), torch.float32, seed=11, random_mask=True)
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    dy = torch.randn(x.shape)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append([t for layout in (x, xt) for t in run_masked(layout, mask, *parameters(16, torch.float32),
                                                                           dy)])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# float64 data of short planes: the kernels run each channel's pass right
# after its sums, or a run of channels at a time (forced here by
# TORCH_BN_GRAD_CHANNEL_RUNS_MB=0); the compensated sums must not depend on it.
_SCHEDULE_SCRIPT = """
import hashlib, json, torch, torch_bn_grad
g = torch.Generator().manual_seed(3)
x = torch.randn(8, 64, 16, generator=g, dtype=torch.float64) * 3 + 1
dy = torch.randn(8, 64, 16, generator=g, dtype=torch.float64)
mask = torch.arange(16)[None, :] < torch.tensor([16, 5, 9, 16, 1, 12, 7, 16])[:, None]
w = torch.rand(64, generator=g, dtype=torch.float64) + 0.5
b = torch.randn(64, generator=g, dtype=torch.float64)
ops = torch.ops.torch_bn_grad
dst, mean, var, _ = ops.batch_norm_masked_forward(x, mask, w, b, None, None, 1e-5)
grads = ops.batch_norm_masked_backward(x, mask, dy, mean, var, w, 1e-5, True, [True, True, True])
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (dst, mean, var, *grads))).hexdigest()
print(json.dumps({"isa": torch_bn_grad.cpu_kernel_isa(), "digest": digest}))
"""


def test_float64_results_do_not_depend_on_the_schedule():
    default = run_on_every_isa(_SCHEDULE_SCRIPT)
    runs = run_on_every_isa(_SCHEDULE_SCRIPT, env={"TORCH_BN_GRAD_CHANNEL_RUNS_MB": "0"})
    for isa, run in runs.items():
        assert run["digest"] == default[isa]["digest"], isa


def test_errors_name_the_argument_and_change_nothing():
    x = torch.randn(2, 3, 5)
    m = torch_bn_grad.nn.BatchNorm1d(3)
    before = (m.running_mean.clone(), m.running_var.clone())
    with pytest.raises(TypeError, match="mask must have dtype torch.bool"):
        m(x, torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 5\)"):
        m(x, torch.ones(2, 3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        F.batch_norm(x, None, None, training=True, mask=[True, False])
    assert torch.equal(m.running_mean, before[0]) and torch.equal(m.running_var, before[1])
    assert m.num_batches_tracked.item() == 0
    # The operators check the same, before writing anything.
    with pytest.raises(TypeError, match="batch_norm_masked_forward: mask must have dtype torch.bool"):
        FORWARD(x, torch.ones(2, 5, dtype=torch.int64), None, None, None, None, 1e-5)
    with pytest.raises(ValueError, match=r"batch_norm_masked_backward: mask must have shape \[2, 5\]"):
        BACKWARD(x, torch.ones(5, dtype=torch.bool), x, torch.zeros(3), torch.ones(3), None, 1e-5, True,
                 [True, True, True])
