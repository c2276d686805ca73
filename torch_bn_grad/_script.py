"""The modules' forward as TorchScript compiles it (``torch.jit.script``).

``torch.jit.script`` compiles a module's ``forward`` and every function it
calls; the eager forward's helpers (keyword-only arguments, tensor-or-float
momentum, decorators) are not TorchScript. Under scripting the modules' forward
calls :func:`module_forward` instead (``torch.jit.is_scripting()`` is a
compile-time constant there, so the eager path is not compiled). It has the
eager forward's semantics, those of ``torch.nn.modules.batchnorm._BatchNorm``
(with a mask, the masked batch norm's), on the same operators, called as
``torch.ops.torch_bn_grad.batch_norm_forward`` and
``batch_norm_masked_forward`` so that a scripted model saves and loads
(``torch.jit.save``/``load``) in any process that has imported
``torch_bn_grad``. The running statistics take the eager update's tensor form
(``_running_stats.update_with_count_tensor``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from torch_bn_grad._running_stats import update_with_count_tensor

__all__ = ["module_forward"]


def module_forward(
    input: Tensor,
    mask: Optional[Tensor],
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
    """``_BatchNorm.forward`` (after the input-rank check) on this library's operators;
    with ``mask``, the masked batch norm of ``functional.batch_norm(..., mask=)``."""
    use_batch_stats = training or (running_mean is None and running_var is None)
    if not use_batch_stats:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: running_mean and running_var must be given when training=False")
        if mask is None:
            dst, _, _ = torch.ops.torch_bn_grad.batch_norm_forward(
                input, weight, bias, running_mean, running_var, eps, "NCX"
            )
            return dst
        dst, _, _, _ = torch.ops.torch_bn_grad.batch_norm_masked_forward(
            input, mask, weight, bias, running_mean, running_var, eps
        )
        return dst
    tracking = training and track_running_stats
    if mask is None:
        factor = _count_batch(num_batches_tracked, tracking, momentum)  # first, as torch's forward
        if input.dim() < 2:
            raise ValueError("batch_norm: expected input of rank 2 or more (N, C, *)")
        size_prods = input.size(0)
        for size in input.size()[2:]:
            size_prods *= size
        if size_prods == 1:
            raise ValueError("Expected more than 1 value per channel when training, got input size "
                             + str(input.size()))
        if not eps > 0:
            raise ValueError("batch_norm: eps must be positive in training, got " + str(eps))
        dst, mean, var = torch.ops.torch_bn_grad.batch_norm_forward(input, weight, bias, None, None, eps, "NCX")
        count = torch.full((), input.numel() // max(input.size(1), 1), dtype=torch.float64, device=mean.device)
    else:
        if not eps > 0:
            raise ValueError("batch_norm: eps must be positive in training, got " + str(eps))
        # The operator checks the mask (argument, expected and actual shape or dtype) before
        # anything is written; the batch is counted after it, as the eager forward counts it
        # after _checks.check_mask.
        dst, mean, var, count = torch.ops.torch_bn_grad.batch_norm_masked_forward(
            input, mask, weight, bias, None, None, eps
        )
        factor = _count_batch(num_batches_tracked, tracking, momentum)
    if tracking and (running_mean is not None or running_var is not None):
        update_with_count_tensor(running_mean, running_var, mean, var, count, factor)
    return dst


def _count_batch(
    num_batches_tracked: Optional[Tensor], tracking: bool, momentum: Optional[float]
) -> Union[float, Tensor]:
    """Counts a training batch in ``num_batches_tracked`` and returns the update's
    momentum: the cumulative average's ``1 / n`` (in float64, as the eager forward)
    for ``momentum=None``."""
    factor: Union[float, Tensor] = 0.0 if momentum is None else momentum
    if tracking and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        if momentum is None:
            factor = 1.0 / num_batches_tracked.double()
    return factor

