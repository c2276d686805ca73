"""The ``.frozen`` overloads (``batch_norm_forward``, ``batch_norm_act_forward``):
the forward with frozen statistics returning dst alone, without the copies of
the statistics that the plain operators return (an eager eval step's call).
dst is bit for bit the plain operator's on every device; autograd (reverse and
forward mode) is the plain operator's formula; the eager routing of the
functional forms and the modules; fakes; errors before any output."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad

import torch_bn_grad
from support.recorded_ops import RecordedOps
from support.reference import normalization_inputs

EPS = 1e-5
FORWARD = torch.ops.torch_bn_grad.batch_norm_forward
ACT = torch.ops.torch_bn_grad.batch_norm_act_forward
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (activation, negative_slope, with a residual)
ACTS = [("relu", 0.0, True), ("leaky_relu", 0.1, False), ("silu", 0.0, True), ("identity", 0.0, False)]


def _inputs(shape, dtype, layout, device, residual=False):
    x, gamma, beta = normalization_inputs(shape, dtype, layout, seed=4, scale=2, offset=1)
    g = torch.Generator().manual_seed(5)
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    mean = torch.randn(shape[1], generator=g).to(stats)
    var = (torch.rand(shape[1], generator=g) + 0.5).to(stats)
    r = torch.randn(shape, generator=g).to(dtype) if residual else None
    if r is not None and layout == "channels_last":
        r = r.contiguous(memory_format=torch.channels_last)
    return [t.to(device) if t is not None else None for t in (x, gamma, beta, mean, var, r)]


def _plain_and_frozen(op, args, kwargs_tail):
    """The plain operator's dst and the .frozen overload's, from the same arguments."""
    return op.default(*args, *kwargs_tail)[0], op.frozen(*args, *kwargs_tail)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dst_is_the_plain_operators(device, dtype, layout):
    x, gamma, beta, mean, var, _ = _inputs((5, 6, 4, 3), dtype, layout, device)
    expected, got = _plain_and_frozen(FORWARD, (x, gamma, beta, mean, var), (EPS, "NCX"))
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    for act, slope, residual in ACTS:
        x, gamma, beta, mean, var, r = _inputs((5, 6, 4, 3), dtype, layout, device, residual)
        expected, got = _plain_and_frozen(ACT, (x, gamma, beta, mean, var, r), (EPS, act, slope, "NCX", False))
        assert torch.equal(got, expected) and got.stride() == expected.stride(), act


def test_an_empty_batch(device):
    x, gamma, beta, mean, var, _ = _inputs((0, 3, 2), torch.float32, "contiguous", device)
    assert FORWARD.frozen(x, gamma, beta, mean, var, EPS, "NCX").shape == (0, 3, 2)
    assert ACT.frozen(x, gamma, beta, mean, var, None, EPS, "relu", 0.0, "NCX", False).shape == (0, 3, 2)


@pytest.mark.parametrize("case", ACTS[:2], ids=[a[0] for a in ACTS[:2]])
def test_autograd_is_the_plain_operators(device, case):
    act, slope, residual = case
    x, gamma, beta, mean, var, r = _inputs((4, 3, 3, 2), torch.float64, "contiguous", device, residual)
    inputs = [t.requires_grad_() for t in (x, gamma, beta, mean, var, r) if t is not None]
    dy = torch.randn_like(x)
    for op, tail in ((FORWARD, (EPS, "NCX")), (ACT, (r, EPS, act, slope, "NCX", False))):
        args = (x, gamma, beta, mean, var)
        got = torch.autograd.grad((op.frozen(*args, *tail) * dy).sum(), inputs, allow_unused=True)
        expected = torch.autograd.grad((op.default(*args, *tail)[0] * dy).sum(), inputs, allow_unused=True)
        for a, b in zip(got, expected):
            assert (a is None and b is None) or torch.equal(a, b)
    torch.autograd.gradcheck(lambda *a: FORWARD.frozen(*a, EPS, "NCX"), (x, gamma, beta, mean, var))
    torch.autograd.gradgradcheck(lambda *a: FORWARD.frozen(*a, EPS, "NCX"), (x, gamma, beta, mean, var))


def test_forward_mode_is_the_plain_operators(device):
    x, gamma, beta, mean, var, _ = _inputs((4, 3, 5), torch.float64, "contiguous", device)
    tx, tm = torch.randn_like(x), torch.randn_like(mean)
    for op, tail in ((FORWARD, (EPS, "NCX")), (ACT, (None, EPS, "silu", 0.0, "NCX", False))):
        tangents = []
        for call in (lambda *a: op.default(*a, *tail)[0], lambda *a: op.frozen(*a, *tail)):
            with forward_ad.dual_level():
                dst = call(forward_ad.make_dual(x, tx), gamma, beta, forward_ad.make_dual(mean, tm), var)
                tangents.append(forward_ad.unpack_dual(dst).tangent)
        assert torch.equal(*tangents)


def test_errors_name_the_argument():
    x, gamma, beta, mean, var, _ = _inputs((4, 3, 5), torch.float32, "contiguous", "cpu")
    with pytest.raises(ValueError, match="variance"):
        FORWARD.frozen(x, gamma, beta, mean, var[:2], EPS, "NCX")
    with pytest.raises(ValueError, match="residual"):
        ACT.frozen(x, gamma, beta, mean, var, torch.ones(4, 3), EPS, "relu", 0.0, "NCX", False)


def test_opcheck(device):
    x, gamma, beta, mean, var, r = _inputs((4, 8, 2, 2), torch.float32, "channels_last", device, True)
    torch.library.opcheck(FORWARD.frozen, (x, gamma, beta, mean, var, EPS, "NCX"))
    torch.library.opcheck(ACT.frozen, (x, gamma, beta, mean, var, r, EPS, "leaky_relu", 0.1, "NCX", False))
    x.requires_grad_()
    torch.library.opcheck(FORWARD.frozen, (x, gamma, beta, mean, var, EPS, "NCX"))


@pytest.mark.parametrize("name, op", [("BatchNorm2d", "batch_norm_forward"),
                                      ("BatchNormAct2d", "batch_norm_act_forward")])
def test_eager_eval_steps_take_the_frozen_overload(device, name, op):
    layer = getattr(torch_bn_grad.nn, name)(3).to(device).eval()
    x = torch.randn(4, 3, 2, 2, device=device)
    with torch.no_grad(), RecordedOps() as ops:
        y = layer(x)
    assert ops.names == [f"torch_bn_grad.{op}.frozen"]
    native = torch.nn.BatchNorm2d(3).to(device).eval()
    expected = native(x) if name == "BatchNorm2d" else torch.relu(native(x))
    torch.testing.assert_close(y, expected)
