"""Each rule has one home, and every path that applies it agrees with it:
the activations' (names, slope, invertibility: ``_activation``) between the
modules' constructors, the functional API, the operator wrappers and the C++
operators.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import _activation
from torch_bn_grad import nn as bn_nn

FUSED_MODULES = [(bn_nn.BatchNormAct1d, (4, 3)), (bn_nn.BatchNormAct2d, (2, 3, 2, 2)),
                 (bn_nn.BatchNormAct3d, (2, 3, 2, 2, 1)), (bn_nn.SyncBatchNormAct, (2, 3, 2, 2))]
SLOPES = [-0.1, -0.0, 0.0, 0.2, math.inf, math.nan]
NAMES = [*_activation.ACTIVATIONS, "gelu"]


def _raises(call) -> str:
    """The ValueError's message, or "" when ``call`` returns."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("module,shape", FUSED_MODULES, ids=lambda v: getattr(v, "__name__", ""))
def test_negative_slope_is_refused_at_construction(module, shape):
    # The fused kernels read leaky_relu's derivative from the output's sign: a negative
    # slope is refused when the module is built, not at its first forward.
    with pytest.raises(ValueError, match=r"negative_slope must be finite and >= 0 .*got -0\.1"):
        module(3, activation="leaky_relu", negative_slope=-0.1)
    with pytest.raises(TypeError, match="negative_slope must be a real number, got 'x'"):
        module(3, activation="leaky_relu", negative_slope="x")
    m = module(3, activation="leaky_relu", negative_slope=0.2)  # what is accepted runs
    m(torch.randn(shape)).sum().backward()


@pytest.mark.parametrize("activation,slope,inverted", list(itertools.product(NAMES, SLOPES, [False, True])))
def test_the_python_check_is_the_operators(activation, slope, inverted):
    """A module builds exactly when the C++ operator takes the same arguments, with the same reason."""
    x = torch.randn(4, 3, dtype=torch.float64)
    gamma = torch.ones(3, dtype=torch.float64)
    beta = torch.zeros(3, dtype=torch.float64)

    def operator():  # the C++ backward checks invertibility, where it reads the output
        ops = torch.ops.torch_bn_grad
        dst, mean, var = ops.batch_norm_act_forward(x, gamma, beta, None, None, None, 1e-5, activation, slope,
                                                    "NCX", inverted)
        if inverted:
            ops.batch_norm_act_backward(torch.ones_like(dst), None, dst, None, mean, var, gamma, beta, 1e-5,
                                        activation, slope, "NCX", True, True, [True] * 4, None)

    def module():
        bn_nn.BatchNormAct1d(3, activation=activation, negative_slope=slope, memory_saving=inverted).double()(x)

    def functional():
        torch_bn_grad.functional.batch_norm_act(x, None, None, gamma, beta, True, activation=activation,
                                                negative_slope=slope, memory_saving=inverted)

    by_operator, by_module, by_functional = _raises(operator), _raises(module), _raises(functional)
    assert bool(by_module) == bool(by_functional) == bool(by_operator), (by_operator, by_module, by_functional)
    refused = activation not in _activation.ACTIVATIONS or not (slope >= 0 and math.isfinite(slope))
    if inverted and not refused:
        refused = not _activation.invertible(activation, slope)
    assert bool(by_module) == refused
    for reason in ("activation must be", "negative_slope must be finite", "needs an invertible"):
        assert (reason in by_module) == (reason in by_operator), (by_operator, by_module)


def test_fused_lowering_uses_the_composed_activation():
    """The inductor rewrite of the fused forward computes ``_activation.activate``."""
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    for activation in _activation.ACTIVATIONS:
        f = torch.compile(lambda t: torch_bn_grad.functional.batch_norm_act(
            t, None, None, training=True, activation=activation, negative_slope=0.3), backend="inductor",
            fullgraph=True)
        plain = torch_bn_grad.functional.batch_norm(x, None, None, training=True)
        torch.testing.assert_close(f(x), _activation.activate(plain, activation, 0.3))
