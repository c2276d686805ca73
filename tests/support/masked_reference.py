"""The masked batch norm's float64 reference (gather the valid positions of
each channel, normalize them, scatter them back into zeros), padded sample
batches, and the layouts, parameters and tolerances of the masked operators'
tests, shared by the masked tests."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .reference import TOLERANCES, stats_dtype


def gathered_forward(x: Tensor, mask: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
                     ) -> tuple[Tensor, Tensor, Tensor, int]:
    """float64 (dst, mean, biased variance, count) over the valid positions; differentiable."""
    xd = x.double().movedim(1, -1)  # (N, *X, C): the valid positions' rows are gathered with mask
    valid = xd[mask]
    mean = valid.mean(0)
    var = valid.var(0, unbiased=False)
    y = (valid - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    out = torch.zeros_like(xd).index_put((mask,), y)
    return out.movedim(-1, 1), mean, var, valid.shape[0]


def lengths_mask(lengths: Sequence[int], length: int, extra_dims: Sequence[int] = ()) -> Tensor:
    """(N, length, *extra_dims) mask: sequence i holds its first lengths[i] frames."""
    frames = torch.arange(length)[None, :] < torch.tensor(list(lengths))[:, None]
    return frames.reshape(*frames.shape, *([1] * len(extra_dims))).expand(*frames.shape, *extra_dims).contiguous()


def padded_batch(shape: Sequence[int], dtype: torch.dtype, seed: int, *, offset: float = 0.0,
                 pad_value: float = 0.0, random_mask: bool = False) -> tuple[Tensor, Tensor]:
    """A batch (N, C, L, *rest) with a mask (N, L, *rest): lengths between L/3 and L (or a
    random mask), data of unit scale about `offset`, `pad_value` at padded positions."""
    g = torch.Generator().manual_seed(seed)
    n, _, length, *rest = shape
    if random_mask:
        mask = torch.rand((n, length, *rest), generator=g) < 0.6
    else:
        lengths = torch.randint(max(length // 3, 1), length + 1, (n,), generator=g)
        mask = lengths_mask(lengths.tolist(), length, rest)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) + offset)
    x = torch.where(mask.unsqueeze(1), x, pad_value).to(dtype)
    return x, mask


# (shape, layout): NCX-contiguous planes, channels-last rows (an (N, L, C) tensor
# transposed, channels_last and channels_last_3d), and 4-D / 5-D planes.
LAYOUTS = [
    ((4, 6, 37), "contiguous"),
    ((4, 6, 37), "transposed"),
    ((3, 5, 9, 4), "contiguous"),
    ((3, 5, 9, 4), "channels_last"),
    ((2, 4, 5, 3, 6), "contiguous"),
    ((2, 4, 5, 3, 6), "channels_last_3d"),
    ((3, 40, 70), "contiguous"),  # rows long enough for the vector loops and partial chunks
    ((3, 40, 70), "transposed"),
]


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last_3d":
        return x.contiguous(memory_format=torch.channels_last_3d)
    return x.contiguous()


def parameters(channels: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.rand(channels, generator=g, dtype=torch.float64) + 0.5).to(stats_dtype(dtype))
    bias = torch.randn(channels, generator=g, dtype=torch.float64).to(stats_dtype(dtype))
    return weight, bias


def close(actual, expected, dtype, scale=1.0):
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol["atol"] * scale, rtol=tol["rtol"])
