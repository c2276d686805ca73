"""Batching rules (``torch.vmap``) for the operators.

Under vmap each of the B samples is normalized on its own, with its own
per-channel statistics. For small samples the rules make the vmapped dim one
more kept dim: a sample's ``src`` of shape S is passed as one ``(B, *S)``
tensor with its per-channel tensors in the DirectML broadcast form
``(B, *K)``, K being S with 1 on the reduced dims, so one operator call
computes all B x C channels. That layout usually needs a copy of the data (B
and the channels are not adjacent in memory), which costs more than one call
per sample once a sample is large; large samples therefore take one call per
sample on zero-copy slices. So do calls the fused form cannot express:
malformed arguments (the operator then raises its own error) and samples of
rank 8 (the broadcast form allows one dim less).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from torch_bn_grad._channels import accumulation_dtype

_MAX_RANK = 8  # the operators' rank limit
# Above this many elements per sample, one call per sample beats the fused
# call's copies (measured crossover on CPU: 2K to 4K float32 elements).
_FUSED_MAX_SAMPLE_NUMEL = 4096


@dataclass(frozen=True)
class _StatsLayout:
    """Shapes of one sample's per-channel tensors: as the operator takes and
    returns them (``logical``) and in broadcast form against ``src`` (``kept``)."""

    logical: tuple[int, ...]
    kept: tuple[int, ...]


def _sample_shape(t: Tensor, dim: Optional[int]) -> tuple[int, ...]:
    shape = list(t.shape)
    if dim is not None:
        del shape[dim]
    return tuple(shape)


def _stats_layout(
    batch_size: int,
    src_shape: tuple[int, ...],
    data_format: str,
    stats: Sequence[tuple[Optional[Tensor], Optional[int]]],
) -> Optional[_StatsLayout]:
    """The per-channel layout of one sample, or None where the fused call does not apply."""
    rank = len(src_shape)
    shapes = {_sample_shape(t, d) for t, d in stats if t is not None}
    if len(shapes) > 1 or rank + 1 > _MAX_RANK:
        return None
    if batch_size > 1 and math.prod(src_shape) > _FUSED_MAX_SAMPLE_NUMEL:
        return None
    given = next(iter(shapes), None)
    if given is not None and len(given) == rank and rank >= 1:  # broadcast form
        if any(k not in (1, s) for k, s in zip(given, src_shape)):
            return None
        return _StatsLayout(given, given)
    if rank < 2 or data_format not in ("NCX", "NXC"):
        return None
    axis = 1 if data_format == "NCX" else rank - 1
    if given is not None and given != (src_shape[axis],):
        return None
    kept = [1] * rank
    kept[axis] = src_shape[axis]
    return _StatsLayout((src_shape[axis],), tuple(kept))


def _batch_first(t: Tensor, dim: Optional[int], batch_size: int) -> Tensor:
    """``t`` with its vmapped dim first; an unbatched ``t`` is broadcast (a view)."""
    if dim is None:
        return t.expand(batch_size, *t.shape)
    return t.movedim(dim, 0)


def _batched_stats(t: Optional[Tensor], dim: Optional[int], batch_size: int, layout: _StatsLayout) -> Optional[Tensor]:
    if t is None:
        return None
    return _batch_first(t, dim, batch_size).reshape(batch_size, *layout.kept)


def _per_sample(
    op: Any, batch_size: int, in_dims: tuple, args: tuple, batched: Sequence[bool] = (True, True, True)
) -> tuple[tuple, tuple]:
    """One operator call per sample (on views), the ``batched`` outputs stacked
    (the others are the same in every call: the first is returned)."""
    results = [
        op(*(a.select(d, i) if isinstance(a, Tensor) and d is not None else a for a, d in zip(args, in_dims)))
        for i in range(batch_size)
    ]
    outputs = tuple(torch.stack(outs) if keep else outs[0] for outs, keep in zip(zip(*results), batched))
    return outputs, tuple(0 if keep else None for keep in batched)


def _forward_rule(info, in_dims, src, gamma, beta, mean, variance, epsilon, data_format):
    """vmap of ``batch_norm_forward``: outputs (dst, mean, variance), all batched at dim 0."""
    op = torch.ops.torch_bn_grad.batch_norm_forward.default
    args = (src, gamma, beta, mean, variance, epsilon, data_format)
    b = info.batch_size
    stats = list(zip((gamma, beta, mean, variance), in_dims[1:5]))
    layout = _stats_layout(b, _sample_shape(src, in_dims[0]), data_format, stats)
    if layout is None:
        return _per_sample(op, b, in_dims, args)
    gamma, beta, mean, variance = (_batched_stats(t, d, b, layout) for t, d in stats)
    if gamma is None and beta is None and mean is None:
        # Nothing carries the broadcast form: an identity gamma does (exact: the
        # kernel's default gamma is 1 too).
        gamma = torch.ones((), dtype=accumulation_dtype(src), device=src.device).expand(b, *layout.kept)
    dst, mean, variance = op(_batch_first(src, in_dims[0], b), gamma, beta, mean, variance, epsilon, data_format)
    return (dst, mean.reshape(b, *layout.logical), variance.reshape(b, *layout.logical)), (0, 0, 0)


def _backward_rule(info, in_dims, src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask):
    """vmap of ``batch_norm_backward``: the wanted outputs batched at dim 0."""
    op = torch.ops.torch_bn_grad.batch_norm_backward.default
    args = (src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask)
    b = info.batch_size
    stats = list(zip((mean, variance, gamma), in_dims[2:5]))
    src_shape = _sample_shape(src, in_dims[0])
    layout = _stats_layout(b, src_shape, data_format, stats)
    if layout is None or _sample_shape(diff_dst, in_dims[1]) != src_shape:
        return _per_sample(op, b, in_dims, args, batched=output_mask)
    mean, variance, gamma = (_batched_stats(t, d, b, layout) for t, d in stats)
    diff_src, diff_gamma, diff_beta = op(
        _batch_first(src, in_dims[0], b), _batch_first(diff_dst, in_dims[1], b),
        mean, variance, gamma, epsilon, data_format, training, output_mask,
    )
    # Skipped outputs are the operator's unbatched empty placeholders.
    outputs = (
        diff_src,
        diff_gamma.reshape(b, *layout.logical) if output_mask[1] else diff_gamma,
        diff_beta.reshape(b, *layout.logical) if output_mask[2] else diff_beta,
    )
    return outputs, tuple(0 if wanted else None for wanted in output_mask)


torch.library.register_vmap("torch_bn_grad::batch_norm_forward", _forward_rule)
torch.library.register_vmap("torch_bn_grad::batch_norm_backward", _backward_rule)
