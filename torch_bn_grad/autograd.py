"""``BatchNormFunction``: batch normalization as a ``torch.autograd.Function``."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from torch_bn_grad import ops

__all__ = ["BatchNormFunction"]


class BatchNormFunction(torch.autograd.Function):
    """``dst = BatchNormFunction.apply(src, gamma, beta, mean, variance, epsilon, data_format)``.

    ``mean``/``variance`` both ``None`` means training: the batch statistics are
    computed and the training-mode gradient is returned. Both given means
    frozen statistics. The forward runs :func:`torch_bn_grad.batch_norm_forward`
    and saves ``src``, the statistics and ``gamma``; the backward runs
    :func:`torch_bn_grad.batch_norm_backward` and returns diff_src, diff_gamma
    and diff_beta (and, for frozen statistics that require grad, their
    gradients). Gradients of any order are supported, and forward-mode AD
    (``jvp``) through ``torch.autograd.forward_ad`` dual tensors.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        src: Tensor,
        gamma: Optional[Tensor] = None,
        beta: Optional[Tensor] = None,
        mean: Optional[Tensor] = None,
        variance: Optional[Tensor] = None,
        epsilon: float = 1e-5,
        data_format: str = "NCX",
    ) -> Tensor:
        dst, mean_used, variance_used = ops.batch_norm_forward(
            src, gamma, beta, mean, variance, epsilon=epsilon, data_format=data_format
        )
        # Frozen statistics are saved as given, so that double backward reaches them.
        saved = (src, gamma, mean if mean is not None else mean_used, variance if variance is not None else variance_used)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)
        ctx.training = mean is None
        ctx.param_dtype = next((t.dtype for t in (gamma, beta) if t is not None), None)
        ctx.epsilon = epsilon
        ctx.data_format = data_format
        return dst

    @staticmethod
    def jvp(ctx: Any, src_t, gamma_t, beta_t, mean_t, variance_t, *_: Any) -> Optional[Tensor]:  # type: ignore[override]
        """Forward-mode AD (``torch.autograd.forward_ad``, ``gradcheck(check_forward_ad=True)``):
        the forward operator's own jvp formula (csrc/autograd/forward_ad.cpp)."""
        src, gamma, mean, variance = ctx.saved_tensors
        dst_t, _, _ = torch.ops.torch_bn_grad.batch_norm_forward_jvp.default(
            src, gamma, mean, variance, ctx.training, ctx.epsilon, ctx.data_format, src_t, gamma_t, beta_t,
            mean_t, variance_t,
        )
        return dst_t if dst_t is not None else torch.zeros_like(src)

    @staticmethod
    def backward(ctx: Any, grad_dst: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        src, gamma, mean, variance = ctx.saved_tensors
        if ctx.training and torch.is_grad_enabled():
            # Double backward: the statistics are functions of src, so take them
            # from the differentiable operator instead of the saved constants.
            _, mean, variance = ops.batch_norm_forward(src, gamma, epsilon=ctx.epsilon, data_format=ctx.data_format)
        # The forward operator's own gradient formula (csrc/autograd/batch_norm_autograd.cpp).
        grads = torch.ops.torch_bn_grad.batch_norm_forward_grad.default(
            src, gamma, mean, variance, grad_dst, None, None, ctx.epsilon, ctx.data_format, ctx.training,
            ctx.param_dtype, ctx.needs_input_grad[:5],
        )
        return (*grads, None, None)
