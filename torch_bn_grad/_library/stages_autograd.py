"""Autograd for the split-stage operators (:mod:`torch_bn_grad.stages`) and
``batch_norm_stats_affine`` (the statistics stage of the torch.compile lowering).

Each stage is a closed-form function of its inputs; its backward recomputes
that function with differentiable torch operations in float64 (the stages'
own precision) and differentiates it with ``torch.autograd.grad``, with
``create_graph`` when the backward itself is recorded, so gradients of every
order flow through the stages. The stages' hot path (SyncBatchNorm's
autograd Function) runs them with grad mode off and never reaches this code.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._compat import OpOverload
from torch_bn_grad._library.autograd_kernel import register_autograd


def _dims(src: Tensor, data_format: str) -> tuple[list[int], list[int], int]:
    """(reduced dims, broadcast shape of a (C,) tensor, elements per channel)."""
    axis = _channels.channel_axis(src, data_format)
    dims = [d for d in range(src.dim()) if d != axis]
    shape = [1] * src.dim()
    shape[axis] = src.shape[axis]
    return dims, shape, _channels.reduced_count(src, dims)


def _local_stats(src: Tensor, data_format: str) -> Tensor:
    dims, shape, n = _dims(src, data_format)
    x = src.to(torch.float64)
    mean = x.sum(dims) / max(n, 1)
    m2 = (x - mean.reshape(shape)).square().sum(dims)
    return torch.stack([torch.full_like(mean, float(n)), mean, m2])


def _grad_sums(src: Tensor, diff_dst: Tensor, mean: Tensor, data_format: str) -> Tensor:
    dims, shape, _ = _dims(src, data_format)
    dy = diff_dst.to(torch.float64)
    return torch.stack([dy.sum(dims), (dy * (src.to(torch.float64) - mean.reshape(shape))).sum(dims)])


def _grad_input(
    src: Tensor, diff_dst: Tensor, mean: Tensor, variance: Tensor, gamma: Optional[Tensor], count: Tensor,
    grad_sums: Tensor, epsilon: float, data_format: str,
) -> Tensor:
    _, shape, _ = _dims(src, data_format)
    rstd = (variance + epsilon).rsqrt()
    scale = rstd if gamma is None else gamma.to(torch.float64) * rstd
    n = count.clamp_min(1)
    sum_dy, sum_dy_xc = grad_sums.unbind(0)
    xc = src.to(torch.float64) - mean.reshape(shape)
    out = scale.reshape(shape) * (
        diff_dst.to(torch.float64) - (sum_dy / n).reshape(shape) - xc * (rstd.square() * sum_dy_xc / n).reshape(shape)
    )
    return out.to(src.dtype)


def _stats_affine(
    src: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], epsilon: float, data_format: str,
) -> tuple[Tensor, ...]:
    # In exact arithmetic the operator's bias, beta - scale * (mean - rounded mean), is beta.
    shape = _channels.stats_shape(src, gamma if gamma is not None else beta, data_format)
    stats = src.new_empty(shape)
    dims = _channels.reduced_dims(src, stats, data_format)
    x = src.to(torch.float64)
    mean = x.mean(dims, keepdim=True) if dims else x
    var = (x - mean).square().mean(dims, keepdim=True) if dims else torch.zeros_like(x)
    scale = (var + epsilon).rsqrt().reshape(shape)
    if gamma is not None:
        scale = scale * gamma.to(torch.float64)
    bias = beta.to(torch.float64) if beta is not None else torch.zeros_like(scale)
    acc = _channels.accumulation_dtype(src)
    return tuple(t.reshape(shape).to(acc) for t in (mean, var, scale, bias))


def _register(op: OpOverload, reference: Callable[..., Any]) -> None:
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.num_inputs = len(inputs)
        ctx.tensor_positions = [i for i, a in enumerate(inputs) if isinstance(a, Tensor)]
        ctx.constants = {i: a for i, a in enumerate(inputs) if not isinstance(a, Tensor)}
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_positions))

    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        result: list[Optional[Tensor]] = [None] * ctx.num_inputs
        create_graph = torch.is_grad_enabled()
        args: list[Any] = [ctx.constants.get(i) for i in range(ctx.num_inputs)]
        wanted: list[tuple[int, Tensor]] = []
        for i, t in zip(ctx.tensor_positions, ctx.saved_tensors):
            if ctx.needs_input_grad[i]:
                if not create_graph:
                    t = t.detach().requires_grad_()
                wanted.append((i, t))
            args[i] = t
        live = [(k, g) for k, g in enumerate(grad_outputs) if g is not None]
        if not wanted or not live:
            return tuple(result)
        with torch.enable_grad():
            outputs = reference(*args)
            outputs = (outputs,) if isinstance(outputs, Tensor) else outputs
            grads = torch.autograd.grad([outputs[k] for k, _ in live], [t for _, t in wanted], [g for _, g in live],
                                        allow_unused=True, create_graph=create_graph)
        for (i, t), g in zip(wanted, grads):
            result[i] = torch.zeros_like(t) if g is None else g
        return tuple(result)

    register_autograd(op, backward, setup_context)


_register(torch.ops.torch_bn_grad.batch_norm_local_stats.default, _local_stats)
_register(torch.ops.torch_bn_grad.batch_norm_grad_sums.default, _grad_sums)
_register(torch.ops.torch_bn_grad.batch_norm_grad_input.default, _grad_input)
_register(torch.ops.torch_bn_grad.batch_norm_stats_affine.default, _stats_affine)
