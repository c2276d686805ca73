"""The split-stage operators behind SyncBatchNorm, in one process: numerics
against the float64 reference for every dtype, data format, rank and layout;
a batch cut into uneven and empty parts recombined exactly; errors; opcheck."""

from __future__ import annotations

import pytest
import torch

from support.reference import assert_close, cases, reference_backward, reference_forward
from torch_bn_grad import stages

CASES = list(cases())
IDS = [str(c) for c in CASES]


def _stats_tolerance_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are float64, accumulated in float32 for all but float64 data."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_local_stats_match_reference(case):
    x = case.make(torch.Generator().manual_seed(0), scale=2.0, offset=0.5)
    stats = stages.batch_norm_local_stats(x, data_format=case.data_format)
    _, ref_mean, ref_var = reference_forward(x, None, None, None, None, 1e-5, case.data_format)
    count = x.numel() // case.channels
    assert stats.dtype == torch.float64 and stats.shape == (3, case.channels)
    assert torch.equal(stats[0], torch.full((case.channels,), float(count), dtype=torch.float64))
    tol = _stats_tolerance_dtype(case.dtype)
    assert_close(stats[1], ref_mean, tol)
    assert_close(stats[2] / count, ref_var, tol, scale=4)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grad_sums_and_grad_input_give_the_training_backward(case):
    g = torch.Generator().manual_seed(1)
    x = case.make(g, scale=2.0, offset=0.5)
    dy = case.make(g)
    gamma = case.params(g)[0]
    fmt = case.data_format
    _, mean, var = reference_forward(x, None, None, None, None, 1e-5, fmt)
    ref_dx, ref_dg, ref_db = reference_backward(x, dy, mean, var, gamma, 1e-5, fmt, True)
    sums = stages.batch_norm_grad_sums(x, dy, mean, data_format=fmt)
    count = torch.full((case.channels,), float(x.numel() // case.channels), dtype=torch.float64)
    dx = stages.batch_norm_grad_input(x, dy, mean, var, gamma, count, sums, epsilon=1e-5, data_format=fmt)
    assert sums.dtype == torch.float64 and sums.shape == (2, case.channels)
    assert dx.dtype == x.dtype and dx.stride() == torch.empty_like(x).stride()
    m = int(count[0])
    assert_close(sums[0], ref_db, case.dtype, scale=m)
    assert_close(sums[1] * (var + 1e-5).rsqrt(), ref_dg, case.dtype, scale=m)
    assert_close(dx, ref_dx, case.dtype, scale=2)


def _parts(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    assert sum(sizes) == x.shape[0]
    return list(torch.split(x, sizes))


@pytest.mark.parametrize("sizes", [[3, 5], [1, 0, 6, 1], [0, 8], [8]], ids=str)
def test_parts_combine_to_the_whole_batch(sizes):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 3, 4, 5, generator=g, dtype=torch.float64) * 3 + 1
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    gamma = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    _, ref_mean, ref_var = reference_forward(x, None, None, None, None, 1e-5, "NCX")
    ref_dx, _, _ = reference_backward(x, dy, ref_mean, ref_var, gamma, 1e-5, "NCX", True)

    local = torch.stack([stages.batch_norm_local_stats(p) for p in _parts(x, sizes)])
    count, mean, var = stages.combine_stats(local)
    assert torch.equal(count, torch.full((3,), 160.0, dtype=torch.float64))
    torch.testing.assert_close(mean, ref_mean, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(var, ref_var, atol=1e-13, rtol=1e-13)

    pairs = list(zip(_parts(x, sizes), _parts(dy, sizes)))
    total = sum(stages.batch_norm_grad_sums(xp, dp, mean) for xp, dp in pairs)
    dx = torch.cat([stages.batch_norm_grad_input(xp, dp, mean, var, gamma, count, total) for xp, dp in pairs])
    torch.testing.assert_close(dx, ref_dx, atol=1e-12, rtol=1e-12)


def test_combination_is_centred_not_a_sum_of_squares():
    # Variance 1 on top of 1e9 (float64 spacing there: 1.2e-7): a sum of squares
    # (1e20, spacing 1.6e4) would lose it entirely.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2, generator=g, dtype=torch.float64) + 1e9
    local = torch.stack([stages.batch_norm_local_stats(p) for p in _parts(x, [5, 0, 40, 19])])
    _, mean, var = stages.combine_stats(local)
    torch.testing.assert_close(var, x.var(0, correction=0), atol=0, rtol=1e-6)
    torch.testing.assert_close(mean, x.mean(0), atol=1e-6, rtol=0)


def test_no_samples_anywhere_gives_zeros_not_nan():
    x = torch.randn(0, 4, 3)
    local = stages.batch_norm_local_stats(x)
    assert torch.equal(local, torch.zeros(3, 4, dtype=torch.float64))
    count, mean, var = stages.combine_stats(torch.stack([local, local]))
    assert not any(t.isnan().any() for t in (count, mean, var))
    assert torch.equal(count, torch.zeros(4, dtype=torch.float64))
    sums = stages.batch_norm_grad_sums(x, x, mean)
    assert torch.equal(sums, torch.zeros(2, 4, dtype=torch.float64))
    dx = stages.batch_norm_grad_input(x, x, mean, var, None, count, sums)
    assert dx.shape == x.shape


def test_bad_arguments_raise_naming_them():
    x = torch.randn(4, 3, 5)
    stats64 = torch.zeros(3, dtype=torch.float64)
    sums = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="src must have rank 2 to 8"):
        stages.batch_norm_local_stats(torch.randn(5))
    with pytest.raises(ValueError, match="data_format"):
        stages.batch_norm_local_stats(x, data_format="NHWC")
    with pytest.raises(TypeError, match="src must have dtype"):
        stages.batch_norm_local_stats(x.int())
    with pytest.raises(TypeError, match="mean must have dtype float64"):
        stages.batch_norm_grad_sums(x, x, stats64.float())
    with pytest.raises(ValueError, match=r"mean must have shape \[3\]"):
        stages.batch_norm_grad_sums(x, x, torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="diff_dst must have src's shape"):
        stages.batch_norm_grad_sums(x, x[:2], stats64)
    with pytest.raises(ValueError, match=r"grad_sums must have shape \[2, 3\]"):
        stages.batch_norm_grad_input(x, x, stats64, stats64, None, stats64, sums.t())
    with pytest.raises(TypeError, match="gamma must have src's dtype"):
        stages.batch_norm_grad_input(x, x, stats64, stats64, stats64, stats64, sums)
    with pytest.raises(ValueError, match="epsilon"):
        stages.batch_norm_grad_input(x, x, stats64, stats64, None, stats64, sums, epsilon=-1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_opcheck(dtype, layout):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 5, 6, generator=g).to(dtype)
    dy = torch.randn(4, 3, 5, 6, generator=g).to(dtype)
    if layout == "channels_last":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    gamma = torch.rand(3, generator=g) + 0.5
    stats = stages.batch_norm_local_stats(x)
    count, mean, var = stages.combine_stats(stats[None])
    sums = stages.batch_norm_grad_sums(x, dy, mean)
    ops = torch.ops.torch_bn_grad
    torch.library.opcheck(ops.batch_norm_local_stats.default, (x, "NCX"))
    torch.library.opcheck(ops.batch_norm_grad_sums.default, (x, dy, mean, "NCX"))
    torch.library.opcheck(ops.batch_norm_grad_input.default, (x, dy, mean, var, gamma, count, sums, 1e-5, "NCX"))
