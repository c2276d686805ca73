"""Masked batch norm under autograd of every order, opcheck (fake
implementations), torch.compile without graph breaks, and torch.export."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import torch_bn_grad
from support.masked_reference import lengths_mask, padded_batch

FORWARD = torch.ops.torch_bn_grad.batch_norm_masked_forward.default
BACKWARD = torch.ops.torch_bn_grad.batch_norm_masked_backward.default


def small_inputs(layout: str, seed: int = 0):
    """float64 (x, mask, weight, bias) with NaN in the padding (which must not matter)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "2d":
        x = torch.randn(7, 3, generator=g, dtype=torch.float64)
        mask = torch.tensor([True, False, True, True, False, True, True])
    else:
        x, mask = padded_batch((3, 3, 6), torch.float64, seed=seed, pad_value=float("nan"))
        if layout == "transposed":
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
    weight = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    bias = torch.randn(3, generator=g, dtype=torch.float64)
    return x, mask, weight, bias


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "2d"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
def test_gradcheck_and_gradgradcheck(device, layout, training):
    x, mask, weight, bias = (t.to(device) for t in small_inputs(layout))
    inputs = [x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()]
    if training:
        def fn(x, w, b):
            dst, mean, var, _ = FORWARD(x, mask, w, b, None, None, 1e-3)
            return dst, mean, var
    else:
        mean = torch.randn(3, dtype=torch.float64).to(device).requires_grad_()
        var = (torch.rand(3, dtype=torch.float64) + 0.5).to(device).requires_grad_()
        inputs += [mean, var]

        def fn(x, w, b, m, v):  # the returned statistics are the given ones: their gradients add
            dst, mean, var, _ = FORWARD(x, mask, w, b, m, v, 1e-3)
            return dst, mean, var

    # gradcheck perturbs the padding too: its gradient must be 0 there, and NaN in it must not leak.
    x.data = torch.where(mask.unsqueeze(1) if x.dim() > 2 else mask[:, None], x.data, 0.0)
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)  # random (non-uniform) upstream gradients


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "2d"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
def test_forward_mode_matches_finite_differences(device, layout, training):
    x, mask, weight, bias = (t.to(device) for t in small_inputs(layout))
    x = torch.where(mask.unsqueeze(1) if x.dim() > 2 else mask[:, None], x, 0.0)  # gradcheck perturbs padding
    mean = torch.randn(3, dtype=torch.float64).to(device)
    var = (torch.rand(3, dtype=torch.float64) + 0.5).to(device)
    inputs = [t.requires_grad_() for t in (x, weight, bias, mean, var)]

    def fn(x, w, b, m, v):
        dst, mean_used, var_used, _ = FORWARD(x, mask, w, b, None if training else m, None if training else v, 1e-3)
        return dst, mean_used, var_used

    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_backward_ad=False,
                                    check_undefined_grad=False, check_batched_grad=False)


def test_forward_mode_ignores_the_padding_and_a_batch_without_valid_positions():
    x, mask, weight, bias = small_inputs("contiguous")  # NaN at padded positions
    tangent = torch.where(mask.unsqueeze(1), torch.randn_like(x), float("nan"))
    dst, (t_dst, t_mean, t_var) = torch.func.jvp(
        lambda x: FORWARD(x, mask, weight, bias, None, None, 1e-3)[:3], (x,), (tangent,))
    assert torch.isfinite(t_dst).all() and (t_dst[~mask.unsqueeze(1).expand_as(x)] == 0).all()
    assert torch.isfinite(t_mean).all() and torch.isfinite(t_var).all()
    none = torch.zeros_like(mask)
    _, (t_dst, t_mean, t_var) = torch.func.jvp(
        lambda x: FORWARD(x, none, weight, bias, None, None, 1e-3)[:3], (x,), (tangent,))
    assert (t_dst == 0).all() and (t_mean == 0).all() and (t_var == 0).all()


def test_third_order_through_the_double_backward():
    x, mask, weight, _ = small_inputs("contiguous")
    x = torch.where(mask.unsqueeze(1), x, 0.0).requires_grad_()
    dy = torch.randn_like(x, dtype=torch.float64).requires_grad_()
    mean, var = x.detach().mean((0, 2)), x.detach().var((0, 2))  # constants, also under gradcheck's perturbation

    def fn(x, dy):
        return BACKWARD(x, mask, dy, mean, var, weight, 1e-3, True, [True, True, True])[0]

    assert torch.autograd.gradgradcheck(fn, (x, dy))


def test_double_backward_ignores_padding_content():
    """Second-order gradients with NaN in the padding equal those with zeros there."""
    results = []
    for pad in (0.0, float("nan")):
        x, mask = padded_batch((3, 4, 9), torch.float64, seed=3, pad_value=pad)
        x.requires_grad_()
        w = torch.rand(4, generator=torch.Generator().manual_seed(2), dtype=torch.float64).add(0.5).requires_grad_()
        dst = FORWARD(x, mask, w, None, None, None, 1e-5)[0]
        dy = torch.where(mask.unsqueeze(1), torch.randn(x.shape, generator=torch.Generator().manual_seed(1),
                                                        dtype=torch.float64), pad)
        gx, gw = torch.autograd.grad(dst, (x, w), dy, create_graph=True)
        (gx.pow(2).sum() + gw.pow(2).sum()).backward()
        results.append((gx, gw, x.grad, w.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_opcheck(device, dtype, layout):
    x, mask = padded_batch((3, 4, 10), dtype, seed=2)
    if layout == "transposed":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    w, b = torch.rand(4) + 0.5, torch.randn(4)
    x, mask, w, b = (t.to(device) for t in (x, mask, w, b))
    torch.library.opcheck(FORWARD, (x.requires_grad_(), mask, w.requires_grad_(), b, None, None, 1e-5))
    torch.library.opcheck(FORWARD, (x, mask, w, b, torch.zeros(4, device=device), torch.ones(4, device=device),
                                    1e-5))
    dst, mean, var, _ = FORWARD(x, mask, w, b, None, None, 1e-5)
    dy = torch.randn_like(x)
    torch.library.opcheck(BACKWARD, (x, mask, dy, mean, var, w, 1e-5, True, [True, True, True]))
    torch.library.opcheck(BACKWARD, (x, mask, dy, mean, var, None, 1e-5, False, [True, False, True]))


class ConvBlock(torch.nn.Module):
    """A Conformer-style pointwise conv -> masked BatchNorm1d -> SiLU."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(channels, channels, 3, padding=1)
        self.norm = torch_bn_grad.nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.norm(self.conv(x), mask))


def _batch(seed: int, length: int = 20):
    x, mask = padded_batch((4, 6, length), torch.float32, seed=seed)
    return x, mask


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compile_fullgraph_matches_eager(training):
    counters.clear()
    model = ConvBlock().train(training)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    for seed in range(3):
        x, mask = _batch(seed)
        xc, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_c, out_r = compiled(xc, mask), reference(xr, mask)
        torch.testing.assert_close(out_c, out_r)
        out_c.sum().backward()
        out_r.sum().backward()
        torch.testing.assert_close(xc.grad, xr.grad)
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(model.norm.weight.grad, reference.norm.weight.grad)
    assert not counters["graph_break"]


def test_compile_dynamic_lengths_do_not_recompile():
    model = ConvBlock().train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    compiled(*_batch(0, 20))
    reference(*_batch(0, 20))
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed, length in enumerate([17, 31, 9]):
            x, mask = _batch(seed + 1, length)
            torch.testing.assert_close(compiled(x, mask), reference(x, mask))


def test_export_matches_eager():
    model = ConvBlock().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    x, mask = _batch(0)
    program = torch.export.export(model, (x, mask))
    frozen = torch.ops.torch_bn_grad.batch_norm_forward.frozen_composite  # the eval forward, see _library/frozen_composite.py
    assert any(n.target is frozen and n.args[-1] is not None for n in program.graph.nodes)
    for seed in range(1, 3):
        x, mask = _batch(seed)
        torch.testing.assert_close(program.module()(x, mask), model(x, mask))


def test_export_train_updates_running_stats():
    model = ConvBlock().train()
    reference = copy.deepcopy(model)
    program = torch.export.export(model, _batch(0))
    exported = program.module()
    for seed in range(1, 3):
        x, mask = _batch(seed)
        torch.testing.assert_close(exported(x, mask), reference(x, mask))
    torch.testing.assert_close(exported.get_buffer("norm.running_var"), reference.norm.running_var)
    torch.testing.assert_close(exported.get_buffer("norm.running_mean"), reference.norm.running_mean)


def test_all_padding_under_compile_leaves_running_stats():
    model = ConvBlock().train()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 6, 8)
    mask = lengths_mask([0, 0], 8)
    out = compiled(x, mask)
    assert (out == 0).all()
    assert (model.norm.running_mean == 0).all() and (model.norm.running_var == 1).all()
