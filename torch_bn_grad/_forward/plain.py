"""The unmasked batch norm on this library's operators, once the caller has
resolved its arguments: what ``functional.batch_norm(_act)`` and the modules'
unmasked forward run.

Each function picks the operator overload for how it runs, once: an eager call
takes the one-call overloads (``.frozen``: an eval forward's output alone;
``.update``: the training forward and the running statistics' update), an
export of an eval forward the overload that decomposes to core ATen
(``_library/frozen_composite.py``), traced code (torch.compile, torch.func) the
plain operators, whose lowering and rules the tracers know. Errors are the
checks' ``ValueError``/``TypeError``; the public callers make them torch's
(``errors.torch_compatible``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from torch_bn_grad._forward.normalization import Normalization
from torch_bn_grad._rules.checks import check_running_stats, check_training
from torch_bn_grad._rules.eager import is_eager
from torch_bn_grad._rules.running_stats import forward_update_applies, update_running_stats

__all__ = ["batch_norm", "batch_norm_act"]

FORWARD = torch.ops.torch_bn_grad.batch_norm_forward
ACT_FORWARD = torch.ops.torch_bn_grad.batch_norm_act_forward


def batch_norm(
    input: Tensor, norm: Normalization, skip_nonfinite_stats: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> Tensor:
    """``functional.batch_norm`` without a mask (its arguments, its semantics)."""
    if input.dim() == 1:
        return _rank1(input, norm)
    running_mean, running_var, weight, bias, training, momentum, eps = norm
    eps = float(eps)
    if not training:
        check_running_stats("batch_norm", running_mean, running_var)
        if is_eager(input):  # dst alone: no copies of the statistics
            return FORWARD.frozen(input, weight, bias, running_mean, running_var, eps, "NCX")
        if torch.compiler.is_exporting():  # decomposable to core ATen
            return FORWARD.frozen_composite(input, weight, bias, running_mean, running_var, eps)
        return FORWARD.default(input, weight, bias, running_mean, running_var, eps, "NCX")[0]
    check_training("batch_norm", input, eps)
    # The .update overloads update unconditionally: skipping takes the separate update.
    if not skip_nonfinite_stats and forward_update_applies(input, momentum):  # absent buffers: no update
        return FORWARD.update(input, weight, bias, running_mean, running_var, momentum, eps, "NCX")[0]
    dst, mean, var = FORWARD.default(input, weight, bias, None, None, eps, "NCX")
    _update(input, running_mean, running_var, mean, var, momentum, skip_nonfinite_stats, num_batches_tracked)
    return dst


def batch_norm_act(
    input: Tensor,
    norm: Normalization,
    residual: Optional[Tensor],
    activation: str,
    negative_slope: float,
    memory_saving: bool,
    skip_nonfinite_stats: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> Tensor:
    """``functional.batch_norm_act`` without a mask, its activation arguments checked
    (``negative_slope`` as ``_rules.activation.check`` returns it)."""
    if input.dim() == 1:  # only an empty input is valid: an empty output
        return _rank1(input, norm)
    running_mean, running_var, weight, bias, training, momentum, eps = norm
    eps, memory_saving = float(eps), bool(memory_saving)
    if not training:
        check_running_stats("batch_norm_act", running_mean, running_var)
        if is_eager(input):  # as in batch_norm
            return ACT_FORWARD.frozen(input, weight, bias, running_mean, running_var, residual, eps, activation,
                                      negative_slope, "NCX", memory_saving)
        if torch.compiler.is_exporting():  # as in batch_norm
            return ACT_FORWARD.frozen_composite(input, weight, bias, running_mean, running_var, residual, eps,
                                                activation, negative_slope)
        return ACT_FORWARD.default(input, weight, bias, running_mean, running_var, residual, eps, activation,
                                   negative_slope, "NCX", memory_saving)[0]
    check_training("batch_norm_act", input, eps)
    if not skip_nonfinite_stats and forward_update_applies(input, momentum):  # as in batch_norm: one call
        return ACT_FORWARD.update(input, weight, bias, running_mean, running_var, residual, momentum, eps,
                                  activation, negative_slope, "NCX", memory_saving)[0]
    dst, mean, var = ACT_FORWARD.default(input, weight, bias, None, None, residual, eps, activation, negative_slope,
                                         "NCX", memory_saving)
    _update(input, running_mean, running_var, mean, var, momentum, skip_nonfinite_stats, num_batches_tracked)
    return dst


def _rank1(input: Tensor, norm: Normalization) -> Tensor:
    """A rank-1 input, as torch takes it: no channel axis, so only an empty input
    (with empty or no per-channel tensors) is valid, and it gives an empty output."""
    running_mean, running_var, weight, bias, training, _, _ = norm
    if training and input.shape[0] == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {input.size()}")
    if input.numel() != 0:
        raise ValueError(f"batch_norm: expected input of rank 2 or more (N, C, *), got shape {tuple(input.shape)} "
                         "(a rank-1 input has no channel axis; only an empty one is accepted)")
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                    ("bias", bias)):
        if t is not None and t.numel() != 0:
            raise ValueError(f"batch_norm: {name} should contain 0 elements for a rank-1 input, not {t.numel()}")
    return input.clone()


def _update(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor], mean: Tensor,
            var: Tensor, momentum: Union[float, Tensor], skip_nonfinite_stats: bool,
            num_batches_tracked: Optional[Tensor]) -> None:
    """The running statistics' update with a training batch's (none for an empty batch)."""
    count = input.numel() // max(input.shape[1], 1)
    if count > 0 and (running_mean is not None or running_var is not None):
        update_running_stats(running_mean, running_var, mean, var, count, momentum, skip_nonfinite_stats,
                             num_batches_tracked)
