"""Autograd formula of the fused ``batch_norm_act_forward`` operator.

First-order gradients run the fused backward operator (two passes over the
data, ``dz = diff_dst * act'(z)`` computed inside them). What it saves:

* relu, leaky_relu: ``src`` and the output ``dst`` (``act'`` from the output's
  sign: ``dst > 0`` exactly when ``z > 0``), never a copy of ``z``;
* identity: ``src``; silu: ``src`` and ``residual`` (``z`` is recomputed);
* ``memory_saving=True`` (identity, leaky_relu with slope > 0): ``dst`` and
  ``residual`` only; the backward runs ``from_output`` (inplace_abn's idea).

Double backward (``create_graph=True``), and gradients reaching the returned
statistics or given (frozen) statistics that require grad, take a composite
route instead: ``dz`` in differentiable torch ops (the activation's derivative
below; autograd differentiates it again), then the plain batch-norm gradient
``batch_norm_forward_grad``, which is itself differentiable to any order.
That route needs ``src``, so it is not available with ``memory_saving=True``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from torch_bn_grad import _channels
from torch_bn_grad._autograd_kernel import register_autograd

# dz = dy * act'(z) as differentiable torch ops, given (dy, z-thunk, dst, slope):
# relu and leaky_relu read act' from dst (its derivative is 0, torch's convention),
# silu from z. Mirrors csrc/activation_math.h; a new activation adds its line here.
_DZ: dict[str, Callable[[Tensor, Callable[[], Tensor], Tensor, float], Tensor]] = {
    "identity": lambda dy, z, y, s: dy,
    "relu": lambda dy, z, y, s: dy * (y > 0),
    "leaky_relu": lambda dy, z, y, s: torch.where(y > 0, dy, dy * s),
    "silu": lambda dy, z, y, s: _silu_dz(dy, z()),
}


def _silu_dz(dy: Tensor, z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return (dy.to(z.dtype) * (s * (1 + z * (1 - s)))).to(dy.dtype)


def _setup_context(ctx, inputs, output) -> None:
    src, gamma, beta, mean, variance, residual, epsilon, activation, slope, data_format, memory_saving = inputs
    dst, mean_used, variance_used = output
    ctx.set_materialize_grads(False)
    ctx.training = mean is None
    ctx.epsilon, ctx.activation, ctx.slope = epsilon, activation, slope
    ctx.data_format, ctx.memory_saving = data_format, memory_saving
    ctx.has_residual = residual is not None
    keep_dst = memory_saving or activation in ("relu", "leaky_relu")
    keep_residual = memory_saving or activation == "silu"
    # Batch statistics are saved as returned, frozen ones as given, so that
    # double backward reaches whichever the data depends on.
    stats = (mean_used, variance_used) if ctx.training else (mean, variance)
    ctx.save_for_backward(
        None if memory_saving else src,
        dst if keep_dst else None,
        residual if keep_residual else None,
        *stats,
        gamma,
        beta,
    )


def _to(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _backward(ctx, grad_dst, grad_mean, grad_variance):
    src, dst, residual, mean, variance, gamma, beta = ctx.saved_tensors
    needs = ctx.needs_input_grad
    frozen_stats_grad = not ctx.training and (needs[3] or needs[4])
    if torch.is_grad_enabled() or frozen_stats_grad or grad_mean is not None or grad_variance is not None:
        return _composite_backward(ctx, grad_dst, grad_mean, grad_variance)
    nothing = (None,) * 11
    if grad_dst is None:
        return nothing
    mask = [needs[0], needs[1] and gamma is not None, needs[2] and beta is not None, needs[5] and ctx.has_residual]
    if not any(mask):
        return nothing
    # Half-precision parameters meet float32 statistics: the operator takes one dtype.
    diff_src, diff_gamma, diff_beta, diff_residual = torch.ops.torch_bn_grad.batch_norm_act_backward.default(
        grad_dst, src, dst, residual, mean, variance, _to(gamma, mean.dtype), _to(beta, mean.dtype),
        ctx.epsilon, ctx.activation, ctx.slope, ctx.data_format, ctx.training, ctx.memory_saving, mask,
    )
    return (
        diff_src if mask[0] else None,
        diff_gamma.to(gamma.dtype) if mask[1] else None,
        diff_beta.to(beta.dtype) if mask[2] else None,
        None,
        None,
        diff_residual if mask[3] else None,
        None, None, None, None, None,
    )


def _composite_backward(ctx, grad_dst, grad_mean, grad_variance):
    if ctx.memory_saving:
        raise NotImplementedError(
            "batch_norm_act: double backward (create_graph=True) and gradients of the statistics need src, "
            "which memory_saving=True does not keep; use memory_saving=False"
        )
    src, dst, residual, mean, variance, gamma, beta = ctx.saved_tensors
    needs = ctx.needs_input_grad

    def pre_activation() -> Tensor:
        acc = _channels.accumulation_dtype(src)
        bc = lambda t: _channels.broadcastable(t.to(acc), src, ctx.data_format)  # noqa: E731
        scale = (variance.to(acc) + ctx.epsilon).rsqrt()
        if gamma is not None:
            scale = scale * gamma.to(acc)
        z = (src.to(acc) - bc(mean)) * bc(scale)
        if beta is not None:
            z = z + bc(beta)
        return z + residual.to(acc) if residual is not None else z

    dz = None
    if grad_dst is not None:
        y = dst.detach() if dst is not None else None
        dz = _DZ[ctx.activation](grad_dst, pre_activation, y, ctx.slope)
    param = gamma if gamma is not None else beta
    diff_src, diff_gamma, diff_beta, diff_mean, diff_variance = torch.ops.torch_bn_grad.batch_norm_forward_grad(
        src, gamma, mean, variance, dz, grad_mean, grad_variance, ctx.epsilon, ctx.data_format, ctx.training,
        param.dtype if param is not None else None, [needs[0], needs[1], needs[2], needs[3], needs[4]],
    )
    diff_residual = dz if needs[5] and ctx.has_residual else None
    return diff_src, diff_gamma, diff_beta, diff_mean, diff_variance, diff_residual, None, None, None, None, None


register_autograd(torch.ops.torch_bn_grad.batch_norm_act_forward.default, _backward, _setup_context)


def _backward_op_setup_context(ctx, inputs, output) -> None:
    pass


def _backward_op_backward(ctx, *grads):
    raise NotImplementedError(
        "batch_norm_act_backward is not differentiable itself; differentiate batch_norm_act_forward (or "
        "functional.batch_norm_act) instead, whose autograd formula supports double backward"
    )


# The backward operator's Autograd kernel: gradients flowing into it raise
# instead of being dropped silently.
register_autograd(
    torch.ops.torch_bn_grad.batch_norm_act_backward.default, _backward_op_backward, _backward_op_setup_context
)
