"""The rules for per-channel tensors, in one place: their shapes (and the
reduced dims) and their dtypes, shared by the fake implementations, the
autograd formulas, the batching rules and the modules.

A per-channel tensor ("statistics": mean, variance, gamma, beta and their
gradients) is either 1-D of length C, with the channel axis chosen by
``data_format``, or has ``src``'s rank (DirectML broadcast form), where its
unit dims are the reduced ones.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


HALF_TYPES = (torch.float16, torch.bfloat16)
# The data dtypes the operators take.
FLOAT_TYPES = (torch.float64, torch.float32, *HALF_TYPES)


def accumulation_dtype(src: Tensor) -> torch.dtype:
    """The dtype computed statistics (and the formulas' per-channel algebra) take for ``src``:
    float32 for float16/bfloat16 data, else ``src``'s dtype."""
    return torch.float32 if src.dtype in HALF_TYPES else src.dtype


def to_accumulation_dtype(src: Tensor, *stats: Optional[Tensor]) -> list[Optional[Tensor]]:
    """Per-channel tensors (None kept) in ``accumulation_dtype(src)``: frozen statistics,
    and so the parameters applied with them, stay float32 for half-precision data
    even with half-precision parameters (a mean rounded to bfloat16 is too coarse)."""
    dtype = accumulation_dtype(src)
    return [None if t is None else t.to(dtype) for t in stats]


def is_broadcast_form(src: Tensor, stats: Optional[Tensor]) -> bool:
    """True when ``stats`` uses the DirectML broadcast form for ``src``."""
    return stats is not None and stats.dim() == src.dim() and (src.dim() == 1 or stats.dim() >= 2)


def stats_shape(src: Tensor, stats: Optional[Tensor], data_format: str) -> list[int]:
    """Shape of the per-channel tensors for ``src``, given the first one supplied (if any)."""
    if stats is not None:
        return list(stats.shape)
    torch._check_value(src.dim() >= 2, lambda: "src of rank 1 needs statistics or gamma/beta in broadcast form")
    return [src.shape[channel_axis(src, data_format)]]


def channel_axis(src: Tensor, data_format: str) -> int:
    """The channel axis of ``src`` for 1-D statistics."""
    return 1 if data_format == "NCX" else src.dim() - 1


def reduced_dims(src: Tensor, stats: Tensor, data_format: str) -> list[int]:
    """The dims of ``src`` that a channel's reduction runs over."""
    if is_broadcast_form(src, stats):
        return [d for d in range(src.dim()) if stats.shape[d] == 1]
    axis = channel_axis(src, data_format)
    return [d for d in range(src.dim()) if d != axis]


def broadcastable(stats: Tensor, src: Tensor, data_format: str) -> Tensor:
    """``stats`` viewed so that it broadcasts against ``src``."""
    if is_broadcast_form(src, stats):
        return stats
    shape = [1] * src.dim()
    shape[channel_axis(src, data_format)] = stats.shape[0]
    return stats.reshape(shape)


def reduce_to_stats(t: Tensor, dims: Sequence[int], shape: Sequence[int]) -> Tensor:
    """Sum of ``t`` over the reduced ``dims``, shaped like the statistics."""
    return t.sum(dim=list(dims), keepdim=True).reshape(shape) if dims else t.reshape(shape)


def reduced_count(src: Tensor, dims: Sequence[int]) -> int:
    """Number of elements each channel reduces over."""
    count = 1
    for d in dims:
        count *= src.shape[d]
    return count
