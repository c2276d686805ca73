"""The operators: documented Python wrappers over ``torch.ops.torch_bn_grad``.

Both operators are differentiable to any order (autograd of the forward in
``csrc/autograd/batch_norm_autograd.cpp``, of the backward in ``_library/autograd.py``); their
fake implementations, for torch.compile and export, are in ``_library/fake.py``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from torch_bn_grad._rules import activation as _activation
from torch_bn_grad._rules.checks import check_data_format, epsilon_value, output_mask_value

__all__ = ["batch_norm_forward", "batch_norm_backward", "batch_norm_act_forward", "batch_norm_act_backward"]


def batch_norm_forward(
    src: Tensor,
    gamma: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    mean: Optional[Tensor] = None,
    variance: Optional[Tensor] = None,
    *,
    epsilon: float = 1e-5,
    data_format: str = "NCX",
) -> tuple[Tensor, Tensor, Tensor]:
    """Batch normalization: ``dst = (src - mean) / sqrt(variance + epsilon) * gamma + beta``.

    Without ``mean``/``variance`` the batch mean and biased variance are
    computed over every axis but the channel axis (or, in the DirectML broadcast
    form, over the unit dims of ``gamma``/``beta``); with both, they are used as
    given (frozen statistics).

    Returns:
        ``(dst, mean, variance)``: the output, in ``src``'s dtype and memory
        format, and the statistics that were used (float32 for float16/bfloat16
        ``src`` when computed).
    """
    op = "batch_norm_forward"
    check_data_format(op, data_format)
    return torch.ops.torch_bn_grad.batch_norm_forward.default(
        src, gamma, beta, mean, variance, epsilon_value(op, epsilon), data_format
    )


def batch_norm_backward(
    src: Tensor,
    diff_dst: Tensor,
    mean: Tensor,
    variance: Tensor,
    gamma: Optional[Tensor] = None,
    *,
    epsilon: float = 1e-5,
    data_format: str = "NCX",
    training: bool = True,
    output_mask: Sequence[bool] = (True, True, True),
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients of batch normalization: ``(diff_src, diff_gamma, diff_beta)``.

    ``training=True`` treats ``mean``/``variance`` as the batch statistics of
    ``src`` (full training-mode gradient); ``training=False`` treats them as
    constants. ``output_mask[i]`` false skips that output and returns ``None``.
    The two per-channel sums are taken in one pass over the data.
    """
    op = "batch_norm_backward"
    check_data_format(op, data_format)
    mask = output_mask_value(op, output_mask)
    outputs = torch.ops.torch_bn_grad.batch_norm_backward.default(
        src, diff_dst, mean, variance, gamma, epsilon_value(op, epsilon), data_format, bool(training), mask
    )
    return _wanted(outputs, mask)


def batch_norm_act_forward(
    src: Tensor,
    gamma: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    mean: Optional[Tensor] = None,
    variance: Optional[Tensor] = None,
    *,
    residual: Optional[Tensor] = None,
    epsilon: float = 1e-5,
    activation: str = "relu",
    negative_slope: float = 0.01,
    data_format: str = "NCX",
    memory_saving: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused ``dst = act(batch_norm_forward(src, ...) + residual)`` in one pass over the data.

    ``activation`` is ``"identity"``, ``"relu"``, ``"leaky_relu"`` (with
    ``negative_slope >= 0``) or ``"silu"``; ``residual`` (optional) has
    ``src``'s shape and dtype. Statistics, layouts and dtypes as
    :func:`batch_norm_forward`, whose ``(dst, mean, variance)`` it returns.
    ``memory_saving=True`` changes no output: autograd then keeps the output
    (and residual) instead of ``src`` and recovers ``src`` from it in the
    backward, so the gradients carry the stored output's rounding (in float32
    within a few units of the normal mode's; in float16 and bfloat16
    ``diff_gamma`` is off by up to a few percent, see docs/api.md); it needs an
    invertible activation (``"identity"``, or ``"leaky_relu"`` with
    ``negative_slope > 0``) and a ``gamma`` without zeros.
    """
    op = "batch_norm_act_forward"
    check_data_format(op, data_format)
    slope = _activation.check(op, activation, negative_slope, memory_saving)
    return torch.ops.torch_bn_grad.batch_norm_act_forward.default(
        src, gamma, beta, mean, variance, residual, epsilon_value(op, epsilon), activation, slope, data_format,
        bool(memory_saving),
    )


def batch_norm_act_backward(
    diff_dst: Tensor,
    mean: Tensor,
    variance: Tensor,
    gamma: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    *,
    src: Optional[Tensor] = None,
    dst: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    epsilon: float = 1e-5,
    activation: str = "relu",
    negative_slope: float = 0.01,
    data_format: str = "NCX",
    training: bool = True,
    from_output: bool = False,
    output_mask: Sequence[bool] = (True, True, True, True),
    dst_positive: Optional[Tensor] = None,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients of :func:`batch_norm_act_forward`: ``(diff_src, diff_gamma, diff_beta, diff_residual)``.

    Two passes over the data: the per-channel sums of ``dz`` and
    ``dz * (src - mean)``, ``dz = diff_dst * act'(z)``, then ``diff_src`` (and
    ``diff_residual = dz``). Pass ``src`` and the forward's ``dst`` (relu and
    leaky_relu read ``act'`` from it) and ``residual`` (silu recomputes ``z``
    with it). ``from_output=True`` reads ``dst`` instead of ``src`` (needs
    the forward's ``beta`` and ``residual`` and an invertible activation).
    ``training`` and ``output_mask`` as in :func:`batch_norm_backward`.
    ``dst_positive`` (CPU): the sign bits of ``dst`` that
    ``torch.ops.torch_bn_grad.batch_norm_act_forward_sign_bits`` returned for
    this ``src``, read by relu and leaky_relu instead of ``dst`` (what the
    autograd formula does in eager CPU calls).
    """
    op = "batch_norm_act_backward"
    check_data_format(op, data_format)
    slope = _activation.check(op, activation, negative_slope, from_output, "from_output")
    mask = output_mask_value(op, output_mask, ("diff_src", "diff_gamma", "diff_beta", "diff_residual"))
    outputs = torch.ops.torch_bn_grad.batch_norm_act_backward.default(
        diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon_value(op, epsilon), activation, slope,
        data_format, bool(training), bool(from_output), mask, dst_positive,
    )
    return _wanted(outputs, mask)


def _wanted(outputs: tuple, mask: list[bool]) -> tuple:
    """The backward operators' outputs with ``None`` where ``mask`` is false (the
    operators return empty tensors there); the all-true mask, the usual call,
    returns the operator's tuple as it is (a per-call cost on the GPU's host path)."""
    if all(mask):
        return outputs
    return tuple([out if wanted else None for out, wanted in zip(outputs, mask)])
