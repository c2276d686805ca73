"""Property tests: batch_norm_forward and batch_norm_backward against the
float64 reference over random ranks, shapes, data formats, broadcast patterns,
memory layouts and dtypes, on every device."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_bn_grad
from support.reference import DTYPES, assert_close, broadcast_shape, reference_backward, reference_forward, stats_dtype

SETTINGS = settings(max_examples=150, deadline=None)


@dataclass
class Problem:
    """One random operator call: data shape, layout, dtype and form of the statistics."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    data_format: str
    stats_shape: list[int]  # 1-D (C,) or the broadcast form
    layout: str  # contiguous | permuted | sliced | channels_last
    permutation: tuple[int, ...]  # memory order for "permuted"
    sliced_dim: int
    seed: int

    def make(self, g: torch.Generator, scale: float = 1.0, offset: float = 0.0, device: str = "cpu") -> torch.Tensor:
        """A tensor of the problem's shape, dtype and layout on `device` (values drawn on the CPU)."""
        if self.layout == "permuted":
            stored = [self.shape[p] for p in self.permutation]
            t = torch.randn(stored, generator=g, dtype=torch.float64) * scale + offset
            inverse = sorted(range(len(self.permutation)), key=self.permutation.__getitem__)
            return t.to(device, self.dtype).permute(inverse)
        if self.layout == "sliced":
            big = list(self.shape)
            big[self.sliced_dim] *= 2
            t = torch.randn(big, generator=g, dtype=torch.float64) * scale + offset
            every_other = (slice(None),) * self.sliced_dim + (slice(None, None, 2),)
            return t.to(device, self.dtype)[every_other]
        t = torch.randn(self.shape, generator=g, dtype=torch.float64) * scale + offset
        if self.layout == "channels_last":
            fmt = torch.channels_last if len(self.shape) == 4 else torch.channels_last_3d
            return t.to(device=device, dtype=self.dtype, memory_format=fmt)
        return t.to(device, self.dtype)

    def reduced_count(self, x: torch.Tensor) -> int:
        bshape = broadcast_shape(x, self.data_format, self.stats_shape)
        return math.prod(s for s, b in zip(x.shape, bshape) if b == 1)


@st.composite
def problems(draw) -> Problem:
    rank = draw(st.integers(1, 8))
    max_dim = 5 if rank <= 4 else 3
    shape = tuple(draw(st.lists(st.integers(1, max_dim), min_size=rank, max_size=rank)))
    form = "broadcast" if rank == 1 else draw(st.sampled_from(["NCX", "NXC", "broadcast"]))
    if form == "broadcast":
        kept = draw(st.lists(st.booleans(), min_size=rank, max_size=rank))
        stats_shape = [s if k else 1 for s, k in zip(shape, kept)]
        data_format = draw(st.sampled_from(["NCX", "NXC"]))  # ignored in this form
    else:
        stats_shape = [shape[1] if form == "NCX" else shape[-1]]
        data_format = form
    layouts = ["contiguous", "permuted", "sliced"] + (["channels_last"] if rank in (4, 5) else [])
    return Problem(
        shape=shape,
        dtype=draw(st.sampled_from(DTYPES)),
        data_format=data_format,
        stats_shape=stats_shape,
        layout=draw(st.sampled_from(layouts)),
        permutation=tuple(draw(st.permutations(range(rank)))),
        sliced_dim=draw(st.integers(0, rank - 1)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _per_channel(p: Problem, g: torch.Generator, device: str, *, uniform: bool, scale: float, offset: float):
    """A per-channel tensor of the statistics' shape and dtype on `device` (values drawn on the CPU)."""
    draw = torch.rand if uniform else torch.randn
    t = draw(p.stats_shape, generator=g, dtype=torch.float64) * scale + offset
    return t.to(device, stats_dtype(p.dtype))


def _parameters(p: Problem, g: torch.Generator, with_gamma: bool, with_beta: bool, device: str):
    gamma = _per_channel(p, g, device, uniform=True, scale=1.0, offset=0.5) if with_gamma else None
    beta = _per_channel(p, g, device, uniform=False, scale=1.0, offset=0.0) if with_beta else None
    return gamma, beta


def _stats_tolerance(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@SETTINGS
@given(p=problems(), frozen=st.booleans(), with_gamma=st.booleans(), with_beta=st.booleans())
def test_forward_matches_reference(device, p, frozen, with_gamma, with_beta):
    g = torch.Generator().manual_seed(p.seed)
    x = p.make(g, scale=2.0, offset=0.5, device=device)
    gamma, beta = _parameters(p, g, with_gamma, with_beta, device)
    mean = var = None
    if frozen:
        mean = _per_channel(p, g, device, uniform=False, scale=0.1, offset=0.0)
        var = _per_channel(p, g, device, uniform=True, scale=1.0, offset=0.5)
    elif len(p.stats_shape) == x.dim() and gamma is None and beta is None:
        # the form needs a per-channel tensor
        gamma = torch.ones(p.stats_shape, dtype=stats_dtype(p.dtype), device=device)

    dst, m, v = torch_bn_grad.batch_norm_forward(x, gamma, beta, mean, var, data_format=p.data_format)
    ref_dst, ref_m, ref_v = reference_forward(x, gamma, beta, mean, var, 1e-5, p.data_format)
    assert dst.dtype == x.dtype and dst.shape == x.shape
    assert dst.stride() == torch.empty_like(x).stride()
    assert list(m.shape) == list(v.shape) == p.stats_shape
    assert_close(dst, ref_dst, p.dtype)
    assert_close(m, ref_m, _stats_tolerance(p.dtype))
    assert_close(v, ref_v, _stats_tolerance(p.dtype), scale=4)


@SETTINGS
@given(p=problems(), training=st.booleans(), with_gamma=st.booleans())
def test_backward_matches_reference(device, p, training, with_gamma):
    g = torch.Generator().manual_seed(p.seed)
    x = p.make(g, scale=2.0, offset=0.5, device=device)
    dy = p.make(g, device=device)
    gamma, _ = _parameters(p, g, with_gamma, False, device)
    dt = stats_dtype(p.dtype)
    if training:
        ones = torch.ones(p.stats_shape, device=device)
        _, mean, var = reference_forward(x, ones, None, None, None, 1e-5, p.data_format)
        mean, var = mean.to(dt), var.to(dt)
    else:
        mean = _per_channel(p, g, device, uniform=False, scale=0.1, offset=0.0)
        var = _per_channel(p, g, device, uniform=True, scale=1.0, offset=0.5)

    dx, dg, db = torch_bn_grad.batch_norm_backward(
        x, dy, mean, var, gamma, data_format=p.data_format, training=training
    )
    ref_dx, ref_dg, ref_db = reference_backward(x, dy, mean, var, gamma, 1e-5, p.data_format, training)
    assert dx.dtype == x.dtype and dx.stride() == torch.empty_like(x).stride()
    assert dg.dtype == db.dtype == dt and list(dg.shape) == list(db.shape) == p.stats_shape
    m = p.reduced_count(x)
    # With few elements per channel the batch variance can be tiny, which
    # scales diff_src by up to 1/sqrt(eps): compare it relative to its size.
    scale = max(2.0, ref_dx.abs().max().item())
    assert_close(dx, ref_dx, p.dtype, scale=scale)
    assert_close(dg, ref_dg, p.dtype, scale=m)
    assert_close(db, ref_db, p.dtype, scale=m)
