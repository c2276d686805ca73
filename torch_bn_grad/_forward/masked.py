"""Masked batch norm for padded batches: what ``functional.batch_norm(..., mask=)``,
``functional.batch_norm_act(..., mask=)`` and the modules' ``forward(input, mask)`` run.

The result equals gathering each channel's valid positions, batch-normalizing
them and scattering them back into zeros: statistics over valid positions
only, running statistics updated with the unbiased variance of the valid
count (untouched when there is none), padded outputs and gradients exactly 0.
The valid count stays a tensor: nothing waits on the mask's contents. Under
the ONNX exporters the same batch norm is made of torch operators
(``_onnx.masked_batch_norm``), which they translate.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from torch_bn_grad import _compat
from torch_bn_grad._rules import activation as _activation
from torch_bn_grad._interop import onnx as _onnx
from torch_bn_grad._rules.checks import check_mask, check_statistics
from torch_bn_grad._forward.normalization import Normalization
from torch_bn_grad._forward.masked_operators import FORWARD, FORWARD_ACT, valid_positions
from torch_bn_grad._rules.running_stats import update_running_stats


def batch_norm(
    input: Tensor,
    mask: Tensor,
    norm: Normalization,
    op: str = "batch_norm",
    *,
    skip_nonfinite_stats: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> Tensor:
    """Batch norm of ``input`` (N, C, *X) over the positions where ``mask`` (N, *X) is True
    (``skip_nonfinite_stats``, ``num_batches_tracked``: ``functional.batch_norm``'s)."""
    check_mask(op, input, mask)
    running_mean, running_var, weight, bias, training, _, eps = norm
    if _compat.in_onnx_export():  # the exporters translate torch's operators, not this library's
        check_statistics(op, training, running_mean, running_var, eps)
        return _onnx.masked_batch_norm(input, mask, norm)
    if not training and torch.compiler.is_exporting():  # see _library/frozen_composite.py
        check_statistics(op, training, running_mean, running_var, eps)
        return torch.ops.torch_bn_grad.batch_norm_forward.frozen_composite(
            input, weight, bias, running_mean, running_var, float(eps), mask)
    return _normalize(lambda mean, var: FORWARD(input, mask, weight, bias, mean, var, float(eps)), norm, op,
                      skip_nonfinite_stats, num_batches_tracked)


def batch_norm_act(
    input: Tensor,
    mask: Tensor,
    norm: Normalization,
    residual: Optional[Tensor],
    activation: str,
    negative_slope: float,
    op: str = "batch_norm_act",
    *,
    skip_nonfinite_stats: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> Tensor:
    """``activation(batch_norm(...) + residual)``, padded outputs 0 whatever
    ``residual`` holds there: one fused operator on the CPU (a residual of
    ``input``'s shape, dtype and device, or none), else (CUDA, ONNX export)
    composed (:func:`masked_add_activate`)."""
    if not fused_masked_act(input, residual) or _compat.in_onnx_export():
        y = batch_norm(input, mask, norm, op, skip_nonfinite_stats=skip_nonfinite_stats,
                       num_batches_tracked=num_batches_tracked)
        return masked_add_activate(y, mask, residual, activation, negative_slope)
    check_mask(op, input, mask)
    running_mean, running_var, weight, bias, training, _, eps = norm
    if not training and torch.compiler.is_exporting():  # see _library/frozen_composite.py
        check_statistics(op, training, running_mean, running_var, eps)
        return torch.ops.torch_bn_grad.batch_norm_act_forward.frozen_composite(
            input, weight, bias, running_mean, running_var, residual, float(eps), activation, float(negative_slope),
            mask)
    return _normalize(
        lambda mean, var: FORWARD_ACT(input, mask, weight, bias, mean, var, residual, float(eps), activation,
                                      float(negative_slope)),
        norm, op, skip_nonfinite_stats, num_batches_tracked)


def fused_masked_act(input: Tensor, residual: Optional[Tensor]) -> bool:
    """Whether the masked fused forward is one operator: on the CPU, for a residual it
    takes as it is (elsewhere masked batch norm, then ``masked_add_activate``)."""
    return input.device.type == "cpu" and _activation.fuses_residual(input, residual)


def _normalize(
    forward: Callable[[Optional[Tensor], Optional[Tensor]], tuple[Tensor, Tensor, Tensor, Tensor]],
    norm: Normalization,
    op: str,
    skip_nonfinite_stats: bool,
    num_batches_tracked: Optional[Tensor],
) -> Tensor:
    """Either masked operator, ``forward(mean, variance)``, with frozen statistics
    (eval) or batch statistics and the running-statistics update (training)."""
    running_mean, running_var, _, _, training, momentum, eps = norm
    check_statistics(op, training, running_mean, running_var, eps)
    if not training:
        return forward(running_mean, running_var)[0]
    dst, mean, var, count = forward(None, None)
    if running_mean is not None or running_var is not None:
        update_running_stats(running_mean, running_var, mean, var, count, momentum, skip_nonfinite_stats,
                             num_batches_tracked)
    return dst


def masked_add_activate(
    y: Tensor, mask: Tensor, residual: Optional[Tensor], activation: str, negative_slope: float
) -> Tensor:
    """``activation(y + residual)`` for a masked batch norm's output ``y`` (0 at padded
    positions): the residual's padding is dropped before the add, and every
    activation maps 0 to 0, so padded outputs stay 0 and get no gradient."""
    if residual is not None:
        y = y + torch.where(valid_positions(mask), residual, 0)
    return _activation.activate(y, activation, negative_slope)
