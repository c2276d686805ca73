"""batch_norm_stats_affine, the statistics stage of the torch.compile lowering on
CPU: its mean and variance are the training forward's, bit for bit, and its
affine map (src - mean) * scale + bias is the forward's normalization, for
every dtype, data format, rank and layout of the contract and the broadcast
form; empty batches, errors, opcheck."""

from __future__ import annotations

import pytest
import torch

import torch_bn_grad  # noqa: F401  (loads the operators)

from support.reference import assert_close, cases, normalization_inputs, reference_forward

OP = torch.ops.torch_bn_grad.batch_norm_stats_affine.default
FORWARD = torch.ops.torch_bn_grad.batch_norm_forward.default
CASES = list(cases())
IDS = [str(c) for c in CASES]


def _applied(x, mean, scale, bias, shape):
    """The affine map in float64, its per-channel vectors broadcast as `shape`."""
    return (x.double() - mean.double().reshape(shape)) * scale.double().reshape(shape) + bias.double().reshape(shape)


def _stats_view(x, data_format):
    shape = [1] * x.dim()
    axis = 1 if data_format == "NCX" else x.dim() - 1
    shape[axis] = x.shape[axis]
    return shape


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_statistics_are_the_forwards_and_the_map_normalizes(case):
    g = torch.Generator().manual_seed(0)
    x = case.make(g, scale=3.0, offset=100.0)  # a large mean: bias must carry the mean's rounding
    gamma, beta, _, _ = case.params(g)
    mean, var, scale, bias = OP(x, gamma, beta, 1e-3, case.data_format)
    dst, fwd_mean, fwd_var = FORWARD(x, gamma, beta, None, None, 1e-3, case.data_format)
    assert torch.equal(mean, fwd_mean) and torch.equal(var, fwd_var)
    assert scale.dtype == mean.dtype and bias.dtype == mean.dtype and scale.shape == mean.shape
    applied = _applied(x, mean, scale, bias, _stats_view(x, case.data_format))
    ref_dst, _, _ = reference_forward(x.double(), gamma.double(), beta.double(), None, None, 1e-3, case.data_format)
    # Computed in the accumulation type before the output's one rounding.
    assert_close(applied, ref_dst, torch.float64 if case.dtype == torch.float64 else torch.float32, scale=4)
    assert_close(applied.to(case.dtype), dst.double(), case.dtype)


def test_broadcast_form_and_absent_parameters():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 5, 6, generator=g) * 2 + 1
    gamma = torch.rand(1, 3, 5, 1, generator=g) + 0.5
    mean, var, scale, bias = OP(x, gamma, None, 1e-5, "NCX")
    dst, fwd_mean, fwd_var = FORWARD(x, gamma, None, None, None, 1e-5, "NCX")
    assert mean.shape == (1, 3, 5, 1) and torch.equal(mean, fwd_mean) and torch.equal(var, fwd_var)
    torch.testing.assert_close(_applied(x, mean, scale, bias, mean.shape).float(), dst)
    mean, var, scale, bias = OP(x, None, None, 1e-5, "NCX")
    torch.testing.assert_close(scale, torch.rsqrt(var.double() + 1e-5).float())
    torch.testing.assert_close(_applied(x, mean, scale, bias, (1, 3, 1, 1)).float(),
                               FORWARD(x, None, None, None, None, 1e-5, "NCX")[0])


def test_empty_batch_gives_nan_as_the_forward():
    x = torch.empty(0, 3, 4)
    for t, f in zip(OP(x, None, None, 1e-5, "NCX"), FORWARD(x, None, None, None, None, 1e-5, "NCX")[1:] * 2):
        assert t.shape == (3,) and t.isnan().all() and f.isnan().all()


def test_bad_arguments_raise_naming_them_and_write_nothing():
    x = torch.randn(4, 3, 5)
    before = x.clone()
    with pytest.raises(ValueError, match="gamma"):
        OP(x, torch.ones(4), None, 1e-5, "NCX")
    with pytest.raises(ValueError, match="epsilon"):
        OP(x, None, None, -1.0, "NCX")
    with pytest.raises(ValueError, match="data_format"):
        OP(x, None, None, 1e-5, "NHWC")
    with pytest.raises(TypeError, match="src must have dtype"):
        OP(x.int(), None, None, 1e-5, "NCX")
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_opcheck(dtype, layout):
    x, gamma, beta = normalization_inputs((4, 3, 5, 6), dtype, layout, seed=5)
    torch.library.opcheck(OP, (x, gamma, beta, 1e-5, "NCX"))
    torch.library.opcheck(OP, (x, None, None, 1e-5, "NCX"))


@pytest.mark.parametrize("form", ["NCX-1d", "NXC-1d", "broadcast"])
def test_gradcheck(form):
    """Differentiable to any order (float64), though the lowering calls it below autograd."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, 5, generator=g, dtype=torch.float64).requires_grad_()
    fmt = "NXC" if form == "NXC-1d" else "NCX"
    shape = (1, 3, 5) if form == "broadcast" else ((5,) if fmt == "NXC" else (3,))
    gamma = (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    beta = torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()

    def fn(x, gamma, beta):
        return OP(x, gamma, beta, 1e-3, fmt)

    assert torch.autograd.gradcheck(fn, (x, gamma, beta))
    assert torch.autograd.gradgradcheck(fn, (x, gamma, beta))
