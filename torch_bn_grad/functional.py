"""``torch_bn_grad.functional.batch_norm``: a drop-in for ``torch.nn.functional.batch_norm``,
and the fused ``batch_norm_act``. Each resolves its mask (``mask=`` or ``lengths=``), then
takes the masked or the unmasked path (``_forward/masked.py``, ``_forward/plain.py``)."""

from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from torch_bn_grad import errors
from torch_bn_grad._forward import masked, plain
from torch_bn_grad._forward.lengths import resolve_mask
from torch_bn_grad._rules import activation as _activation

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
        norm = (running_mean, running_var, weight, bias, training, momentum, eps)
        if mask is not None:
            return masked.batch_norm(input, mask, norm, skip_nonfinite_stats=skip_nonfinite_stats,
                                     num_batches_tracked=num_batches_tracked)
        return plain.batch_norm(input, norm, skip_nonfinite_stats, num_batches_tracked)
    except (ValueError, TypeError) as error:  # torch raises RuntimeError: see errors.py
        raise errors.torch_compatible(error) from None


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
        norm = (running_mean, running_var, weight, bias, training, momentum, eps)
        if mask is not None:
            return masked.batch_norm_act(input, mask, norm, residual, activation, slope,
                                         skip_nonfinite_stats=skip_nonfinite_stats,
                                         num_batches_tracked=num_batches_tracked)
        return plain.batch_norm_act(input, norm, residual, activation, slope, memory_saving, skip_nonfinite_stats,
                                    num_batches_tracked)
    except (ValueError, TypeError) as error:  # torch raises RuntimeError: see errors.py
        raise errors.torch_compatible(error) from None
