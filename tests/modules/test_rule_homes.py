"""Each rule has one home, and every path that applies it agrees with it:
the activations' (names, slope, invertibility: ``_activation``) between the
modules' constructors, the functional API, the operator wrappers and the C++
operators; the running statistics' and ``eps`` checks (``_checks``) between
the functional, masked, scripted and distributed paths.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import torch_bn_grad
from torch_bn_grad._rules import activation as _activation
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


def _eval_without_stats(module: torch.nn.Module) -> torch.nn.Module:
    module.eval()
    module.running_mean = None  # running_var kept: eval mode cannot normalize
    return module


def test_statistics_checks_agree_across_paths():
    """Eval without running statistics and ``eps <= 0`` in training: the same error from
    the functional, masked, scripted (TorchScript) and distributed paths."""
    x = torch.randn(4, 3, 5)
    mask = torch.ones(4, 5, dtype=torch.bool)
    var = torch.ones(3)
    eval_message = "running_mean and running_var must be given when training=False"
    eps_message = "eps must be positive in training, got 0"
    calls = {
        "functional": lambda **kw: torch_bn_grad.functional.batch_norm(x, **kw),
        "functional_act": lambda **kw: torch_bn_grad.functional.batch_norm_act(x, **kw),
        "masked": lambda **kw: torch_bn_grad.functional.batch_norm(x, mask=mask, **kw),
        "masked_act": lambda **kw: torch_bn_grad.functional.batch_norm_act(x, mask=mask, **kw),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=eval_message):
            call(running_mean=None, running_var=var, training=False)
        with pytest.raises(ValueError, match=eps_message):
            call(running_mean=None, running_var=None, training=True, eps=0.0)
    scripted = torch.jit.script(_eval_without_stats(bn_nn.BatchNorm1d(3)))
    for args in ((x,), (x, mask)):
        with pytest.raises(Exception, match=eval_message):
            scripted(*args)
    scripted = torch.jit.script(bn_nn.BatchNorm1d(3, eps=0.0))
    for args in ((x,), (x, mask)):
        with pytest.raises(Exception, match=eps_message):
            scripted(*args)
    with pytest.raises(ValueError, match="sync_batch_norm: " + eps_message):
        torch_bn_grad.distributed.sync_batch_norm(x, None, None, None, None, 0.1, 0.0, None)


def test_momentum_factor_is_shared_by_eager_and_scripted_modules():
    """``momentum=None``'s cumulative average: the same running statistics eagerly and scripted."""
    eager = bn_nn.BatchNorm2d(3, momentum=None).double()
    scripted = torch.jit.script(bn_nn.BatchNorm2d(3, momentum=None).double())
    for step in range(3):
        x = torch.randn(2, 3, 4, 4, dtype=torch.float64) * (step + 1) + step
        eager(x), scripted(x)
    assert int(eager.num_batches_tracked) == int(scripted.num_batches_tracked) == 3
    torch.testing.assert_close(scripted.running_mean, eager.running_mean, rtol=0, atol=1e-15)
    torch.testing.assert_close(scripted.running_var, eager.running_var, rtol=0, atol=1e-15)
