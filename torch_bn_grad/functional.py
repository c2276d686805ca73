"""``torch_bn_grad.functional.batch_norm``: a drop-in for ``torch.nn.functional.batch_norm``."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from torch_bn_grad import _activation, errors
from torch_bn_grad._checks import check_running_stats, check_training
from torch_bn_grad._eager import is_eager
from torch_bn_grad._lengths import resolve_mask
from torch_bn_grad._masked import masked_batch_norm, masked_batch_norm_act
from torch_bn_grad._running_stats import forward_update_applies, update_running_stats

__all__ = ["batch_norm", "batch_norm_act"]


def batch_norm(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: Union[float, Tensor] = 0.1,
    eps: float = 1e-5,
    *,
    mask: Optional[Tensor] = None,
    lengths: Optional[Tensor] = None,
    skip_nonfinite_stats: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> Tensor:
    """Batch normalization over the channel axis 1 of ``input`` (N, C, *).

    Same signature, defaults and behaviour as ``torch.nn.functional.batch_norm``:
    in training, the batch statistics normalize ``input`` and, when given,
    ``running_mean``/``running_var`` are updated in place with ``momentum``
    (``running_var`` with the unbiased variance; no update on an empty batch);
    otherwise the running statistics normalize ``input``. ``momentum`` may also
    be a 0-dim tensor (the modules' cumulative average, ``momentum=None``).

    ``mask`` (padded batches): bool of ``input``'s shape without dim 1, ``(N, *)``
    (``(N,)`` for 2-D input), True at valid positions. The statistics (and the
    running statistics' update, with the valid count) then cover the valid
    positions only; padded positions output 0 and get gradient 0, whatever
    they hold; a batch without valid positions outputs zeros and leaves the
    running statistics untouched.

    ``lengths`` (instead of ``mask``, for (N, C, L) input): integer (N,), sample i
    valid at positions ``[0, lengths[i])``; the mask is made on the device.

    ``skip_nonfinite_stats=True``: a training batch whose mean or unbiased variance
    is not finite (an ``inf`` or NaN in ``input``) leaves ``running_mean`` and
    ``running_var`` as they were, decided on the device without a host
    synchronization; ``num_batches_tracked`` (optional), a module's counter that
    already counted this batch, as ``_BatchNorm.forward`` counts it, then loses
    it again. The output is the same either way.
    """
    try:
        mask = resolve_mask("batch_norm", input, mask, lengths)
        if mask is not None:
            return masked_batch_norm(input, mask, running_mean, running_var, weight, bias, training, momentum, eps,
                                     skip_nonfinite_stats=skip_nonfinite_stats,
                                     num_batches_tracked=num_batches_tracked)
        if input.dim() == 1:
            return _rank1(input, running_mean, running_var, weight, bias, training)
        if not training:
            check_running_stats("batch_norm", running_mean, running_var)
            if is_eager(input):  # dst alone: no copies of the statistics
                return torch.ops.torch_bn_grad.batch_norm_forward.frozen(
                    input, weight, bias, running_mean, running_var, float(eps), "NCX")
            if torch.compiler.is_exporting():  # decomposable to core ATen, see _export_decomp.py
                return torch.ops.torch_bn_grad.batch_norm_forward.frozen_composite(
                    input, weight, bias, running_mean, running_var, float(eps))
            dst, _, _ = torch.ops.torch_bn_grad.batch_norm_forward.default(
                input, weight, bias, running_mean, running_var, float(eps), "NCX"
            )
            return dst
        check_training("batch_norm", input, eps)
        # The operators themselves: their wrappers' Python-type checks are moot here (eps is a checked number).
        # The .update overloads update unconditionally: skipping takes the separate update.
        if not skip_nonfinite_stats and forward_update_applies(input, momentum):  # absent buffers: no update
            dst, _, _ = torch.ops.torch_bn_grad.batch_norm_forward.update(
                input, weight, bias, running_mean, running_var, momentum, float(eps), "NCX")
            return dst
        dst, mean, var = torch.ops.torch_bn_grad.batch_norm_forward.default(
            input, weight, bias, None, None, float(eps), "NCX")
        _update(input, running_mean, running_var, mean, var, momentum, skip_nonfinite_stats, num_batches_tracked)
        return dst
    except (ValueError, TypeError) as error:  # torch raises RuntimeError: see errors.py
        raise errors.torch_compatible(error) from None


def _rank1(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    training: bool,
) -> Tensor:
    """A rank-1 input, as torch takes it: no channel axis, so only an empty input
    (with empty or no per-channel tensors) is valid, and it gives an empty output."""
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


def batch_norm_act(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: Union[float, Tensor] = 0.1,
    eps: float = 1e-5,
    *,
    residual: Optional[Tensor] = None,
    activation: str = "relu",
    negative_slope: float = 0.01,
    memory_saving: bool = False,
    mask: Optional[Tensor] = None,
    lengths: Optional[Tensor] = None,
    skip_nonfinite_stats: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> Tensor:
    """Fused ``act(batch_norm(input, ...) + residual)``, one pass over the data each way.

    ``mask`` or ``lengths`` as in :func:`batch_norm`: padded positions output 0 whatever
    ``residual`` holds there. The masked form is one fused operator on the CPU
    (on CUDA, and for a broadcast residual, masked batch norm then torch
    operations) and ignores ``memory_saving``.

    The batch-norm arguments and the running-statistics update are exactly
    :func:`batch_norm`'s (``skip_nonfinite_stats`` and ``num_batches_tracked`` too).
    ``activation``: ``"identity"``, ``"relu"``, ``"leaky_relu"`` (``negative_slope >= 0``) or ``"silu"``; ``residual``
    (optional) has ``input``'s shape and dtype. ``memory_saving=True``
    (inplace_abn's idea) keeps the output instead of ``input`` for the backward
    and recovers ``input`` from it: it needs an invertible activation
    (``"identity"``, or ``"leaky_relu"`` with ``negative_slope > 0``; else
    ``ValueError``), ``weight`` must have no zeros (not checked), and double
    backward is then not available.
    """
    try:
        slope = _activation.check("batch_norm_act", activation, negative_slope, memory_saving)
        mask = resolve_mask("batch_norm_act", input, mask, lengths)
        if mask is not None:
            return masked_batch_norm_act(input, mask, running_mean, running_var, weight, bias, training, momentum, eps,
                                         residual, activation, slope, skip_nonfinite_stats=skip_nonfinite_stats,
                                         num_batches_tracked=num_batches_tracked)
        op = torch.ops.torch_bn_grad.batch_norm_act_forward.default
        if input.dim() == 1:  # only an empty input is valid: an empty output
            return _rank1(input, running_mean, running_var, weight, bias, training)
        if not training:
            check_running_stats("batch_norm_act", running_mean, running_var)
            if is_eager(input):  # as in batch_norm
                return torch.ops.torch_bn_grad.batch_norm_act_forward.frozen(
                    input, weight, bias, running_mean, running_var, residual, float(eps), activation, slope, "NCX",
                    bool(memory_saving))
            if torch.compiler.is_exporting():  # as in batch_norm
                return torch.ops.torch_bn_grad.batch_norm_act_forward.frozen_composite(
                    input, weight, bias, running_mean, running_var, residual, float(eps), activation, slope)
            dst, _, _ = op(input, weight, bias, running_mean, running_var, residual, float(eps), activation, slope,
                           "NCX", bool(memory_saving))
            return dst
        check_training("batch_norm_act", input, eps)
        if not skip_nonfinite_stats and forward_update_applies(input, momentum):  # as in batch_norm: one call
            dst, _, _ = torch.ops.torch_bn_grad.batch_norm_act_forward.update(
                input, weight, bias, running_mean, running_var, residual, momentum, float(eps), activation, slope,
                "NCX", bool(memory_saving))
            return dst
        dst, mean, var = op(input, weight, bias, None, None, residual, float(eps), activation, slope, "NCX",
                            bool(memory_saving))
        _update(input, running_mean, running_var, mean, var, momentum, skip_nonfinite_stats, num_batches_tracked)
        return dst
    except (ValueError, TypeError) as error:  # torch raises RuntimeError: see errors.py
        raise errors.torch_compatible(error) from None
