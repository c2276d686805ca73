"""Autograd formulas of the masked operators ``batch_norm_masked_forward`` and
``batch_norm_masked_backward`` (their fake implementations are in ``_fake.py``).

The forward's gradient is the backward operator (padded positions get 0 and
are never read); the backward's own gradient is ``_autograd.backward_backward``
over the valid positions, made of differentiable torch operators, so that
gradients of any order flow. Forward-mode AD is not provided (it raises).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_bn_grad import _channels
from torch_bn_grad._autograd import backward_backward
from torch_bn_grad._autograd_kernel import register_autograd

FORWARD = torch.ops.torch_bn_grad.batch_norm_masked_forward.default
BACKWARD = torch.ops.torch_bn_grad.batch_norm_masked_backward.default


def valid_positions(mask: Tensor) -> Tensor:
    """The mask (N, *X) broadcast against its input (N, C, *X)."""
    return mask.unsqueeze(1)


def per_channel(stats: Tensor, src: Tensor) -> Tensor:
    """A (C,) tensor viewed to broadcast against ``src`` (N, C, *X)."""
    return _channels.broadcastable(stats, src, "NCX")


# ---------------------------------------------------------------- the forward's gradient
def _forward_setup_context(ctx, inputs, output) -> None:
    src, mask, gamma, beta, mean, variance, epsilon = inputs
    _, used_mean, used_variance, count = output
    ctx.mark_non_differentiable(count)
    ctx.set_materialize_grads(False)  # unused statistics get None, not zeros to compute with
    ctx.save_for_backward(src, mask, gamma, used_mean, used_variance, count)
    ctx.training = mean is None
    ctx.epsilon = epsilon
    ctx.dtypes = [None if t is None else t.dtype for t in (gamma, beta, mean, variance)]


def _forward_backward(ctx, grad_dst, grad_mean, grad_variance, _grad_count):
    """Gradients with respect to (src, mask, gamma, beta, mean, variance, epsilon).

    Training: dst through the backward operator; the batch statistics' own
    gradients add, at the valid positions, grad_mean / count and
    grad_variance * 2 (x - mean) / count. Frozen statistics: the returned
    mean and variance are the given ones, and dst = g r (x - mean) + b gives
    d/dmean = -g r sum(dy), d/dvariance = -g r^3 / 2 sum(dy (x - mean))."""
    src, mask, gamma, mean, variance, count = ctx.saved_tensors
    needs = ctx.needs_input_grad
    gamma_dtype, beta_dtype, mean_dtype, variance_dtype = ctx.dtypes
    diff_src = diff_gamma = diff_beta = diff_mean = diff_variance = None
    frozen_stats = not ctx.training and (needs[4] or needs[5])
    if grad_dst is not None:
        wanted = [needs[0], needs[2] or frozen_stats, needs[3] or frozen_stats]
        # Half-precision parameters with float32 batch statistics: the backward takes them as the statistics' dtype.
        g_stats = gamma.to(mean.dtype) if gamma is not None and gamma.dtype != mean.dtype else gamma
        ds, dg, db = BACKWARD(src, mask, grad_dst, mean, variance, g_stats, ctx.epsilon, ctx.training, wanted)
        diff_src = ds if needs[0] else None
        diff_gamma = dg.to(gamma_dtype) if needs[2] else None
        diff_beta = db.to(beta_dtype) if needs[3] else None
        if frozen_stats:
            r = (variance.to(dg.dtype) + ctx.epsilon).rsqrt()
            g = gamma.to(dg.dtype) if gamma is not None else torch.ones_like(r)
            diff_mean, diff_variance = -g * r * db, -0.5 * g * r * r * dg
    if ctx.training and needs[0] and (grad_mean is not None or grad_variance is not None):
        dtype = _channels.accumulation_dtype(src)
        term = torch.zeros((), dtype=dtype, device=src.device)
        if grad_mean is not None:
            term = term + per_channel(grad_mean.to(dtype), src) / count
        if grad_variance is not None:
            xc = src.to(dtype) - per_channel(mean.to(dtype), src)
            term = term + per_channel(grad_variance.to(dtype), src) * (2 * xc / count)
        stats_grad = torch.where(valid_positions(mask), term, 0).to(src.dtype)
        diff_src = stats_grad if diff_src is None else diff_src + stats_grad
    if not ctx.training:  # the returned statistics are the given ones
        diff_mean = _add(diff_mean, grad_mean)
        diff_variance = _add(diff_variance, grad_variance)
    return (
        diff_src,
        None,
        diff_gamma,
        diff_beta,
        diff_mean.to(mean_dtype) if needs[4] and diff_mean is not None else None,
        diff_variance.to(variance_dtype) if needs[5] and diff_variance is not None else None,
        None,
    )


def _add(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    if a is None:
        return b
    return a if b is None else a + b


# ---------------------------------------------------------------- the backward's gradient
def _backward_setup_context(ctx, inputs, output) -> None:
    src, mask, diff_dst, mean, variance, gamma, epsilon, training, output_mask = inputs
    ctx.save_for_backward(src, mask, diff_dst, mean, variance, gamma)
    ctx.set_materialize_grads(False)
    ctx.epsilon = epsilon
    ctx.training = training
    ctx.output_mask = list(output_mask)


def _backward_backward(ctx, grad_diff_src, grad_diff_gamma, grad_diff_beta):
    src, mask, dy, mean, variance, gamma = ctx.saved_tensors
    grad_x, grad_dy, grad_mean, grad_variance, grad_gamma = backward_backward(
        src, dy, mean, variance, gamma, (grad_diff_src, grad_diff_gamma, grad_diff_beta), epsilon=ctx.epsilon,
        data_format="NCX", training=ctx.training, output_mask=ctx.output_mask, valid=valid_positions(mask),
    )
    return grad_x, None, grad_dy, grad_mean, grad_variance, grad_gamma, None, None, None


register_autograd(FORWARD, _forward_backward, _forward_setup_context)
register_autograd(BACKWARD, _backward_backward, _backward_setup_context)
