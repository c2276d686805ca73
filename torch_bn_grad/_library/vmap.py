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

from torch_bn_grad._rules.channels import accumulation_dtype

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


def _fused_forward(op: Any, info, in_dims: tuple, args: tuple, data_format: str, data_indices: Sequence[int]):
    """A forward operator's rule. ``args[0]`` is src, ``args[1:5]`` gamma, beta,
    mean and variance; ``data_indices`` name the arguments of src's shape
    (src, a residual). Outputs (dst, mean, variance), batched at dim 0."""
    b = info.batch_size
    src_shape = _sample_shape(args[0], in_dims[0])
    stats = list(zip(args[1:5], in_dims[1:5]))
    data = [(i, args[i], in_dims[i]) for i in data_indices if args[i] is not None]
    layout = _stats_layout(b, src_shape, data_format, stats)
    if layout is None or any(_sample_shape(t, d) != src_shape for _, t, d in data):
        return _per_sample(op, b, in_dims, args)
    call = list(args)
    for i, t, d in data:
        call[i] = _batch_first(t, d, b)
    call[1:5] = (_batched_stats(t, d, b, layout) for t, d in stats)
    if call[1] is None and call[2] is None and call[3] is None:
        # Nothing carries the broadcast form: an identity gamma does (exact: the
        # kernel's default gamma is 1 too).
        call[1] = torch.ones((), dtype=accumulation_dtype(args[0]), device=args[0].device).expand(b, *layout.kept)
    dst, mean, variance = op(*call)[:3]
    return (dst, mean.reshape(b, *layout.logical), variance.reshape(b, *layout.logical)), (0, 0, 0)


def _fused_backward(op: Any, info, in_dims: tuple, args: tuple, data_format: str, data_indices: Sequence[int],
                    stats_indices: Sequence[int], output_mask: Sequence[bool]):
    """A backward operator's rule: ``data_indices`` name the arguments of src's
    shape (the first is always given), ``stats_indices`` the per-channel ones.
    Outputs 1 and 2 are per channel (diff_gamma, diff_beta), the others of
    src's shape; the wanted ones batched at dim 0."""
    b = info.batch_size
    data = [(i, args[i], in_dims[i]) for i in data_indices if args[i] is not None]
    src_shape = _sample_shape(data[0][1], data[0][2])
    stats = [(args[i], in_dims[i]) for i in stats_indices]
    layout = _stats_layout(b, src_shape, data_format, stats)
    if layout is None or any(_sample_shape(t, d) != src_shape for _, t, d in data):
        return _per_sample(op, b, in_dims, args, batched=output_mask)
    call = list(args)
    for i, t, d in data:
        call[i] = _batch_first(t, d, b)
    for i, (t, d) in zip(stats_indices, stats):
        call[i] = _batched_stats(t, d, b, layout)
    # Skipped outputs are the operator's unbatched empty placeholders.
    outputs = tuple(
        out.reshape(b, *layout.logical) if k in (1, 2) and output_mask[k] else out
        for k, out in enumerate(op(*call))
    )
    return outputs, tuple(0 if wanted else None for wanted in output_mask)


def _forward_rule(info, in_dims, src, gamma, beta, mean, variance, epsilon, data_format):
    """vmap of ``batch_norm_forward``."""
    args = (src, gamma, beta, mean, variance, epsilon, data_format)
    return _fused_forward(torch.ops.torch_bn_grad.batch_norm_forward.default, info, in_dims, args, data_format, (0,))


def _backward_rule(info, in_dims, src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask):
    """vmap of ``batch_norm_backward``."""
    args = (src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask)
    return _fused_backward(torch.ops.torch_bn_grad.batch_norm_backward.default, info, in_dims, args, data_format,
                           (0, 1), (2, 3, 4), output_mask)


def _act_forward_rule(info, in_dims, src, gamma, beta, mean, variance, residual, epsilon, activation,
                      negative_slope, data_format, memory_saving):
    """vmap of ``batch_norm_act_forward``."""
    args = (src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, data_format,
            memory_saving)
    return _fused_forward(torch.ops.torch_bn_grad.batch_norm_act_forward.default, info, in_dims, args,
                          data_format, (0, 5))


def _act_forward_sign_bits_rule(info, in_dims, src, gamma, beta, mean, variance, residual, epsilon, activation,
                                negative_slope, data_format):
    """vmap of ``batch_norm_act_forward_sign_bits``: its sign bits would follow
    the fused call's element order, not a sample's, so none are returned (an
    empty tensor, which the backward takes as "read dst")."""
    outputs, dims = _act_forward_rule(info, in_dims[:10] + (None,), src, gamma, beta, mean, variance, residual,
                                      epsilon, activation, negative_slope, data_format, False)
    no_bits = torch.empty(0, dtype=torch.uint8, device=src.device)
    return outputs + (no_bits,), dims + (None,)


def _act_backward_rule(info, in_dims, diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon,
                       activation, negative_slope, data_format, training, from_output, output_mask,
                       dst_positive=None):
    """vmap of ``batch_norm_act_backward``. Sign bits taken per sample (the
    per-sample forward's) keep the per-sample path; empty ones are dropped."""
    op = torch.ops.torch_bn_grad.batch_norm_act_backward.default
    in_dims = tuple(in_dims) + (None,) * (16 - len(in_dims))  # dst_positive has a default
    if dst_positive is not None and dst_positive.numel() == 0 and in_dims[15] is None:
        dst_positive = None
    args = (diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon, activation, negative_slope,
            data_format, training, from_output, output_mask, dst_positive)
    if dst_positive is not None:
        return _per_sample(op, info.batch_size, in_dims, args, batched=output_mask)
    return _fused_backward(op, info, in_dims, args, data_format, (0, 1, 2, 3), (4, 5, 6, 7), output_mask)


torch.library.register_vmap("torch_bn_grad::batch_norm_forward", _forward_rule)
torch.library.register_vmap("torch_bn_grad::batch_norm_backward", _backward_rule)
torch.library.register_vmap("torch_bn_grad::batch_norm_act_forward", _act_forward_rule)
torch.library.register_vmap("torch_bn_grad::batch_norm_act_forward_sign_bits", _act_forward_sign_bits_rule)
torch.library.register_vmap("torch_bn_grad::batch_norm_act_backward", _act_backward_rule)
