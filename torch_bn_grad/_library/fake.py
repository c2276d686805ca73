"""Fake (meta) implementations of every operator, for torch.compile, export and
FakeTensor tracing: output shapes, dtypes and devices, and the checks a
compiled program must keep (the C++ operators make the full ones)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._rules.checks import check_mask, check_same_device


def _given(t: Optional[Tensor]) -> str:
    return "None" if t is None else "tensor"


@torch.library.register_fake("torch_bn_grad::batch_norm_forward")
def _batch_norm_forward_fake(src, gamma, beta, mean, variance, epsilon, data_format):
    check_same_device("batch_norm_forward", src, gamma=gamma, beta=beta, mean=mean, variance=variance)
    torch._check_value(
        (mean is None) == (variance is None),
        lambda: "batch_norm_forward: mean and variance must be given together (frozen statistics) or both "
        f"omitted (batch statistics), got mean={_given(mean)} and variance={_given(variance)}",
    )
    ref = next((t for t in (mean, variance, gamma, beta) if t is not None), None)
    shape = _channels.stats_shape(src, ref, data_format)
    dtype = mean.dtype if mean is not None else _channels.accumulation_dtype(src)
    return torch.empty_like(src), src.new_empty(shape, dtype=dtype), src.new_empty(shape, dtype=dtype)


def _then_update(op, src, running_mean, running_var, momentum, forward):
    """An .update overload's fake: its buffers' checks, then the training forward's
    fake (``forward()``, its mean and variance at 1 and 2) and the update's."""
    check_same_device(op, src, running_mean=running_mean, running_var=running_var)
    outputs = forward()
    _batch_norm_update_running_stats_fake(running_mean, running_var, outputs[1], outputs[2], 0, momentum)
    return outputs


@torch.library.register_fake("torch_bn_grad::batch_norm_forward.update")
def _batch_norm_forward_update_fake(src, gamma, beta, running_mean, running_var, momentum, epsilon, data_format):
    return _then_update("batch_norm_forward.update", src, running_mean, running_var, momentum,
                        lambda: _batch_norm_forward_fake(src, gamma, beta, None, None, epsilon, data_format))


@torch.library.register_fake("torch_bn_grad::batch_norm_forward.frozen")
def _batch_norm_forward_frozen_fake(src, gamma, beta, mean, variance, epsilon, data_format):
    return _batch_norm_forward_fake(src, gamma, beta, mean, variance, epsilon, data_format)[0]


@torch.library.register_fake("torch_bn_grad::batch_norm_stats_affine")
def _batch_norm_stats_affine_fake(src, gamma, beta, epsilon, data_format):
    check_same_device("batch_norm_stats_affine", src, gamma=gamma, beta=beta)
    ref = gamma if gamma is not None else beta
    shape = _channels.stats_shape(src, ref, data_format)
    dtype = _channels.accumulation_dtype(src)
    return tuple(src.new_empty(shape, dtype=dtype) for _ in range(4))


@torch.library.register_fake("torch_bn_grad::batch_norm_backward")
def _batch_norm_backward_fake(src, diff_dst, mean, variance, gamma, epsilon, data_format, training, output_mask):
    check_same_device("batch_norm_backward", src, diff_dst=diff_dst, mean=mean, variance=variance, gamma=gamma)
    return _backward_outputs("batch_norm_backward", src, diff_dst, mean, output_mask, gamma)


def _backward_outputs(op: str, src: Tensor, diff_dst: Tensor, mean: Tensor, output_mask,
                      *params: Optional[Tensor]) -> tuple[Tensor, ...]:
    """``(diff_src, diff_gamma, diff_beta)`` of a backward operator, each empty where
    ``output_mask`` skips it, once ``diff_dst`` is checked against ``src``'s shape.
    The parameter gradients have the first given of ``params``' (gamma, beta)
    dtype, else ``mean``'s (``param_grad_dtype``, csrc/args/batch_norm_args.h)."""
    torch._check_value(
        diff_dst.shape == src.shape,
        lambda: f"{op}: diff_dst must have src's shape {list(src.shape)}, got {list(diff_dst.shape)}",
    )
    dtype = next((t.dtype for t in params if t is not None), mean.dtype)
    return (
        torch.empty_like(src) if output_mask[0] else src.new_empty(0),
        mean.new_empty(mean.shape, dtype=dtype) if output_mask[1] else mean.new_empty(0, dtype=dtype),
        mean.new_empty(mean.shape, dtype=dtype) if output_mask[2] else mean.new_empty(0, dtype=dtype),
    )


@torch.library.register_fake("torch_bn_grad::batch_norm_update_running_stats")
@torch.library.register_fake("torch_bn_grad::batch_norm_update_running_stats.counted")
def _batch_norm_update_running_stats_fake(running_mean, running_var, mean, variance, count, momentum):
    if isinstance(count, Tensor):
        torch._check_value(count.dim() == 0, lambda: "batch_norm_update_running_stats: count must be a 0-dim "
                           f"tensor, got shape {tuple(count.shape)}")
    for name, running, batch in (("running_mean", running_mean, mean), ("running_var", running_var, variance)):
        torch._check_value(
            running is None or running.numel() == batch.numel(),
            lambda: f"batch_norm_update_running_stats: {name} must have one value per channel ({batch.numel()}), "
            f"got {running.numel()}",
        )
    return None


def _check_stage_shapes(op: str, src: Tensor, data_format: str, **stats: tuple[Tensor, int]) -> int:
    torch._check_value(src.dim() >= 2, lambda: f"{op}: src must have rank 2 to 8, got shape {tuple(src.shape)}")
    channels = src.shape[_channels.channel_axis(src, data_format)]
    check_same_device(op, src, **{name: t for name, (t, _) in stats.items()})
    for name, (t, rows) in stats.items():
        expected = (channels,) if rows == 0 else (rows, channels)
        torch._check_type(t.dtype == torch.float64, lambda: f"{op}: {name} must have dtype float64, got {t.dtype}")
        torch._check_value(
            t.shape == expected, lambda: f"{op}: {name} must have shape {expected}, got {tuple(t.shape)}"
        )
    return channels


@torch.library.register_fake("torch_bn_grad::batch_norm_local_stats")
def _batch_norm_local_stats_fake(src, data_format):
    channels = _check_stage_shapes("batch_norm_local_stats", src, data_format)
    return src.new_empty((3, channels), dtype=torch.float64)


@torch.library.register_fake("torch_bn_grad::batch_norm_grad_sums")
def _batch_norm_grad_sums_fake(src, diff_dst, mean, data_format):
    torch._check_value(diff_dst.shape == src.shape, lambda: "batch_norm_grad_sums: diff_dst must have src's shape")
    channels = _check_stage_shapes("batch_norm_grad_sums", src, data_format, mean=(mean, 0))
    return src.new_empty((2, channels), dtype=torch.float64)


@torch.library.register_fake("torch_bn_grad::batch_norm_grad_input")
def _batch_norm_grad_input_fake(src, diff_dst, mean, variance, gamma, count, grad_sums, epsilon, data_format):
    torch._check_value(
        diff_dst.shape == src.shape, lambda: "batch_norm_grad_input: diff_dst must have src's shape"
    )
    _check_stage_shapes(
        "batch_norm_grad_input", src, data_format,
        mean=(mean, 0), variance=(variance, 0), count=(count, 0), grad_sums=(grad_sums, 2),
    )
    check_same_device("batch_norm_grad_input", src, gamma=gamma)
    return torch.empty_like(src)


@torch.library.register_fake("torch_bn_grad::batch_norm_act_forward")
def _batch_norm_act_forward_fake(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope,
                                 data_format, memory_saving):
    check_same_device("batch_norm_act_forward", src, residual=residual)
    if residual is not None:
        torch._check_value(
            residual.shape == src.shape,
            lambda: f"batch_norm_act_forward: residual must have src's shape {list(src.shape)}, "
            f"got {list(residual.shape)}",
        )
    return _batch_norm_forward_fake(src, gamma, beta, mean, variance, epsilon, data_format)


@torch.library.register_fake("torch_bn_grad::batch_norm_act_forward_sign_bits")
def _batch_norm_act_forward_sign_bits_fake(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                           negative_slope, data_format):
    dst, mean_out, variance_out = _batch_norm_act_forward_fake(
        src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, data_format, False)
    # One bit an element in the kernel's order, eight to a byte, or
    # none where the kernels cannot write the bits (a layout and ISA matter):
    # a size known only when the kernel runs.
    size = torch.library.get_ctx().new_dynamic_size()
    return dst, mean_out, variance_out, src.new_empty(size, dtype=torch.uint8)


@torch.library.register_fake("torch_bn_grad::batch_norm_act_forward.frozen")
def _batch_norm_act_forward_frozen_fake(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                        negative_slope, data_format, memory_saving):
    return _batch_norm_act_forward_fake(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                        negative_slope, data_format, memory_saving)[0]


@torch.library.register_fake("torch_bn_grad::batch_norm_act_forward.update")
def _batch_norm_act_forward_update_fake(src, gamma, beta, running_mean, running_var, residual, momentum, epsilon,
                                        activation, negative_slope, data_format, memory_saving):
    return _then_update("batch_norm_act_forward.update", src, running_mean, running_var, momentum,
                        lambda: _batch_norm_act_forward_fake(src, gamma, beta, None, None, residual, epsilon,
                                                             activation, negative_slope, data_format, memory_saving))


@torch.library.register_fake("torch_bn_grad::batch_norm_act_forward_sign_bits.update")
def _batch_norm_act_forward_sign_bits_update_fake(src, gamma, beta, running_mean, running_var, residual, momentum,
                                                  epsilon, activation, negative_slope, data_format):
    return _then_update("batch_norm_act_forward_sign_bits.update", src, running_mean, running_var, momentum,
                        lambda: _batch_norm_act_forward_sign_bits_fake(src, gamma, beta, None, None, residual,
                                                                       epsilon, activation, negative_slope,
                                                                       data_format))


@torch.library.register_fake("torch_bn_grad::batch_norm_act_backward")
def _batch_norm_act_backward_fake(diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon, activation,
                                  negative_slope, data_format, training, from_output, output_mask, dst_positive=None):
    op = "batch_norm_act_backward"
    data = dst if from_output else src
    torch._check_value(data is not None, lambda: f"{op}: {'dst' if from_output else 'src'} must be given, got None")
    check_same_device(op, data, diff_dst=diff_dst, residual=residual, mean=mean, variance=variance, gamma=gamma,
                      beta=beta)
    diff_residual = torch.empty_like(data) if output_mask[3] else data.new_empty(0)
    return (*_backward_outputs(op, data, diff_dst, mean, output_mask, gamma, beta), diff_residual)


@torch.library.register_fake("torch_bn_grad::batch_norm_masked_forward")
def _masked_forward_fake(src, mask, gamma, beta, mean, variance, epsilon):
    op = "batch_norm_masked_forward"
    check_mask(op, src, mask)
    check_same_device(op, src, mask=mask, gamma=gamma, beta=beta, mean=mean, variance=variance)
    torch._check_value(
        (mean is None) == (variance is None),
        lambda: f"{op}: mean and variance must be given together (frozen statistics) or both omitted",
    )
    channels = src.shape[1]
    dtype = mean.dtype if mean is not None else _channels.accumulation_dtype(src)
    return (
        torch.empty_like(src),
        src.new_empty((channels,), dtype=dtype),
        src.new_empty((channels,), dtype=dtype),
        src.new_empty((), dtype=torch.float64),
    )


@torch.library.register_fake("torch_bn_grad::batch_norm_masked_act_forward")
def _masked_act_forward_fake(src, mask, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope):
    check_same_device("batch_norm_masked_act_forward", src, residual=residual)
    return _masked_forward_fake(src, mask, gamma, beta, mean, variance, epsilon)


@torch.library.register_fake("torch_bn_grad::batch_norm_masked_backward")
def _masked_backward_fake(src, mask, diff_dst, mean, variance, gamma, epsilon, training, output_mask):
    op = "batch_norm_masked_backward"
    check_mask(op, src, mask)
    check_same_device(op, src, mask=mask, diff_dst=diff_dst, mean=mean, variance=variance, gamma=gamma)
    return _backward_outputs(op, src, diff_dst, mean, output_mask, gamma)


@torch.library.register_fake("torch_bn_grad::batch_norm_masked_act_backward")
def _masked_act_backward_fake(src, mask, dst, residual, diff_dst, mean, variance, gamma, beta, epsilon, activation,
                              negative_slope, training, output_mask):
    op = "batch_norm_masked_act_backward"
    check_mask(op, src, mask)
    check_same_device(op, src, mask=mask, dst=dst, residual=residual, diff_dst=diff_dst, mean=mean,
                      variance=variance, gamma=gamma, beta=beta)
    diff_residual = torch.empty_like(src) if output_mask[3] else src.new_empty(0)
    return (*_backward_outputs(op, src, diff_dst, mean, output_mask, gamma, beta), diff_residual)
