"""Inductor rewrites of the fused ``batch_norm_act_forward``/``_backward``
operators (``_compile/lowering.py`` has the plain operators'; ``_compile/inductor.py`` registers both): batch norm as there,
then the residual and the activation as ATen operations, all in the
accumulation dtype and rounded once, so inductor fuses them with their
neighbours. The memory-saving backward (``from_output``) and anything the
plain rewrites keep opaque stay opaque."""

from __future__ import annotations

from typing import Any

import torch

from torch_bn_grad import config
from torch_bn_grad._rules import activation as _activation
from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._compile import lowering as _lowering


def _act_forward(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, data_format,
                 memory_saving):
    op = torch.ops.torch_bn_grad.batch_norm_act_forward.default
    if not config.compile_lowering or (mean is None) != (variance is None):
        return _lowering.opaque(op)
    ref = next((t for t in (mean, variance, gamma, beta) if t is not None), None)
    form = _lowering.reduction_form(src, ref, data_format)
    if form is None or (residual is not None and residual.dtype != src.dtype):
        return _lowering.opaque(op)
    z, mean_out, var_out = _lowering.normalized(src, gamma, beta, mean, variance, epsilon, data_format, form)
    if residual is not None:
        z = z + residual.to(z.dtype)
    dst = _activation.activate(z, activation, negative_slope)
    return dst.to(src.dtype).contiguous(memory_format=_lowering.dense_layout(src)), mean_out, var_out


def _act_backward(diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon, activation, negative_slope,
                  data_format, training, from_output, output_mask, dst_positive=None):
    op = torch.ops.torch_bn_grad.batch_norm_act_backward.default
    if (not config.compile_lowering or from_output or src is None or diff_dst.dtype != src.dtype
            or dst_positive is not None):
        return _lowering.opaque(op)
    form = _lowering.reduction_form(src, mean, data_format)
    if form is None or _lowering.dense_layout(diff_dst) is None:
        return _lowering.opaque(op)
    if _lowering.reduces_in_kernel(src, training):
        if not _gate_is_exact(activation, src, dst):
            return _lowering.opaque(op)
        return _gate_then_kernel(diff_dst, src, dst, mean, variance, gamma, epsilon, activation, negative_slope,
                                 data_format, output_mask)
    acc = _channels.accumulation_dtype(src)
    dy = diff_dst.to(acc)
    if activation == "silu":
        z, _, _ = _lowering.normalized(src, gamma, beta, mean, variance, epsilon, data_format, form)
        if residual is not None:
            z = z + residual.to(acc)
        s = torch.sigmoid(z)
        dz = dy * (s * (1 + z * (1 - s)))
    else:
        dz = _activation.gate_from_output(dy, dst, activation, negative_slope)
    param = gamma.to(mean.dtype) if gamma is not None else None
    diff_src, diff_gamma, diff_beta = _lowering.gradients(
        src, dz, mean, variance, param, epsilon, data_format, training, list(output_mask[:3]), form)
    layout = _lowering.dense_layout(src)
    diff_residual = dz.to(src.dtype).contiguous(memory_format=layout) if output_mask[3] else src.new_empty(0)
    return diff_src, diff_gamma, diff_beta, diff_residual


def _gate_is_exact(activation: str, src, dst) -> bool:
    """Whether dz = diff_dst * act'(z) in src's dtype is what the fused kernel computes:
    a selection (relu, identity) or a product in float32/float64 (leaky_relu)."""
    if activation == "identity":
        return True
    if activation == "relu":
        return dst is not None
    return activation == "leaky_relu" and dst is not None and src.dtype not in _channels.HALF_TYPES


def _gate_then_kernel(diff_dst, src, dst, mean, variance, gamma, epsilon, activation, negative_slope, data_format,
                      output_mask):
    """A CPU training backward: the activation's gate as ATen arithmetic, which inductor
    fuses into diff_dst's producer (a max-pool's or a convolution's backward, the next
    block's residual sum) and reads dst in whatever layout inductor gave it, then this
    library's batch_norm_backward on dz (its reductions, eager mode's numbers). The opaque
    fused operator read dst and diff_dst whole and copied whichever inductor had laid out
    unlike src (a contiguous model's saved activations next to its channels_last
    convolution outputs)."""
    dz = _activation.gate_from_output(diff_dst, dst, activation, negative_slope)
    if dz is diff_dst:  # identity: an output must not alias an input
        dz = dz.clone()
    dz = dz.contiguous(memory_format=_lowering.dense_layout(src))
    if any(output_mask[:3]):
        diff_src, diff_gamma, diff_beta = torch.ops.torch_bn_grad.batch_norm_backward.default(
            src, dz, mean, variance, None if gamma is None else gamma.to(mean.dtype), epsilon, data_format, True,
            list(output_mask[:3]))
    else:
        diff_src, diff_gamma, diff_beta = src.new_empty(0), mean.new_empty(0), mean.new_empty(0)
    return diff_src, diff_gamma, diff_beta, dz if output_mask[3] else src.new_empty(0)


def rewrites() -> dict[Any, Any]:
    return {
        torch.ops.torch_bn_grad.batch_norm_act_forward.default: _act_forward,
        torch.ops.torch_bn_grad.batch_norm_act_backward.default: _act_backward,
    }
