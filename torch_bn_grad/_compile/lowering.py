"""Lowering of the operators for torch.compile's inductor backend.

Inductor cannot see into ``torch_bn_grad::batch_norm_forward`` and
``batch_norm_backward``: each stays an extern call between fused kernels, and
its data makes extra trips through memory. Under inductor (and only there:
eager mode, ``torch.export`` and other backends keep the operators) this
module's functions rewrite them into ATen operations — per-channel statistics and sums
and pointwise arithmetic in float32 (float64 for float64 data) — which
inductor fuses with the convolutions' epilogues, activations, residual
additions and the loss's reductions. The autograd formulas are untouched: the
rewrite happens below autograd, when AOTAutograd traces the forward and
backward graphs, so gradients of every order still follow ``torch_bn_grad.ops``.

On CPU the reductions stay this library's: the training forward takes its
statistics and the normalization's coefficients from
``batch_norm_stats_affine`` (an extern call; inductor's Welford reduction is
2x-4x slower) and inductor fuses only the elementwise pass, and a training
backward keeps the operator (``reduces_in_kernel``). On CUDA everything is
rewritten, as torch's BatchNorm is (``var_mean`` and sums).

Where a rewrite would not reproduce the operator (a layout that the rewritten
output would not keep, an unusual dtype), the operator stays as it is.
``torch_bn_grad.config.compile_lowering = False`` (or
``TORCH_BN_GRAD_COMPILE_LOWERING=0``) keeps the operators opaque everywhere.

The rewrites are registered by ``_compile/inductor.py``; the fused operators' are in
``_compile/inductor_act.py``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import Tensor

from torch_bn_grad import _compat, config
from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._compat import OpOverload

_warned = False


# ------------------------------------------------------------------ the rewrites
def dense_layout(src: Tensor) -> Optional[torch.memory_format]:
    """The memory format of ``empty_like(src)`` (what the operator returns) when
    ``src`` is dense in a standard order; None for other strides, which stay opaque."""
    if src.is_contiguous():
        return torch.contiguous_format
    if src.dim() == 4 and src.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if src.dim() == 5 and src.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return None


def reduction_form(src: Tensor, ref: Optional[Tensor], data_format: str) -> Optional[tuple[list[int], list[int]]]:
    """(reduced dims, statistics shape) for the operator's arguments, or None to keep it opaque."""
    if data_format not in ("NCX", "NXC") or src.dtype not in _channels.FLOAT_TYPES or dense_layout(src) is None:
        return None
    if ref is None:
        if src.dim() < 2:
            return None
        axis = _channels.channel_axis(src, data_format)
        return [d for d in range(src.dim()) if d != axis], [src.shape[axis]]
    if ref.dim() != 1 and not _channels.is_broadcast_form(src, ref):
        return None
    return _channels.reduced_dims(src, ref, data_format), list(ref.shape)


def _bc(stats: Tensor, src: Tensor, data_format: str, dtype: torch.dtype) -> Tensor:
    return _channels.broadcastable(stats.to(dtype), src, data_format)


def _forward(src, gamma, beta, mean, variance, epsilon, data_format):
    """batch_norm_forward as ATen operations, or NotImplemented to keep the operator."""
    op = torch.ops.torch_bn_grad.batch_norm_forward.default
    if not config.compile_lowering or (mean is None) != (variance is None):
        return opaque(op)
    ref = next((t for t in (mean, variance, gamma, beta) if t is not None), None)
    form = reduction_form(src, ref, data_format)
    if form is None:
        return opaque(op)
    dst, mean_out, var_out = normalized(src, gamma, beta, mean, variance, epsilon, data_format, form)
    return dst.to(src.dtype).contiguous(memory_format=dense_layout(src)), mean_out, var_out


def reduces_in_kernel(src: Tensor, training: bool) -> bool:
    """Whether a training backward stays this library's operator: on CPU its two
    reductions and elementwise pass beat inductor's (ResNet-50 train step 3-6%
    faster than with the rewrite), and it keeps eager mode's numerics. The operator
    takes any strides (tagged flexible_layout), so inductor passes its tensors as
    they are. A backward with frozen statistics is elementwise only: it is rewritten."""
    return training and src.device.type == "cpu"


def normalized(src, gamma, beta, mean, variance, epsilon, data_format, form):
    """batch_norm_forward's (dst, mean, variance), dst in the accumulation dtype (not yet
    rounded); batch statistics on CPU come from this library's kernel."""
    dims, shape = form
    acc = _channels.accumulation_dtype(src)
    x = src.to(acc)
    if mean is None and src.device.type == "cpu":
        return __normalized_by_kernel_stats(src, x, gamma, beta, epsilon, data_format, acc)
    if mean is None:
        # What torch's BatchNorm decomposes to; inductor makes it one Welford reduction.
        var_b, mean_b = torch.var_mean(x, dim=dims, correction=0, keepdim=True)
        mean_out, var_out = mean_b.reshape(shape), var_b.reshape(shape)
    else:
        mean_b, var_b = _bc(mean, src, data_format, acc), _bc(variance, src, data_format, acc)
        mean_out, var_out = mean.clone(), variance.clone()
    scale = torch.rsqrt(var_b + epsilon)
    if gamma is not None:
        scale = scale * _bc(gamma, src, data_format, acc)
    # Full-size operands first: the result takes their layout, as the operator's does.
    dst = (x - mean_b) * scale
    if beta is not None:
        dst = dst + _bc(beta, src, data_format, acc)
    return dst, mean_out, var_out


def __normalized_by_kernel_stats(src, x, gamma, beta, epsilon, data_format, acc):
    """The batch statistics and the normalization's coefficients from this library's
    kernels (an extern call), the elementwise pass as ATen arithmetic that inductor fuses."""
    op = torch.ops.torch_bn_grad.batch_norm_stats_affine.default
    opaque(op)
    mean, var, scale, bias = op(src, gamma, beta, epsilon, data_format)
    dst = (x - _bc(mean, src, data_format, acc)) * _bc(scale, src, data_format, acc) + _bc(bias, src, data_format, acc)
    return dst, mean, var


def _backward(src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask):
    """batch_norm_backward as ATen operations, or NotImplemented to keep the operator."""
    op = torch.ops.torch_bn_grad.batch_norm_backward.default
    if (not config.compile_lowering or reduces_in_kernel(src, training) or diff_dst.dtype != src.dtype
            or dense_layout(diff_dst) is None):
        return opaque(op)
    form = reduction_form(src, mean, data_format)
    if form is None:
        return opaque(op)
    return gradients(src, diff_dst.to(_channels.accumulation_dtype(src)), mean, variance, gamma, epsilon,
                     data_format, training, output_mask, form)


def gradients(src, dy, mean, variance, gamma, epsilon, data_format, training, output_mask, form):
    """batch_norm_backward's outputs from diff_dst `dy` given in the accumulation dtype."""
    dims, shape = form
    acc = _channels.accumulation_dtype(src)
    x = src.to(acc)
    mean_b = _bc(mean, src, data_format, acc)
    rstd = torch.rsqrt(_bc(variance, src, data_format, acc) + epsilon)
    xc = x - mean_b
    need_sums = output_mask[1] or output_mask[2] or (output_mask[0] and training)
    sum_dy = sum_dy_xc = None
    if need_sums:
        sum_dy = dy.sum(dim=dims, keepdim=True) if dims else dy
        sum_dy_xc = (dy * xc).sum(dim=dims, keepdim=True) if dims else dy * xc
    if output_mask[0]:
        scale = rstd if gamma is None else rstd * _bc(gamma, src, data_format, acc)
        if training:
            count = 1
            for d in dims:
                count = count * src.shape[d]
            norm = 1.0 / torch.sym_max(count, 1)
            diff_src = (dy - sum_dy * norm - xc * (rstd * rstd * sum_dy_xc * norm)) * scale
        else:
            diff_src = dy * scale
        diff_src = diff_src.to(src.dtype).contiguous(memory_format=dense_layout(src))
    else:
        diff_src = src.new_empty(0)
    diff_gamma = (sum_dy_xc * rstd).reshape(shape).to(mean.dtype) if output_mask[1] else mean.new_empty(0)
    diff_beta = sum_dy.reshape(shape).to(mean.dtype) if output_mask[2] else mean.new_empty(0)
    return diff_src, diff_gamma, diff_beta



# ------------------------------------------------------------------ keeping an operator
def warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"torch_bn_grad: {reason}; under torch.compile the BatchNorm operators stay opaque "
            "(correct, but inductor cannot fuse them with their neighbours)",
            RuntimeWarning,
            stacklevel=3,
        )


# The full-size tensor arguments of each operator that the kernels want in one
# layout (they copy the others into the first's). Under inductor, those it has
# not laid out yet (a fused kernel's output: the gradient coming back through a
# max-pool or an activation) are laid out like the first fixed one, where inductor
# would otherwise pick contiguous next to a channels_last convolution output.
_SAME_LAYOUT = {
    "batch_norm_backward": ("src", "diff_dst"),
    "batch_norm_act_forward": ("src", "residual"),
    "batch_norm_act_backward": ("src", "dst", "diff_dst", "residual"),
}


def opaque(op: OpOverload) -> Any:
    """Keep ``op`` as it is: inductor calls it as an extern kernel, as it would
    without the rewrite (which, being in its decomposition table, it would refuse)."""
    try:
        fallback = _compat.inductor_fallback()
        if fallback is not None:
            fallback(op, _SAME_LAYOUT.get(op._schema.name.split("::")[-1], ()))
    except _compat.PrivateAPIMissing as missing:
        warn_once(str(missing))
    return NotImplemented


def rewrites() -> dict[Any, Any]:
    """The plain operators' rewrites, by operator (for inductor's decomposition table)."""
    return {
        torch.ops.torch_bn_grad.batch_norm_forward.default: _forward,
        torch.ops.torch_bn_grad.batch_norm_backward.default: _backward,
    }
