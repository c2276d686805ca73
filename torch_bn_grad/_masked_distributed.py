"""Masked batch norm with statistics over a ``torch.distributed`` process group:
what :class:`torch_bn_grad.nn.SyncBatchNorm` runs in training with a mask.

As :func:`torch_bn_grad.distributed.sync_batch_norm`, with the valid positions
only: each process's ``(count, mean, m2)`` over its valid positions (the
masked operator's statistics; a process may hold none) is all-gathered and
combined exactly (``stages.combine_stats``), the input is normalized with the
whole group's statistics (the masked operator, frozen), and the backward
all-reduces the two gradient sums over the valid positions. Parameter
gradients stay local. Nothing is read on the host.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from torch_bn_grad import _channels
from torch_bn_grad._checks import check_mask
from torch_bn_grad._compat import functional_collectives as funcol
from torch_bn_grad._masked_autograd import BACKWARD, FORWARD, per_channel, valid_positions
from torch_bn_grad._running_stats import update_running_stats
from torch_bn_grad.distributed import group_statistics, run_collective


def sync_masked_batch_norm(
    input: Tensor,
    mask: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    momentum: Union[float, Tensor],
    eps: float,
    group: ProcessGroup,
) -> Tensor:
    """Training-mode masked batch norm of ``input`` (N, C, *X) whose statistics span ``group``."""
    check_mask("SyncBatchNorm", input, mask)
    if not eps > 0:
        raise ValueError(f"SyncBatchNorm: eps must be positive in training, got {eps}")
    _, mean, var, count = FORWARD(input.detach(), mask, None, None, None, None, float(eps))
    counts = count.expand(mean.shape[0])
    local = torch.stack((counts, mean.double(), var.double() * counts))
    total, global_mean, global_var = group_statistics(local, group)
    if running_mean is not None or running_var is not None:
        update_running_stats(running_mean, running_var, global_mean, global_var, total[0], momentum)
    return _SyncMaskedFunction.apply(input, mask, weight, bias, total[0], global_mean, global_var, eps, group)


class _SyncMaskedFunction(torch.autograd.Function):
    """Normalization of the valid positions with the group's statistics, and its
    training-mode gradient: local sums of dy and dy * (x - mean) over the valid
    positions, all-reduced for the input's gradient, kept for the parameters'."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, input: Tensor, mask: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], count: Tensor,
        mean: Tensor, variance: Tensor, eps: float, group: ProcessGroup,
    ) -> Tensor:
        stats_dtype = _channels.accumulation_dtype(input)
        dst, _, _, _ = FORWARD(
            input, mask, weight.to(stats_dtype) if weight is not None else None,
            bias.to(stats_dtype) if bias is not None else None, mean.to(stats_dtype), variance.to(stats_dtype),
            float(eps),
        )
        ctx.save_for_backward(input, mask, weight, count, mean, variance)
        ctx.eps = eps
        ctx.group = group
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return dst

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_dst: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        input, mask, weight, count, mean, variance = ctx.saved_tensors
        need_input, _, need_weight, need_bias = ctx.needs_input_grad[:4]
        # Frozen statistics, no gamma: diff_gamma = rstd * sum(dy (x - mean)), diff_beta = sum(dy).
        dtype = _channels.accumulation_dtype(input)
        _, scaled, sum_dy = BACKWARD(input, mask, grad_dst, mean.to(dtype), variance.to(dtype), None, ctx.eps,
                                     False, [False, True, True])
        rstd = (variance + ctx.eps).rsqrt()
        sums = torch.stack((sum_dy.double(), scaled.double() / rstd))
        grad_weight = (sums[1] * rstd).to(weight.dtype) if need_weight else None
        grad_bias = sums[0].to(ctx.bias_dtype) if need_bias else None
        grad_input = None
        if need_input:
            sum_dy_all, sum_dy_xc_all = run_collective(
                lambda t: funcol.all_reduce(t, "sum", ctx.group), sums, ctx.group).unbind(0)
            n = count.clamp_min(1)
            g = weight.double() if weight is not None else torch.ones_like(rstd)
            scale = g * rstd
            xc = input.double() - per_channel(mean, input)
            grad = per_channel(scale, input) * (grad_dst.double() - per_channel(sum_dy_all / n, input)
                                                - xc * per_channel(rstd * rstd * sum_dy_xc_all / n, input))
            grad_input = torch.where(valid_positions(mask), grad, 0).to(input.dtype)
        return grad_input, None, grad_weight, grad_bias, None, None, None, None, None
