"""Autograd formula of ``batch_norm_backward`` (so that gradients of any order
flow). The forward operator's formula is C++ (``csrc/autograd/batch_norm_autograd.cpp``)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._library.autograd_kernel import register_autograd


class _PerChannel:
    """Per-channel algebra on ``src`` in the accumulation dtype, for the autograd formulas.

    ``valid`` (masked batch norm): a bool tensor broadcastable against ``src``,
    True at the positions the sums run over; ``count`` is then their number
    per channel, a tensor (at least 1)."""

    def __init__(self, src: Tensor, stats: Tensor, data_format: str, valid: Optional[Tensor] = None) -> None:
        self.src = src
        self.data_format = data_format
        self.dtype = _channels.accumulation_dtype(src)
        self.shape = list(stats.shape)
        self.dims = _channels.reduced_dims(src, stats, data_format)
        self.valid = valid
        if valid is None:
            self.count: Union[int, Tensor] = max(_channels.reduced_count(src, self.dims), 1)
        else:
            self.count = valid.sum(dtype=torch.float64).clamp_min(1)

    def data(self, t: Tensor) -> Tensor:
        return t.to(self.dtype)

    def select(self, t: Tensor) -> Tensor:
        """``t`` (src-shaped) at the valid positions, 0 elsewhere (whatever ``t`` holds there)."""
        return t if self.valid is None else torch.where(self.valid, t, 0)

    def bc(self, stats: Tensor) -> Tensor:
        """Per-channel values broadcast against src."""
        return _channels.broadcastable(stats, self.src, self.data_format)

    def sum(self, t: Tensor) -> Tensor:
        """Per-channel sum over the reduced dims."""
        return _channels.reduce_to_stats(t, self.dims, self.shape)


def _backward_setup_context(ctx, inputs, output) -> None:
    src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask = inputs
    ctx.save_for_backward(src, diff_dst, mean, variance, gamma)
    ctx.save_for_forward(src, diff_dst, mean, variance, gamma)
    ctx.output_dtypes = [t.dtype for t in output]
    ctx.epsilon = epsilon
    ctx.data_format = data_format
    ctx.training = training
    ctx.output_mask = list(output_mask)


def _backward_backward(ctx, grad_diff_src, grad_diff_gamma, grad_diff_beta):
    src, dy, mean, variance, gamma = ctx.saved_tensors
    return backward_backward(
        src, dy, mean, variance, gamma, (grad_diff_src, grad_diff_gamma, grad_diff_beta), epsilon=ctx.epsilon,
        data_format=ctx.data_format, training=ctx.training, output_mask=ctx.output_mask,
    ) + (None, None, None, None)


def backward_backward(
    src: Tensor,
    dy: Tensor,
    mean: Tensor,
    variance: Tensor,
    gamma: Optional[Tensor],
    grads: tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]],
    *,
    epsilon: float,
    data_format: str,
    training: bool,
    output_mask: Sequence[bool],
    valid: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Gradients of (diff_src, diff_gamma, diff_beta) with respect to (src, dy, mean, variance, gamma).

    ``valid`` (masked batch norm, see _PerChannel): the sums run over the
    valid positions only, and the gradients are 0 at the others.

    Per channel, with r = rstd, xc = x - mean and sums over the reduced
    positions (M of them), sb = sum(dy), sgc = sum(dy * xc), and upstream
    gradients Gx, Gg, Gb:
      diff_src   = g r dy - (g r / M) sb - (g r^3 / M) xc sgc   (training)
                 = g r dy                                        (frozen)
      diff_gamma = r sgc,  diff_beta = sb.
    The expressions below are the partial derivatives of the loss
    sum(Gx * diff_src) + Gg * diff_gamma + Gb * diff_beta.
    """
    grad_diff_src, grad_diff_gamma, grad_diff_beta = grads
    mask = output_mask
    pc = _PerChannel(src, mean, data_format, valid)
    x, d = pc.data(src), pc.select(pc.data(dy))
    r = (pc.data(variance) + epsilon).rsqrt()
    g = pc.data(gamma) if gamma is not None else torch.ones_like(r)
    zero = torch.zeros_like(r)
    gg = pc.data(grad_diff_gamma) if mask[1] and grad_diff_gamma is not None else zero
    gb = pc.data(grad_diff_beta) if mask[2] and grad_diff_beta is not None else zero
    gx = pc.select(pc.data(grad_diff_src)) if mask[0] and grad_diff_src is not None else None

    xc = pc.select(x - pc.bc(pc.data(mean)))
    sb = pc.sum(d)
    sgc = pc.sum(d * xc)
    if gx is not None:
        s_gx, s_gx_xc, s_gx_dy = pc.sum(gx), pc.sum(gx * xc), pc.sum(gx * d)
    else:
        s_gx = s_gx_xc = s_gx_dy = zero
    m = pc.count
    if training:
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
        pc.select(grad_dy).to(dy.dtype),
        grad_mean.to(mean.dtype),
        grad_variance.to(variance.dtype),
        grad_g.to(gamma.dtype) if gamma is not None else None,
    )


def _backward_jvp(ctx, t_src, t_dy, t_mean, t_variance, t_gamma, *_):
    """Tangents of (diff_src, diff_gamma, diff_beta) given the inputs' (None: zero).

    With the notation of _backward_backward, a = g r and c = g r^3 / M, the
    product rule on diff_src = a dy - (a / M) sb - c xc sgc (training; a dy
    frozen), diff_gamma = r sgc and diff_beta = sb, where
    t_r = -r^3 t_variance / 2, t_xc = t_x - t_mean, t_sb = sum(t_dy) and
    t_sgc = sum(t_dy xc + dy t_xc). Forward over reverse (hessian) runs it.
    """
    src, dy, mean, variance, gamma = ctx.saved_tensors
    pc = _PerChannel(src, mean, ctx.data_format)
    x, d = pc.data(src), pc.data(dy)
    zero = lambda like: torch.zeros_like(pc.data(like))  # noqa: E731
    tx = pc.data(t_src) if t_src is not None else zero(src)
    td = pc.data(t_dy) if t_dy is not None else zero(dy)
    tm = pc.data(t_mean) if t_mean is not None else zero(mean)
    tv = pc.data(t_variance) if t_variance is not None else zero(variance)
    r = (pc.data(variance) + ctx.epsilon).rsqrt()
    g = pc.data(gamma) if gamma is not None else torch.ones_like(r)
    tg = pc.data(t_gamma) if t_gamma is not None and gamma is not None else torch.zeros_like(r)

    xc = x - pc.bc(pc.data(mean))
    txc = tx - pc.bc(tm)
    sb, sgc = pc.sum(d), pc.sum(d * xc)
    t_sb, t_sgc = pc.sum(td), pc.sum(td * xc + d * txc)
    tr = -0.5 * r**3 * tv
    a, ta = g * r, tg * r + g * tr
    t_diff_src = pc.bc(ta) * d + pc.bc(a) * td
    if ctx.training:
        m = pc.count
        c, tc = g * r**3 / m, (tg * r**3 + 3 * g * r**2 * tr) / m
        t_diff_src = (t_diff_src - pc.bc((ta * sb + a * t_sb) / m) - pc.bc(tc * sgc) * xc
                      - pc.bc(c) * (txc * pc.bc(sgc) + xc * pc.bc(t_sgc)))
    t_diff_gamma = tr * sgc + r * t_sgc
    # A skipped output is an empty placeholder, and so is its tangent (None
    # would trip autograd.Function's forward-mode bookkeeping).
    return tuple(
        t.to(dtype) if wanted else t.new_zeros(0, dtype=dtype)
        for t, dtype, wanted in zip((t_diff_src, t_diff_gamma, t_sb), ctx.output_dtypes, ctx.output_mask)
    )


register_autograd(
    torch.ops.torch_bn_grad.batch_norm_backward.default, _backward_backward, _backward_setup_context, _backward_jvp
)
