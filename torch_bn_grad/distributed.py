"""Batch norm with statistics over a ``torch.distributed`` process group.

``sync_batch_norm`` is the training-mode computation behind
:class:`torch_bn_grad.nn.SyncBatchNorm`. Per layer it issues one collective in
the forward (an all-gather of every process's packed ``(count, mean, m2)``,
combined exactly with Chan et al.'s formula, so processes may hold different
batch sizes, none included) and one in the backward (an all-reduce of the two
packed per-channel gradient sums). With a mask, the same over the valid
positions (``_forward/masked_stages.py``). The collectives are the traceable
functional ones and nothing reads a tensor value on the host, so the layer
compiles into one graph with ``torch.compile(fullgraph=True)`` and never
synchronizes a CUDA stream with the host.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from torch_bn_grad import _compat, ops, stages
from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._rules.checks import check_mask, check_training_eps
from torch_bn_grad._compat import functional_collectives as funcol
from torch_bn_grad._forward.masked_stages import masked_grad_input, masked_grad_sums, masked_local_stats, masked_normalize
from torch_bn_grad._rules.running_stats import update_running_stats

__all__ = ["sync_batch_norm"]


def sync_batch_norm(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    momentum: Union[float, Tensor],
    eps: float,
    group: ProcessGroup,
    *,
    mask: Optional[Tensor] = None,
    skip_nonfinite_stats: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> Tensor:
    """Training-mode batch norm of ``input`` (N, C, *) whose statistics span ``group``.

    Every process of ``group`` must call it (with its own slice of the batch,
    possibly empty). The output and the gradient of ``input`` equal those of a
    single-process batch norm on the whole batch; the gradients of ``weight``
    and ``bias`` are the local contributions (their sum over the group is the
    whole batch's). ``running_mean``/``running_var``, when given, are updated
    in place with ``momentum`` from the whole batch's statistics, unless the
    whole batch is empty. ``mask`` (padded batches) as in
    :func:`torch_bn_grad.functional.batch_norm`: all of it over the whole
    group's valid positions only. ``skip_nonfinite_stats`` and
    ``num_batches_tracked`` as in :func:`torch_bn_grad.functional.batch_norm`,
    on the whole batch's statistics: every process holds the same ones, so a
    non-finite value on any process skips the update on all of them alike.
    """
    if mask is not None:
        check_mask("sync_batch_norm", input, mask)
    check_training_eps("sync_batch_norm", eps)
    data = input.detach()
    local = stages.batch_norm_local_stats(data) if mask is None else masked_local_stats(data, mask, eps)
    count, mean, variance = group_statistics(local, group)
    if running_mean is not None or running_var is not None:
        update_running_stats(running_mean, running_var, mean, variance, count, momentum, skip_nonfinite_stats,
                             num_batches_tracked)
    return _SyncBatchNormFunction.apply(input, mask, weight, bias, count, mean, variance, eps, group)


def group_statistics(local: Tensor, group: ProcessGroup) -> tuple[Tensor, Tensor, Tensor]:
    """The whole group's (count, mean, variance) per channel from every process's
    packed local ``(count, mean, m2)`` rows: one all-gather, combined exactly
    (``stages.combine_stats``), whatever each process's count, none included."""
    gathered = run_collective(lambda t: _compat.all_gather_single(t, 0, group), local, group)
    return stages.combine_stats(gathered.view(-1, *local.shape))


def run_collective(run: Callable[[Tensor], Tensor], statistics: Tensor, group: ProcessGroup) -> Tensor:
    """``run(statistics)``, a collective over ``group``, on a device its backend takes.

    gloo's collectives take CPU tensors only (its CUDA paths fail or crash):
    there, CUDA statistics (a few values per channel) go through host memory,
    which synchronizes with the host as gloo's own CUDA support would. NCCL
    and CPU tensors run as they are."""
    if statistics.is_cuda and _takes_cpu_tensors_only(group):
        return run(statistics.cpu()).to(statistics.device)
    return run(statistics)


@torch.compiler.assume_constant_result  # a group's backend does not change: no graph break under compile
def _takes_cpu_tensors_only(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalization with the whole batch's statistics, and its full training-mode gradient.

    ``count``, ``mean`` and ``variance`` (float64, computed without autograd)
    are the whole batch's (its valid positions' with a ``mask``). The backward
    takes the local gradient sums about the global mean, keeps them for
    ``weight``/``bias`` and all-reduces them for ``input``'s gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: Tensor,
        mask: Optional[Tensor],
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        count: Tensor,
        mean: Tensor,
        variance: Tensor,
        eps: float,
        group: ProcessGroup,
    ) -> Tensor:
        frozen = _channels.to_accumulation_dtype(input, weight, bias, mean, variance)
        if mask is None:
            dst, _, _ = ops.batch_norm_forward(input, *frozen, epsilon=eps)
        else:
            dst = masked_normalize(input, mask, *frozen, eps)
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
        if mask is None:
            sums = stages.batch_norm_grad_sums(input, grad_dst, mean)
        else:
            sums = masked_grad_sums(input, mask, grad_dst, mean, variance, ctx.eps)
        grad_weight = grad_bias = grad_input = None
        if need_weight:
            grad_weight = (sums[1] * (variance + ctx.eps).rsqrt()).to(weight.dtype)
        if need_bias:
            grad_bias = sums[0].to(ctx.bias_dtype)
        if need_input:
            total = run_collective(lambda t: funcol.all_reduce(t, "sum", ctx.group), sums, ctx.group)
            if mask is None:
                grad_input = stages.batch_norm_grad_input(
                    input, grad_dst, mean, variance, weight, count, total, epsilon=ctx.eps
                )
            else:
                grad_input = masked_grad_input(input, mask, grad_dst, mean, variance, weight, count, total, ctx.eps)
        return grad_input, None, grad_weight, grad_bias, None, None, None, None, None
