"""A half-precision module's backward meets float32 statistics: on the CPU the
autograd nodes pass gamma (and, fused, beta) to the backward operators in its
own dtype and take the parameter gradients in it, no casts
(autograd/channel_algebra.h, backward_param_dtype). Those gradients must be
bit for bit the ones the dispatcher's route gives: under a dispatch mode, which
the fast paths decline."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_bn_grad import nn as bn_nn


class _PassThrough(TorchDispatchMode):
    """Runs every operator as it is: only its presence matters here."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _module(kind: str, channels: int, dtype: torch.dtype) -> torch.nn.Module:
    m = (bn_nn.BatchNorm2d(channels) if kind == "plain"
         else bn_nn.BatchNormAct2d(channels, activation="leaky_relu", negative_slope=0.1)).to(dtype)
    g = torch.Generator().manual_seed(channels)
    with torch.no_grad():
        # Weights across the dtype's range: gradients that round, overflow float16, or are subnormal.
        m.weight.copy_((torch.randn(channels, generator=g) * torch.logspace(-6, 6, channels)).to(dtype))
        m.bias.copy_(torch.randn(channels, generator=g).to(dtype))
    return m


def _gradients(m: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, residual=None):
    y = m(x) if residual is None else m(x, residual)
    inputs = (x, m.weight, m.bias) + (() if residual is None else (residual,))
    return torch.autograd.grad(y, inputs, dy)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["plain", "fused", "fused_residual"])
@pytest.mark.parametrize("channels", [3, 37, 512])
def test_half_parameter_gradients_as_tensor_to(dtype, kind, channels):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, channels, 3, 5, generator=g) * 50).to(dtype).requires_grad_()
    dy = (torch.randn(4, channels, 3, 5, generator=g) * 1e3).to(dtype)
    residual = torch.randn(4, channels, 3, 5, generator=g).to(dtype).requires_grad_() if kind == "fused_residual" else None
    fast = _gradients(_module(kind, channels, dtype), x, dy, residual)
    with _PassThrough():
        reference = _gradients(_module(kind, channels, dtype), x, dy, residual)
    for got, expected in zip(fast, reference):
        assert got.dtype == expected.dtype
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def test_double_backward_of_half_parameters():
    # Under create_graph the parameter gradient stays differentiable.
    m = _module("plain", 4, torch.bfloat16)
    x = torch.randn(3, 4, 2, 2).to(torch.bfloat16).requires_grad_()
    (gw,) = torch.autograd.grad(m(x).float().pow(2).sum(), (m.weight,), create_graph=True)
    assert gw.requires_grad and gw.dtype == torch.bfloat16
    (ggx,) = torch.autograd.grad(gw.float().sum(), (x,))
    assert ggx.shape == x.shape and torch.isfinite(ggx.float()).all()
