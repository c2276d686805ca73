"""The DirectML broadcast form (docs/api.md, Rules shared by every operator): statistics of src's rank,
ranks 1 to 8, common and irregular patterns, forward and backward against the
float64 reference."""

from __future__ import annotations

import pytest
import torch

import torch_bn_grad
from support.reference import assert_close, reference_backward, reference_forward, stats_dtype

RANK_SHAPES = {
    1: (6,),
    2: (5, 4),
    3: (3, 4, 5),
    4: (2, 3, 4, 5),
    5: (2, 3, 2, 4, 3),
    6: (2, 3, 2, 2, 3, 2),
    7: (2, 2, 3, 2, 2, 3, 2),
    8: (2, 3, 2, 2, 2, 3, 2, 2),
}


def _kept_patterns(rank: int) -> dict[str, tuple[int, ...]]:
    """Named sets of kept (per-channel) dims: the common patterns and irregular ones."""
    patterns = {"all_ones": (), "nothing_reduced": tuple(range(rank))}
    if rank >= 2:
        patterns["channel"] = (1,)  # [1, C, 1, 1]
        patterns["batch"] = (0,)  # [N, 1, 1, 1]
    if rank >= 3:
        patterns["spatial"] = tuple(range(2, rank))  # [1, 1, H, W]
        patterns["first_and_last"] = (0, rank - 1)
    if rank >= 4:
        patterns["channel_height"] = (1, 2)  # [1, C, H, 1]
        patterns["alternate"] = tuple(range(1, rank, 2))
    return patterns


PATTERNS = [(rank, name, kept) for rank in RANK_SHAPES for name, kept in _kept_patterns(rank).items()]
PATTERN_IDS = [f"rank{rank}-{name}" for rank, name, _ in PATTERNS]


def stats_shape_for(shape: tuple[int, ...], kept: tuple[int, ...]) -> list[int]:
    """The broadcast-form statistics shape that keeps exactly `kept`."""
    return [s if d in kept else 1 for d, s in enumerate(shape)]


def _inputs(shape, kept, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    sshape = stats_shape_for(shape, kept)
    pdt = stats_dtype(dtype)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    gamma = (torch.rand(sshape, generator=g, dtype=torch.float64) + 0.5).to(pdt)
    beta = torch.randn(sshape, generator=g, dtype=torch.float64).to(pdt)
    return x, dy, gamma, beta


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rank,name,kept", PATTERNS, ids=PATTERN_IDS)
def test_broadcast_form_matches_reference(rank, name, kept, dtype):
    shape = RANK_SHAPES[rank]
    x, dy, gamma, beta = _inputs(shape, kept, dtype, seed=rank)
    sshape = stats_shape_for(shape, kept)
    m = x.numel() // max(1, gamma.numel())

    dst, mean, var = torch_bn_grad.batch_norm_forward(x, gamma, beta)
    ref_dst, ref_mean, ref_var = reference_forward(x, gamma, beta, None, None, 1e-5, "NCX")
    assert dst.shape == x.shape and dst.dtype == x.dtype
    assert list(mean.shape) == list(var.shape) == sshape and mean.dtype == var.dtype == gamma.dtype
    stat_tol = torch.float64 if dtype == torch.float64 else torch.float32
    assert_close(dst, ref_dst, dtype)
    assert_close(mean, ref_mean, stat_tol)
    assert_close(var, ref_var, stat_tol, scale=4)

    # The reduced axes come from the statistics alone: data_format is ignored.
    same = torch_bn_grad.batch_norm_forward(x, gamma, beta, data_format="NXC")
    for a, b in zip((dst, mean, var), same):
        assert torch.equal(a, b)

    frozen_mean, frozen_var = ref_mean.to(gamma.dtype), (ref_var + 0.25).to(gamma.dtype)
    dst, m_out, v_out = torch_bn_grad.batch_norm_forward(x, gamma, beta, frozen_mean, frozen_var)
    assert_close(dst, reference_forward(x, gamma, beta, frozen_mean, frozen_var, 1e-5, "NCX")[0], dtype)
    assert torch.equal(m_out, frozen_mean) and torch.equal(v_out, frozen_var)

    for training, (bm, bv) in ((True, (ref_mean, ref_var)), (False, (frozen_mean, frozen_var))):
        bm, bv = bm.to(gamma.dtype), bv.to(gamma.dtype)
        dx, dg, db = torch_bn_grad.batch_norm_backward(x, dy, bm, bv, gamma, training=training)
        ref_dx, ref_dg, ref_db = reference_backward(x, dy, bm, bv, gamma, 1e-5, "NCX", training)
        assert dx.shape == x.shape and dx.dtype == x.dtype
        assert list(dg.shape) == list(db.shape) == sshape and dg.dtype == db.dtype == gamma.dtype
        assert_close(dx, ref_dx, dtype, scale=2)
        assert_close(dg, ref_dg, dtype, scale=m)
        assert_close(db, ref_db, dtype, scale=m)


@pytest.mark.parametrize("kept", [(1,), (0, 2), (2, 3)], ids=["channel", "first_and_third", "spatial"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "frozen"])
def test_reference_backward_is_the_gradient_of_the_reference_forward(kept, training):
    """The closed-form reference equals float64 autograd through the reference forward."""
    shape = RANK_SHAPES[4]
    x, dy, gamma, _ = _inputs(shape, kept, torch.float64, seed=11)
    _, mean, var = reference_forward(x, gamma, None, None, None, 1e-5, "NCX")
    if not training:
        var = var + 0.25
    xr, gr = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    beta = torch.zeros_like(gamma, requires_grad=True)
    stats = (None, None) if training else (mean, var)
    dst, _, _ = reference_forward(xr, gr, beta, *stats, 1e-5, "NCX")
    expected = torch.autograd.grad(dst, (xr, gr, beta), dy)
    actual = reference_backward(x, dy, mean, var, gamma, 1e-5, "NCX", training)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12)
