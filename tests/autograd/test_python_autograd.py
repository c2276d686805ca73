"""The Autograd kernels whose formula is Python (csrc/autograd/python_autograd.cpp): a
call that records nothing never enters Python; one that records (grad mode
and an input requiring grad, or a forward-mode tangent) runs the formula,
whose node and errors reach the caller as before."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.autograd import forward_ad

import torch_bn_grad  # noqa: F401  (registers the operators)
from torch_bn_grad._library import autograd_kernel as _autograd_kernel

OPS = torch.ops.torch_bn_grad


class RecordCalls:
    """Counts the calls of _autograd_kernel's `record` functions (sys.setprofile)."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> "RecordCalls":
        def profile(frame, event, arg):
            code = frame.f_code
            if event == "call" and code.co_name == "record" and code.co_filename == _autograd_kernel.__file__:
                self.count += 1

        sys.setprofile(profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def _backward_args(requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    dy = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    w = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    mean, var = x.mean((0, 2)), x.var((0, 2), unbiased=False)
    if requires_grad:
        x.requires_grad_()
    return x, dy, mean, var, w


def _backward(x, dy, mean, var, w):
    return OPS.batch_norm_backward.default(x, dy, mean, var, w, 1e-5, "NCX", True, [True, True, True])


def test_a_call_that_records_nothing_skips_python():
    args = _backward_args()
    with torch.no_grad():
        below = _backward(*args)
    with RecordCalls() as calls:
        plain = _backward(*args)  # grad mode on, nothing requires grad
        with torch.no_grad():
            x = args[0].clone().requires_grad_()
            frozen = _backward(x, *args[1:])  # requires grad, grad mode off
        stats = OPS.batch_norm_local_stats.default(args[0], "NCX")
    assert calls.count == 0
    for out in (plain, frozen):
        for a, b in zip(out, below):
            assert torch.equal(a, b) and a.grad_fn is None
    assert stats.shape == (3, 3)


def test_a_call_that_records_runs_the_python_formula():
    x, dy, _, _, w = _backward_args(requires_grad=True)
    mean, var = x.mean((0, 2)), x.var((0, 2), unbiased=False)  # functions of x, as the batch's statistics are
    with RecordCalls() as calls:
        diff_src, diff_gamma, _ = _backward(x, dy, mean, var, w)
    assert calls.count == 1
    assert diff_src.grad_fn is not None and diff_gamma.grad_fn is not None
    # The recorded node differentiates: d/dx of sum(diff_src * v) is the float64 reference's double backward.
    v = torch.randn_like(diff_src)
    (got,) = torch.autograd.grad((diff_src * v).sum(), x)
    xr = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.batch_norm(xr, None, None, w, None, True, 0.0, 1e-5)
    (g,) = torch.autograd.grad(ref, xr, dy, create_graph=True)
    (expected,) = torch.autograd.grad((g * v).sum(), xr)
    torch.testing.assert_close(got, expected)


def test_a_tangent_takes_the_python_formula():
    x, dy, mean, var, w = _backward_args()
    with forward_ad.dual_level(), RecordCalls() as calls:
        dual = forward_ad.make_dual(x, torch.randn_like(x))
        out = _backward(dual, dy, mean, var, w)
        assert forward_ad.unpack_dual(out[0]).tangent is not None
    assert calls.count == 1


@pytest.mark.parametrize("requires_grad", [False, True])
def test_errors_reach_the_caller_as_raised(requires_grad):
    # Raised by the operator's check below autograd, through the C++ path or through the Python formula.
    x, dy, mean, var, w = _backward_args(requires_grad)
    with pytest.raises(ValueError, match=r"batch_norm_backward: diff_dst must have src's shape \[4, 3, 5\]"):
        _backward(x, dy[:, :2], mean, var, w)
