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
(``_running_stats.update_with_count_tensor``), skipping batches with
non-finite statistics as the eager update does when the module's
``skip_nonfinite_stats`` is set.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_bn_grad._rules.checks import check_running_stats, check_training, check_training_eps
from torch_bn_grad._rules.running_stats import count_batch, update_with_count_tensor

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
    skip_nonfinite_stats: bool = False,
) -> Tensor:
    """``_BatchNorm.forward`` (after the input-rank check) on this library's operators;
    with ``mask``, the masked batch norm of ``functional.batch_norm(..., mask=)``;
    ``skip_nonfinite_stats`` the modules' switch (``functional.batch_norm``'s)."""
    use_batch_stats = training or (running_mean is None and running_var is None)
    if not use_batch_stats:
        check_running_stats("batch_norm", running_mean, running_var)
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
        factor = count_batch(num_batches_tracked, tracking, momentum)  # first, as torch's forward
        check_training("batch_norm", input, eps)
        dst, mean, var = torch.ops.torch_bn_grad.batch_norm_forward(input, weight, bias, None, None, eps, "NCX")
        count = torch.full((), input.numel() // max(input.size(1), 1), dtype=torch.float64, device=mean.device)
    else:
        check_training_eps("batch_norm", eps)
        # The operator checks the mask (argument, expected and actual shape or dtype) before
        # anything is written; the batch is counted after it, as the eager forward counts it
        # after _checks.check_mask.
        dst, mean, var, count = torch.ops.torch_bn_grad.batch_norm_masked_forward(
            input, mask, weight, bias, None, None, eps
        )
        factor = count_batch(num_batches_tracked, tracking, momentum)
    if tracking and (running_mean is not None or running_var is not None):
        update_with_count_tensor(running_mean, running_var, mean, var, count, factor, skip_nonfinite_stats,
                                 num_batches_tracked)
    return dst
