"""Autograd formula of ``batch_norm_backward`` (so that gradients of any order
flow). The forward operator's formula is C++ (``csrc/batch_norm_autograd.cpp``)."""

from __future__ import annotations

import torch
from torch import Tensor

from torch_bn_grad import _channels
from torch_bn_grad._autograd_kernel import register_autograd


class _PerChannel:
    """Per-channel algebra on ``src`` in the accumulation dtype, for the autograd formulas."""

    def __init__(self, src: Tensor, stats: Tensor, data_format: str) -> None:
        self.src = src
        self.data_format = data_format
        self.dtype = _channels.accumulation_dtype(src)
        self.shape = list(stats.shape)
        self.dims = _channels.reduced_dims(src, stats, data_format)
        self.count = max(_channels.reduced_count(src, self.dims), 1)

    def data(self, t: Tensor) -> Tensor:
        return t.to(self.dtype)

    def bc(self, stats: Tensor) -> Tensor:
        """Per-channel values broadcast against src."""
        return _channels.broadcastable(stats, self.src, self.data_format)

    def sum(self, t: Tensor) -> Tensor:
        """Per-channel sum over the reduced dims."""
        return _channels.reduce_to_stats(t, self.dims, self.shape)


def _backward_setup_context(ctx, inputs, output) -> None:
    src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask = inputs
    ctx.save_for_backward(src, diff_dst, mean, variance, gamma)
    ctx.epsilon = epsilon
    ctx.data_format = data_format
    ctx.training = training
    ctx.output_mask = list(output_mask)


def _backward_backward(ctx, grad_diff_src, grad_diff_gamma, grad_diff_beta):
    """Gradients of (diff_src, diff_gamma, diff_beta) with respect to every input.

    Per channel, with r = rstd, xc = x - mean and sums over the reduced
    positions (M of them), sb = sum(dy), sgc = sum(dy * xc), and upstream
    gradients Gx, Gg, Gb:
      diff_src   = g r dy - (g r / M) sb - (g r^3 / M) xc sgc   (training)
                 = g r dy                                        (frozen)
      diff_gamma = r sgc,  diff_beta = sb.
    The expressions below are the partial derivatives of the loss
    sum(Gx * diff_src) + Gg * diff_gamma + Gb * diff_beta.
    """
    src, dy, mean, variance, gamma = ctx.saved_tensors
    mask = ctx.output_mask
    pc = _PerChannel(src, mean, ctx.data_format)
    x, d = pc.data(src), pc.data(dy)
    r = (pc.data(variance) + ctx.epsilon).rsqrt()
    g = pc.data(gamma) if gamma is not None else torch.ones_like(r)
    zero = torch.zeros_like(r)
    gg = pc.data(grad_diff_gamma) if mask[1] and grad_diff_gamma is not None else zero
    gb = pc.data(grad_diff_beta) if mask[2] and grad_diff_beta is not None else zero
    gx = pc.data(grad_diff_src) if mask[0] and grad_diff_src is not None else None

    xc = x - pc.bc(pc.data(mean))
    sb = pc.sum(d)
    sgc = pc.sum(d * xc)
    if gx is not None:
        s_gx, s_gx_xc, s_gx_dy = pc.sum(gx), pc.sum(gx * xc), pc.sum(gx * d)
    else:
        s_gx = s_gx_xc = s_gx_dy = zero
    m = pc.count
    if ctx.training:
        a, b, dd = g * r, g * r / m, g * r**3 / m
        coef_xc = gg * r - dd * s_gx_xc
        grad_dy = pc.bc(coef_xc) * xc + pc.bc(gb - b * s_gx)
        grad_x = pc.bc(coef_xc) * d
        if gx is not None:
            grad_dy = grad_dy + pc.bc(a) * gx
            grad_x = grad_x - pc.bc(dd * sgc) * gx
        grad_mean = dd * sgc * s_gx - coef_xc * sb
        grad_g = r * s_gx_dy - (r / m) * sb * s_gx - (r**3 / m) * sgc * s_gx_xc
        grad_r = g * s_gx_dy - (g / m) * sb * s_gx - (3 * g * r * r / m) * sgc * s_gx_xc + gg * sgc
    else:
        grad_dy = pc.bc(gg * r) * xc + pc.bc(gb)
        if gx is not None:
            grad_dy = grad_dy + pc.bc(g * r) * gx
        grad_x = pc.bc(gg * r) * d
        grad_mean = -gg * r * sb
        grad_g = r * s_gx_dy
        grad_r = g * s_gx_dy + gg * sgc
    grad_variance = -0.5 * r**3 * grad_r
    return (
        grad_x.to(src.dtype),
        grad_dy.to(dy.dtype),
        grad_mean.to(mean.dtype),
        grad_variance.to(variance.dtype),
        grad_g.to(gamma.dtype) if gamma is not None else None,
        None,
        None,
        None,
        None,
    )


register_autograd(torch.ops.torch_bn_grad.batch_norm_backward.default, _backward_backward, _backward_setup_context)
