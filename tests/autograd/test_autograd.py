"""gradcheck and gradgradcheck in float64 with non-uniform upstream gradients:
BatchNormFunction and the operators' own autograd formulas, both modes, with
and without gamma/beta, both data formats, ranks 2 to 5, on every device."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import torch_bn_grad

SHAPES = {2: (5, 3), 3: (3, 2, 4), 4: (2, 3, 2, 3), 5: (2, 2, 2, 2, 3)}
GRID = list(itertools.product((True, False), ("NCX", "NXC"), SHAPES, (True, False)))
IDS = [f"{'training' if t else 'frozen'}-{f}-rank{r}-{'affine' if a else 'plain'}" for t, f, r, a in GRID]


def _random(g: torch.Generator, shape, device: str, *, uniform: bool = False, requires_grad: bool = False):
    """float64 values drawn on the CPU (the same on every device), on `device`."""
    draw = torch.rand if uniform else torch.randn
    return draw(shape, generator=g, dtype=torch.float64).to(device).requires_grad_(requires_grad)


def _inputs(training, data_format, rank, affine, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = SHAPES[rank]
    c = shape[1] if data_format == "NCX" else shape[-1]
    x = (_random(g, shape, device) * 2 + 1).requires_grad_()
    gamma = (_random(g, c, device, uniform=True) + 0.5).requires_grad_() if affine else None
    beta = _random(g, c, device, requires_grad=True) if affine else None
    mean = var = None
    if not training:
        mean = _random(g, c, device, requires_grad=True)
        var = (_random(g, c, device, uniform=True) + 0.5).requires_grad_()
    return x, gamma, beta, mean, var, g


def _weighted(fn, weights):
    """fn's output times fixed random weights: non-uniform upstream gradients
    (a uniform one makes the training-mode diff_src vanish)."""
    return lambda *args: fn(*args) * weights


@pytest.mark.parametrize("training,data_format,rank,affine", GRID, ids=IDS)
def test_batch_norm_function(training, data_format, rank, affine, device):
    x, gamma, beta, mean, var, g = _inputs(training, data_format, rank, affine, device)
    weights = _random(g, x.shape, device)

    def fn(x, gamma, beta, mean, var):
        return torch_bn_grad.BatchNormFunction.apply(x, gamma, beta, mean, var, 1e-5, data_format)

    args = (x, gamma, beta, mean, var)
    f = _weighted(fn, weights)
    assert gradcheck(f, args)
    grad_out = _random(g, x.shape, device)
    assert gradgradcheck(f, args, grad_outputs=(grad_out,))


@pytest.mark.parametrize("training,data_format,rank,affine", GRID, ids=IDS)
def test_forward_operator(training, data_format, rank, affine, device):
    x, gamma, beta, mean, var, g = _inputs(training, data_format, rank, affine, device, seed=1)

    def fn(x, gamma, beta, mean, var):
        return torch_bn_grad.batch_norm_forward(x, gamma, beta, mean, var, data_format=data_format)

    args = (x, gamma, beta, mean, var)
    assert gradcheck(fn, args)
    outs = fn(*args)
    grads = tuple(_random(g, o.shape, device) for o in outs)
    assert gradgradcheck(fn, args, grad_outputs=grads)


@pytest.mark.parametrize("training,data_format,rank,affine", GRID, ids=IDS)
def test_backward_operator(training, data_format, rank, affine, device):
    """The backward is itself differentiable in every input (mean and variance
    are independent inputs here, whatever `training` says of them)."""
    x, gamma, _, _, _, g = _inputs(training, data_format, rank, affine, device, seed=2)
    dims = [d for d in range(x.dim()) if d != (1 if data_format == "NCX" else x.dim() - 1)]
    mean = (x.detach().mean(dims) + 0.1).requires_grad_()
    var = (x.detach().var(dims, unbiased=False) + 0.2).requires_grad_()
    dy = _random(g, x.shape, device, requires_grad=True)

    def fn(x, dy, mean, var, gamma):
        return torch_bn_grad.batch_norm_backward(
            x, dy, mean, var, gamma, data_format=data_format, training=training,
            output_mask=(True, True, True),
        )

    args = (x, dy, mean, var, gamma)
    assert gradcheck(fn, args)
    outs = fn(*args)
    grads = tuple(_random(g, o.shape, device) for o in outs)
    assert gradgradcheck(fn, args, grad_outputs=grads)


def test_backward_operator_with_partial_mask(device):
    x, gamma, _, _, _, g = _inputs(True, "NCX", 3, True, device, seed=3)
    mean = x.detach().mean((0, 2)).requires_grad_()
    var = (x.detach().var((0, 2), unbiased=False) + 0.1).requires_grad_()
    dy = _random(g, x.shape, device, requires_grad=True)
    for mask in ((True, False, False), (False, True, False), (False, False, True), (True, True, False)):
        def fn(x, dy, mean, var, gamma, mask=mask):
            return tuple(o for o in torch_bn_grad.batch_norm_backward(
                x, dy, mean, var, gamma, output_mask=mask) if o is not None)
        assert gradcheck(fn, (x, dy, mean, var, gamma))


def test_function_matches_torch_gradients(device):
    """Against torch's own batch norm on the same device (its native CUDA kernels on CUDA)."""
    g = torch.Generator().manual_seed(4)
    x = _random(g, (6, 4, 5), device, requires_grad=True)
    w = _random(g, 4, device, uniform=True, requires_grad=True)
    b = _random(g, 4, device, requires_grad=True)
    dy = _random(g, (6, 4, 5), device)
    ours = torch.autograd.grad(torch_bn_grad.BatchNormFunction.apply(x, w, b, None, None, 1e-5, "NCX"), (x, w, b), dy)
    ref = torch.autograd.grad(torch.nn.functional.batch_norm(x, None, None, w, b, True), (x, w, b), dy)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r)
