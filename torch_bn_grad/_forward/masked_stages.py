"""The masked counterparts of the three stage operators, for
:func:`torch_bn_grad.distributed.sync_batch_norm` with a mask (what
:class:`torch_bn_grad.nn.SyncBatchNorm` runs in training with one).

Each packs what its stage operator packs, over the valid positions only (a
process may hold none): the local ``(count, mean, m2)`` rows (the masked
operator's statistics), the two gradient sums about the group's mean (the
masked backward operator, frozen), and the input gradient from the group's
sums, 0 at padded positions. Nothing is read on the host.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._forward.masked_operators import BACKWARD, FORWARD, per_channel, valid_positions


def masked_local_stats(input: Tensor, mask: Tensor, eps: float) -> Tensor:
    """This process's packed ``(count, mean, m2)`` rows (3, C), float64, over the valid
    positions: ``stages.batch_norm_local_stats``'s."""
    _, mean, var, count = FORWARD(input, mask, None, None, None, None, float(eps))
    counts = count.expand(mean.shape[0])
    return torch.stack((counts, mean.double(), var.double() * counts))


def masked_normalize(input: Tensor, mask: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                     variance: Tensor, eps: float) -> Tensor:
    """The valid positions normalized with frozen statistics, 0 at padded ones."""
    dst, _, _, _ = FORWARD(input, mask, weight, bias, mean, variance, float(eps))
    return dst


def masked_grad_sums(input: Tensor, mask: Tensor, grad_dst: Tensor, mean: Tensor, variance: Tensor,
                     eps: float) -> Tensor:
    """The (2, C) float64 sums of dy and dy * (x - mean) over the valid positions:
    ``stages.batch_norm_grad_sums``'s."""
    # Frozen statistics, no gamma: diff_gamma = rstd * sum(dy (x - mean)), diff_beta = sum(dy).
    dtype = _channels.accumulation_dtype(input)
    _, scaled, sum_dy = BACKWARD(input, mask, grad_dst, mean.to(dtype), variance.to(dtype), None, eps,
                                 False, [False, True, True])
    rstd = (variance + eps).rsqrt()
    return torch.stack((sum_dy.double(), scaled.double() / rstd))


def masked_grad_input(input: Tensor, mask: Tensor, grad_dst: Tensor, mean: Tensor, variance: Tensor,
                      weight: Optional[Tensor], count: Tensor, grad_sums: Tensor, eps: float) -> Tensor:
    """The training-mode input gradient from the whole group's ``count`` and
    ``grad_sums`` (:func:`masked_grad_sums`, all-reduced), in float64, 0 at padded
    positions: ``stages.batch_norm_grad_input``'s."""
    sum_dy_all, sum_dy_xc_all = grad_sums.unbind(0)
    rstd = (variance + eps).rsqrt()
    n = count.clamp_min(1)
    g = weight.double() if weight is not None else torch.ones_like(rstd)
    scale = g * rstd
    xc = input.double() - per_channel(mean, input)
    grad = per_channel(scale, input) * (grad_dst.double() - per_channel(sum_dy_all / n, input)
                                        - xc * per_channel(rstd * rstd * sum_dy_xc_all / n, input))
    return torch.where(valid_positions(mask), grad, 0).to(input.dtype)
