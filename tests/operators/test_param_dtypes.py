"""The backward operators take a half-precision model's parameters beside its
float32 batch statistics uncast (docs/api.md, "Dtypes"): gamma and beta in
float16 or bfloat16 with float32 mean and variance. diff_src is bitwise the
call with float32 parameters (the parameters widen exactly) and diff_gamma,
diff_beta come in the parameters' dtype, bitwise that call's rounded by a
cast; the fake implementations give the same dtypes; a module's backward runs
no cast at all."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_bn_grad
from torch_bn_grad import nn as bn_nn

OPS = torch.ops.torch_bn_grad
HALF = [torch.float16, torch.bfloat16]


def _data(dtype, shape=(4, 6, 5, 3)):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 4 + 1).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    gamma = (torch.rand(shape[1], generator=g) + 0.5).to(dtype)
    beta = torch.randn(shape[1], generator=g).to(dtype)
    _, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, beta)
    return x, dy, mean, var, gamma, beta


def _plain(x, dy, mean, var, gamma, beta):
    return OPS.batch_norm_backward(x, dy, mean, var, gamma, epsilon=1e-5, data_format="NCX", training=True,
                                   output_mask=[True, True, True])


def _act(x, dy, mean, var, gamma, beta):
    y = torch_bn_grad.batch_norm_act_forward(x, gamma.to(mean.dtype), beta.to(mean.dtype), mean, var,
                                             activation="leaky_relu", negative_slope=0.1)[0]
    return OPS.batch_norm_act_backward(dy, x, y, None, mean, var, gamma, beta, 1e-5, "leaky_relu", 0.1, "NCX", True,
                                       False, [True, True, True, False])[:3]


def _masked(x, dy, mean, var, gamma, beta):
    mask = torch.ones(x.shape[0], *x.shape[2:], dtype=torch.bool)
    mask[0, :2] = False
    return OPS.batch_norm_masked_backward(x, mask, dy, mean, var, gamma, 1e-5, True, [True, True, True])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", [_plain, _act, _masked], ids=["plain", "act", "masked"])
def test_half_parameters_beside_float32_statistics(op, dtype):
    x, dy, mean, var, gamma, beta = _data(dtype)
    assert mean.dtype == torch.float32
    diff_src, diff_gamma, diff_beta = op(x, dy, mean, var, gamma, beta)
    ref_src, ref_gamma, ref_beta = op(x, dy, mean, var, gamma.float(), beta.float())
    assert torch.equal(diff_src, ref_src)
    assert diff_gamma.dtype == diff_beta.dtype == dtype
    assert torch.equal(diff_gamma, ref_gamma.to(dtype))
    assert torch.equal(diff_beta, ref_beta.to(dtype))


@pytest.mark.parametrize("op", [_plain, _act, _masked], ids=["plain", "act", "masked"])
def test_fake_gives_the_parameters_dtype(op):
    real = op(*_data(torch.bfloat16))
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(t) for t in _data(torch.bfloat16)))
    assert [t.dtype for t in fake] == [t.dtype for t in real] == [torch.bfloat16] * 3


def test_without_parameters_the_gradients_take_mean_dtype():
    x, dy, mean, var, _, _ = _data(torch.bfloat16)
    _, diff_gamma, diff_beta = _plain(x, dy, mean, var, None, None)
    assert diff_gamma.dtype == diff_beta.dtype == torch.float32


def test_beta_must_have_gamma_dtype():
    x, dy, mean, var, gamma, beta = _data(torch.bfloat16)
    with pytest.raises(TypeError, match=r"beta must have gamma's dtype torch\.bfloat16, got torch\.float32"):
        OPS.batch_norm_act_backward(dy, x, None, None, mean, var, gamma, beta.float(), 1e-5, "silu", 0.0, "NCX",
                                    True, False, [True, True, True, False])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_a_parameter_of_another_dtype_is_still_refused(dtype):
    x, dy, mean, var, gamma, _ = _data(torch.bfloat16)
    with pytest.raises(TypeError, match=r"gamma must have dtype torch\.float32 or torch\.bfloat16"):
        _plain(x, dy, mean, var, gamma.to(dtype), None)


class _Ops(TorchDispatchMode):
    """Records the ATen and library operators a region runs."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("module", [bn_nn.BatchNorm2d, bn_nn.BatchNormAct2d], ids=["plain", "fused"])
def test_half_module_backward_runs_no_cast(module):
    m = module(6).to(torch.bfloat16)
    x, dy, *_ = _data(torch.bfloat16)
    y = m(x.requires_grad_())
    with _Ops() as ops:
        y.backward(dy)
    assert not [n for n in ops.names if "to_copy" in n or n.endswith(".to")], ops.names
    assert any("backward" in n for n in ops.names), ops.names
    assert m.weight.grad.dtype == m.bias.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("module", [bn_nn.BatchNorm1d, bn_nn.BatchNormAct1d], ids=["plain", "fused"])
def test_half_masked_module_backward_runs_no_cast(module):
    m = module(6).to(torch.bfloat16)
    x = torch.randn(4, 6, 9).to(torch.bfloat16).requires_grad_()
    lengths = torch.tensor([9, 5, 1, 7])
    y = m(x, lengths=lengths)
    dy = torch.randn(y.shape).to(y.dtype)
    with _Ops() as ops:
        y.backward(dy)
    assert not [n for n in ops.names if "to_copy" in n or n.endswith(".to")], ops.names
    assert m.weight.grad.dtype == m.bias.grad.dtype == torch.bfloat16
