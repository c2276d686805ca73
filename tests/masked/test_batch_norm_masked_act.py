"""The fused masked operators (``batch_norm_masked_act_forward`` / ``_backward``):
``act(masked batch norm + residual)`` in one pass, 0 at padded positions, on
the CPU. Equal to the float64 gathered reference for every activation, dtype
and layout; bitwise equal in float32 to the composed form (masked batch norm,
then the residual and the activation as torch operations) where that form
rounds the same way; gradients of every order; opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch

import torch_bn_grad
from torch_bn_grad._rules import activation as _activation
from torch_bn_grad._forward.masked import masked_add_activate
from support.masked_reference import LAYOUTS, close, gathered_forward, laid_out, padded_batch, parameters

FORWARD = torch.ops.torch_bn_grad.batch_norm_masked_forward.default
ACT_FORWARD = torch.ops.torch_bn_grad.batch_norm_masked_act_forward.default
ACT_BACKWARD = torch.ops.torch_bn_grad.batch_norm_masked_act_backward.default
ACTIVATIONS = ["identity", "relu", "leaky_relu", "silu"]
SLOPE = 0.1
EPS = 1e-5


def inputs(shape, layout, dtype, seed=0, residual=True):
    x, mask = padded_batch(shape, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    r = laid_out(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype), layout) if residual else None
    dy = laid_out(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype), layout)
    weight, bias = parameters(shape[1], dtype, seed)
    return laid_out(x, layout), mask, r, weight, bias, dy


def fused_step(x, mask, r, weight, bias, dy, activation):
    """dst, mean, variance and the gradients of sum(dst * dy) through the fused operator."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias, r)]
    xg, wg, bg, rg = leaves
    dst, mean, var, _ = ACT_FORWARD(xg, mask, wg, bg, None, None, rg, EPS, activation, SLOPE)
    dst.backward(dy)
    return [dst, mean, var] + [t.grad if t is not None else None for t in leaves]


def composed_step(x, mask, r, weight, bias, dy, activation, forward=FORWARD):
    """The same through the masked operator, then the add and the activation as torch operations."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias, r)]
    xg, wg, bg, rg = leaves
    if forward is FORWARD:
        y, mean, var, _ = FORWARD(xg, mask, wg, bg, None, None, EPS)
    else:  # the float64 reference
        y, mean, var, _ = gathered_forward(xg, mask, wg, bg, EPS)
    dst = masked_add_activate(y, mask, rg, activation, SLOPE)
    dst.backward(dy.to(dst.dtype))
    return [dst, mean, var] + [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,layout", LAYOUTS)
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
def test_matches_the_float64_gathered_reference(activation, dtype, shape, layout, residual):
    x, mask, r, weight, bias, dy = inputs(shape, layout, dtype, residual=residual)
    got = fused_step(x, mask, r, weight, bias, dy, activation)
    double = lambda t: None if t is None else t.detach().double()  # noqa: E731
    want = composed_step(double(x), mask, double(r), double(weight), double(bias), double(dy), activation,
                         forward=gathered_forward)
    names = ["dst", "mean", "variance", "diff_src", "diff_gamma", "diff_beta", "diff_residual"]
    for name, a, b in zip(names, got, want):
        if a is None:
            assert b is None, name
            continue
        assert a.dtype == (dtype if name in ("dst", "diff_src", "diff_residual") else weight.dtype), name
        # A gradient sums over a channel: its error grows with the values summed.
        close(a, b, dtype, scale=1.0 if name in ("dst", "mean", "variance") else 8.0)
    padded = ~mask.unsqueeze(1).expand_as(x)
    for t in (got[0], got[3], got[6]):
        if t is not None:
            assert (t[padded] == 0).all()
    assert got[0].stride() == x.stride() and got[3].stride() == x.stride()


@pytest.mark.parametrize("activation", ["identity", "relu", "leaky_relu"])
@pytest.mark.parametrize("shape,layout", LAYOUTS)
def test_float32_equals_the_composed_form_bitwise(activation, shape, layout):
    # The fused pass adds the residual to the same float32 value the masked
    # operator stores, and the gate is the composed backward's selection.
    x, mask, r, weight, bias, dy = inputs(shape, layout, torch.float32, seed=3)
    for got, want in zip(fused_step(x, mask, r, weight, bias, dy, activation),
                         composed_step(x, mask, r, weight, bias, dy, activation)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_two_dim_input_with_a_mask_per_sample(activation, dtype):
    g = torch.Generator().manual_seed(21)
    x, r, dy = (torch.randn(9, 37, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    mask = torch.tensor([True, False, True, True, False, True, True, False, True])
    weight, bias = parameters(37, dtype)
    got = fused_step(x, mask, r, weight, bias, dy, activation)
    double = lambda t: t.detach().double()  # noqa: E731
    want = composed_step(double(x), mask, double(r), double(weight), double(bias), double(dy), activation,
                         forward=gathered_forward)
    for a, b in zip(got, want):
        close(a, b, dtype, scale=8.0)
    assert (got[0][~mask] == 0).all() and (got[3][~mask] == 0).all() and (got[6][~mask] == 0).all()


@pytest.mark.parametrize("pad_value", [float("nan"), float("inf"), 1e30])
def test_padding_content_of_input_and_residual_changes_nothing(pad_value):
    x, mask, r, weight, bias, dy = inputs((4, 6, 37), "contiguous", torch.float32, seed=5)
    padded = ~mask.unsqueeze(1)
    clean = fused_step(x, mask, r, weight, bias, dy, "silu")
    dirty = fused_step(x.masked_fill(padded, pad_value), mask, r.masked_fill(padded, pad_value), weight, bias,
                       dy.masked_fill(padded, pad_value), "silu")
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
def test_gradcheck_and_gradgradcheck(activation, training):
    x, mask, r, weight, bias, _ = inputs((3, 4, 7), "contiguous", torch.float64, seed=7)
    mean, var = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    leaves = [t.requires_grad_() for t in (x, weight, bias, r)]

    def fn(x, w, b, r):
        stats = (None, None) if training else (mean, var)
        return ACT_FORWARD(x, mask, w, b, *stats, r, EPS, activation, SLOPE)[0]

    # Away from relu's kink: the finite differences would straddle it.
    with torch.no_grad():
        z = fn(*leaves)
        x += torch.where(z.abs() < 1e-2, 0.05, 0.0)
    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "frozen"])
def test_forward_mode_matches_finite_differences(activation, training):
    x, mask, r, weight, bias, _ = inputs((3, 4, 7), "contiguous", torch.float64, seed=7)
    mean, var = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    leaves = [t.requires_grad_() for t in (x, weight, bias, r, mean, var)]

    def fn(x, w, b, r, m, v):
        stats = (None, None) if training else (m, v)
        return ACT_FORWARD(x, mask, w, b, *stats, r, EPS, activation, SLOPE)[:3]

    with torch.no_grad():  # away from relu's kink, as above
        x += torch.where(fn(*leaves)[0].abs() < 1e-2, 0.05, 0.0)
    assert torch.autograd.gradcheck(fn, leaves, check_forward_ad=True, check_backward_ad=False,
                                    check_undefined_grad=False, check_batched_grad=False)


def test_statistics_outputs_carry_their_gradient():
    x, mask, r, weight, bias, _ = inputs((3, 4, 9), "contiguous", torch.float64, seed=11)
    leaves = [t.requires_grad_() for t in (x, weight, bias, r)]

    def fn(x, w, b, r):
        dst, mean, var, _ = ACT_FORWARD(x, mask, w, b, None, None, r, EPS, "leaky_relu", SLOPE)
        return dst, mean, var

    assert torch.autograd.gradcheck(fn, leaves)


def test_the_backward_operator_refuses_to_be_differentiated():
    x, mask, r, weight, bias, dy = inputs((3, 4, 9), "contiguous", torch.float64, seed=12)
    dst, mean, var, _ = ACT_FORWARD(x, mask, weight, bias, None, None, r, EPS, "relu", 0.0)
    dy.requires_grad_()
    outs = ACT_BACKWARD(x, mask, dst, r, dy, mean, var, weight, bias, EPS, "relu", 0.0, True,
                        [True, True, True, True])
    with pytest.raises(NotImplementedError, match="batch_norm_masked_act_backward is not differentiable"):
        outs[0].sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_opcheck(dtype, activation):
    x, mask, r, weight, bias, dy = inputs((3, 4, 10), "transposed", dtype, seed=2)
    w, b = weight.float(), bias.float()
    torch.library.opcheck(ACT_FORWARD, (x.requires_grad_(), mask, w.requires_grad_(), b, None, None,
                                        r.requires_grad_(), EPS, activation, SLOPE))
    torch.library.opcheck(ACT_FORWARD, (x, mask, w, b, torch.zeros(4), torch.ones(4), None, EPS, activation, SLOPE))
    x, w, r = x.detach(), w.detach(), r.detach()  # the backward operator is not differentiable itself
    dst, mean, var, _ = ACT_FORWARD(x, mask, w, b, None, None, r, EPS, activation, SLOPE)
    torch.library.opcheck(ACT_BACKWARD, (x, mask, dst, r, dy, mean, var, w, b, EPS, activation,
                                         SLOPE, True, [True, True, True, True]))
    torch.library.opcheck(ACT_BACKWARD, (x, mask, dst, None, dy, mean, var, None, None, EPS, activation,
                                         SLOPE, False, [True, False, True, False]))


def test_modules_and_functional_take_the_fused_operator():
    x, mask, r, _, _, dy = inputs((4, 6, 21), "contiguous", torch.float32, seed=13)
    m = torch_bn_grad.nn.BatchNormAct1d(6, activation="leaky_relu", negative_slope=SLOPE)
    twin = torch_bn_grad.nn.BatchNorm1d(6)
    xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
    out = m(xg, rg, mask=mask)
    assert out.grad_fn.name() == "BatchNormMaskedActForwardBackward"
    out.backward(dy)
    x2, r2 = x.clone().requires_grad_(), r.clone().requires_grad_()
    expected = masked_add_activate(twin(x2, mask), mask, r2, "leaky_relu", SLOPE)
    expected.backward(dy)
    assert torch.equal(out, expected) and torch.equal(xg.grad, x2.grad) and torch.equal(rg.grad, r2.grad)
    assert torch.equal(m.weight.grad, twin.weight.grad) and torch.equal(m.bias.grad, twin.bias.grad)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(m, name), getattr(twin, name)), name
    m.eval(), twin.eval()
    assert torch.equal(m(x, r, mask=mask), masked_add_activate(twin(x, mask), mask, r, "leaky_relu", SLOPE))
    functional = torch_bn_grad.functional.batch_norm_act(
        x, m.running_mean, m.running_var, m.weight, m.bias, False, residual=r, activation="leaky_relu",
        negative_slope=SLOPE, mask=mask)
    assert torch.equal(functional, m(x, r, mask=mask))


def test_a_broadcast_residual_is_composed():
    x, mask, _, _, _, _ = inputs((4, 6, 21), "contiguous", torch.float32, seed=14)
    m = torch_bn_grad.nn.BatchNormAct1d(6)
    r = torch.randn(6, 1)
    out = m(x, r, mask=mask)
    twin = torch_bn_grad.nn.BatchNorm1d(6)
    assert torch.equal(out, masked_add_activate(twin(x, mask), mask, r, "relu", 0.0))


def test_a_batch_without_valid_positions():
    x, _, r, weight, bias, dy = inputs((3, 4, 8), "contiguous", torch.float32, seed=15)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    dst, mean, var, dx, dw, db, dr = fused_step(x, mask, r, weight, bias, dy, "silu")
    for t in (dst, mean, var, dx, dw, db, dr):
        assert (t == 0).all()


def test_errors_name_the_argument_and_change_nothing():
    x, mask, r, weight, bias, dy = inputs((3, 4, 8), "contiguous", torch.float32, seed=16)
    before = [t.clone() for t in (x, mask, r, weight, bias, dy)]
    with pytest.raises(ValueError, match="batch_norm_masked_act_forward: residual must have"):
        ACT_FORWARD(x, mask, weight, bias, None, None, r[:, :2], EPS, "relu", 0.0)
    with pytest.raises(ValueError, match="batch_norm_masked_act_forward: activation must be"):
        ACT_FORWARD(x, mask, weight, bias, None, None, r, EPS, "gelu", 0.0)
    with pytest.raises(ValueError, match="batch_norm_masked_act_forward: mask must have shape"):
        ACT_FORWARD(x, mask[:, :3], weight, bias, None, None, r, EPS, "relu", 0.0)
    dst, mean, var, _ = ACT_FORWARD(x, mask, weight, bias, None, None, r, EPS, "relu", 0.0)
    with pytest.raises(ValueError, match="batch_norm_masked_act_backward: dst must be given for activation='relu'"):
        ACT_BACKWARD(x, mask, None, r, dy, mean, var, weight, bias, EPS, "relu", 0.0, True, [True] * 4)
    for t, b in zip((x, mask, r, weight, bias, dy), before):
        assert torch.equal(t, b)


class Block(torch.nn.Module):
    """A masked conv -> BatchNormAct1d (silu) block with a residual."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(channels, channels, 3, padding=1)
        self.bn = torch_bn_grad.nn.BatchNormAct1d(channels, activation="silu")

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x), x, mask=mask)


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    eager = Block()
    compiled_model = Block()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True)
    x, mask = padded_batch((4, 6, 20), torch.float32, seed=17)
    for model in (eager, compiled):
        out = model(x.clone().requires_grad_(), mask)
        out.sum().backward()
    torch.testing.assert_close(compiled(x, mask), eager(x, mask), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(compiled_model.conv.weight.grad, eager.conv.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_model.bn.running_var, eager.bn.running_var)
    assert _activation.fuses_residual(x, x)
