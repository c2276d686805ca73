"""The operators: thin Python wrappers over ``torch.ops.torch_bn_grad``, with
their fake (meta) implementations and autograd formulas.

The backward operator is itself differentiable (its autograd formula below is
written with differentiable torch operations), so gradients of any order flow
through the forward and backward operators.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from torch_bn_grad import _channels
from torch_bn_grad._autograd_kernel import register_autograd

__all__ = ["batch_norm_forward", "batch_norm_backward"]

_HALF_TYPES = (torch.float16, torch.bfloat16)


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
    _check_data_format(op, data_format)
    return torch.ops.torch_bn_grad.batch_norm_forward.default(
        src, gamma, beta, mean, variance, _epsilon(op, epsilon), data_format
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
    _check_data_format(op, data_format)
    mask = _check_output_mask(op, output_mask)
    outputs = torch.ops.torch_bn_grad.batch_norm_backward.default(
        src, diff_dst, mean, variance, gamma, _epsilon(op, epsilon), data_format, bool(training), mask
    )
    return tuple(out if wanted else None for out, wanted in zip(outputs, mask))  # type: ignore[return-value]


# The operators check their arguments themselves (csrc/batch_norm_args.cpp);
# these catch what cannot reach them: arguments of the wrong Python type.
def _check_data_format(op: str, data_format: object) -> None:
    if not isinstance(data_format, str):
        raise ValueError(f"{op}: data_format must be 'NCX' or 'NXC', got {data_format!r}")


def _epsilon(op: str, epsilon: object) -> float:
    try:
        return float(epsilon)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{op}: epsilon must be a real number, got {epsilon!r}") from None


def _check_output_mask(op: str, output_mask: Sequence[bool]) -> list[bool]:
    mask = list(output_mask)
    if len(mask) != 3:
        raise ValueError(
            f"{op}: output_mask must have 3 entries (diff_src, diff_gamma, diff_beta), got {len(mask)}"
        )
    return [bool(m) for m in mask]


# ------------------------------------------------------------------ fake implementations
def _check_same_device(op: str, src: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None:
            torch._check_value(
                t.device == src.device,
                lambda: f"{op}: {name} must be on src's device ({src.device}), got {t.device}",
            )


def _given(t: Optional[Tensor]) -> str:
    return "None" if t is None else "tensor"


def _computed_stats_dtype(src: Tensor) -> torch.dtype:
    return torch.float32 if src.dtype in _HALF_TYPES else src.dtype


@torch.library.register_fake("torch_bn_grad::batch_norm_forward")
def _batch_norm_forward_fake(src, gamma, beta, mean, variance, epsilon, data_format):
    _check_same_device("batch_norm_forward", src, gamma=gamma, beta=beta, mean=mean, variance=variance)
    torch._check_value(
        (mean is None) == (variance is None),
        lambda: "batch_norm_forward: mean and variance must be given together (frozen statistics) or both "
        f"omitted (batch statistics), got mean={_given(mean)} and variance={_given(variance)}",
    )
    ref = next((t for t in (mean, variance, gamma, beta) if t is not None), None)
    shape = _channels.stats_shape(src, ref, data_format)
    dtype = mean.dtype if mean is not None else _computed_stats_dtype(src)
    return torch.empty_like(src), src.new_empty(shape, dtype=dtype), src.new_empty(shape, dtype=dtype)


@torch.library.register_fake("torch_bn_grad::batch_norm_backward")
def _batch_norm_backward_fake(src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask):
    _check_same_device("batch_norm_backward", src, diff_dst=diff_dst, mean=mean, variance=variance, gamma=gamma)
    torch._check_value(
        diff_dst.shape == src.shape,
        lambda: f"batch_norm_backward: diff_dst must have src's shape {list(src.shape)}, got {list(diff_dst.shape)}",
    )
    diff_src = torch.empty_like(src) if output_mask[0] else src.new_empty(0)
    diff_gamma = mean.new_empty(mean.shape) if output_mask[1] else mean.new_empty(0)
    diff_beta = mean.new_empty(mean.shape) if output_mask[2] else mean.new_empty(0)
    return diff_src, diff_gamma, diff_beta


# ------------------------------------------------------------------ autograd
class _PerChannel:
    """Per-channel algebra on ``src`` in the accumulation dtype, for the autograd formulas."""

    def __init__(self, src: Tensor, stats: Tensor, data_format: str) -> None:
        self.src = src
        self.data_format = data_format
        self.dtype = torch.float32 if src.dtype in _HALF_TYPES else src.dtype
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


def _zeros_if_none(t: Optional[Tensor], like: Tensor) -> Tensor:
    return torch.zeros_like(like) if t is None else t


def _forward_setup_context(ctx, inputs, output) -> None:
    src, gamma, beta, mean, variance, epsilon, data_format = inputs
    _, mean_used, variance_used = output
    # Unused statistics outputs then get None, not full-size zero work.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(src, gamma, mean_used, variance_used)
    ctx.batch_statistics = mean is None
    ctx.param_dtype = next((t.dtype for t in (gamma, beta) if t is not None), None)
    ctx.epsilon = epsilon
    ctx.data_format = data_format


def _forward_backward(ctx, grad_dst, grad_mean, grad_variance):
    src, gamma, mean, variance = ctx.saved_tensors
    need_src, need_gamma, need_beta, need_mean, need_variance = ctx.needs_input_grad[:5]
    frozen = not ctx.batch_statistics
    grad_dst = _zeros_if_none(grad_dst, src)
    mask = (need_src, need_gamma or (frozen and need_variance), need_beta or (frozen and need_mean))
    diff_src, diff_gamma, diff_beta = batch_norm_backward(
        src, grad_dst, mean, variance, _in_stats_dtype(gamma, mean), epsilon=ctx.epsilon,
        data_format=ctx.data_format, training=ctx.batch_statistics, output_mask=mask,
    )
    diff_gamma, diff_beta = (_to_dtype(t, ctx.param_dtype) for t in (diff_gamma, diff_beta))
    grad_mean_in = grad_variance_in = None
    if ctx.batch_statistics:
        pc = _PerChannel(src, mean, ctx.data_format)
        # mean and variance outputs are functions of src too.
        if need_src and (grad_mean is not None or grad_variance is not None):
            extra = torch.zeros((), dtype=pc.dtype, device=src.device)
            if grad_mean is not None:
                extra = extra + pc.bc(pc.data(grad_mean)) / pc.count
            if grad_variance is not None:
                xc = pc.data(src) - pc.bc(pc.data(mean))
                extra = extra + pc.bc(pc.data(grad_variance)) * xc * (2.0 / pc.count)
            diff_src = diff_src + extra.to(src.dtype)
    else:
        grad_mean_in, grad_variance_in = _frozen_statistics_grads(
            src, mean, variance, gamma, diff_gamma, diff_beta, ctx.epsilon, ctx.data_format,
            need_mean, need_variance, grad_mean, grad_variance,
        )
    return (
        diff_src,
        diff_gamma if need_gamma else None,
        diff_beta if need_beta else None,
        grad_mean_in,
        grad_variance_in,
        None,
        None,
    )


def _in_stats_dtype(gamma: Optional[Tensor], stats: Tensor) -> Optional[Tensor]:
    """gamma in the statistics' dtype: half-precision parameters (a model cast
    with ``.to(torch.bfloat16)``) meet float32 batch statistics in training."""
    return gamma.to(stats.dtype) if gamma is not None and gamma.dtype != stats.dtype else gamma


def _to_dtype(t: Optional[Tensor], dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    """A parameter gradient back in its parameter's dtype."""
    return t.to(dtype) if t is not None and dtype is not None else t


def _frozen_statistics_grads(
    src: Tensor,
    mean: Tensor,
    variance: Tensor,
    gamma: Optional[Tensor],
    diff_gamma: Optional[Tensor],
    diff_beta: Optional[Tensor],
    epsilon: float,
    data_format: str,
    need_mean: bool,
    need_variance: bool,
    grad_mean_out: Optional[Tensor] = None,
    grad_variance_out: Optional[Tensor] = None,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients for frozen mean and variance, from the backward's per-channel sums.

    dst = (x - mean) * g * r + beta with r = (variance + eps)^-1/2 gives
    d/dmean = -g r sum(dy) and d/dvariance = -g r^3 / 2 * sum(dy * (x - mean))
    = -g r^2 / 2 * diff_gamma. ``grad_*_out`` are gradients reaching the
    forward operator's returned statistics, which are the inputs themselves.
    """
    pc = _PerChannel(src, mean, data_format)
    rstd = (pc.data(variance) + epsilon).rsqrt()
    g = pc.data(gamma) if gamma is not None else torch.ones_like(rstd)
    grad_mean = grad_variance = None
    if need_mean:
        grad_mean = -(g * rstd) * pc.data(diff_beta)
        if grad_mean_out is not None:
            grad_mean = grad_mean + pc.data(grad_mean_out)
        grad_mean = grad_mean.to(mean.dtype)
    if need_variance:
        grad_variance = -0.5 * g * rstd * rstd * pc.data(diff_gamma)
        if grad_variance_out is not None:
            grad_variance = grad_variance + pc.data(grad_variance_out)
        grad_variance = grad_variance.to(variance.dtype)
    return grad_mean, grad_variance


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


register_autograd(torch.ops.torch_bn_grad.batch_norm_forward.default, _forward_backward, _forward_setup_context)
register_autograd(torch.ops.torch_bn_grad.batch_norm_backward.default, _backward_backward, _backward_setup_context)
