"""The modules' forward as TorchScript compiles it (``torch.jit.script``).

``torch.jit.script`` compiles a module's ``forward`` and every function it
calls; the eager forward's helpers (keyword-only arguments, tensor-or-float
momentum, decorators) are not TorchScript. Under scripting the modules' forward
calls :func:`module_forward` instead (``torch.jit.is_scripting()`` is a
compile-time constant there, so the eager path is not compiled). It has the
eager forward's semantics, those of ``torch.nn.modules.batchnorm._BatchNorm``,
on the same operator, called as ``torch.ops.torch_bn_grad.batch_norm_forward``
so that a scripted model saves and loads (``torch.jit.save``/``load``) in any
process that has imported ``torch_bn_grad``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["module_forward"]


def module_forward(
    input: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    num_batches_tracked: Optional[Tensor],
    training: bool,
    track_running_stats: bool,
    momentum: Optional[float],
    eps: float,
) -> Tensor:
    """``_BatchNorm.forward`` (after the input-rank check) on this library's operator."""
    cumulative = False
    if training and track_running_stats and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        cumulative = momentum is None
    use_batch_stats = training or (running_mean is None and running_var is None)
    keep_running = (not training) or track_running_stats
    if not keep_running:
        running_mean = None
        running_var = None
    if not use_batch_stats:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: running_mean and running_var must be given when training=False")
        dst, _, _ = torch.ops.torch_bn_grad.batch_norm_forward(
            input, weight, bias, running_mean, running_var, eps, "NCX"
        )
        return dst
    if input.dim() < 2:
        raise ValueError("batch_norm: expected input of rank 2 or more (N, C, *)")
    size_prods = input.size(0)
    for size in input.size()[2:]:
        size_prods *= size
    if size_prods == 1:
        raise ValueError("Expected more than 1 value per channel when training, got input size " + str(input.size()))
    if not eps > 0:
        raise ValueError("batch_norm: eps must be positive in training, got " + str(eps))
    dst, mean, var = torch.ops.torch_bn_grad.batch_norm_forward(input, weight, bias, None, None, eps, "NCX")
    count = input.numel() // max(input.size(1), 1)
    if count > 0 and (running_mean is not None or running_var is not None):
        if cumulative and num_batches_tracked is not None:
            # As the eager forward: 1 / n in float64.
            factor = 1.0 / num_batches_tracked.double()
        else:
            factor = torch.full((), 0.0 if momentum is None else momentum, dtype=torch.float64)
        # The update of _running_stats.update_running_stats (which takes int-or-tensor
        # counts, not TorchScript), as lerp like it, so scripted and eager agree.
        # Detached: the running statistics stay out of the autograd graph.
        mean, var = mean.detach(), var.detach()
        if running_mean is not None:
            running_mean.lerp_(mean.to(running_mean.dtype), factor)
        if running_var is not None:
            unbiased = var * (count / (count - 1)) if count > 1 else var
            running_var.lerp_(unbiased.to(running_var.dtype), factor)
    return dst
