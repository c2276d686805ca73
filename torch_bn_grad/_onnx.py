"""ONNX export of this library's BatchNorms and operator.

Modules: while ``torch.onnx.is_in_onnx_export()`` (both exporters set it, and
the dynamo-based one captures the model without dynamo first), the modules'
forward is torch's ``_BatchNorm.forward`` (see ``torch_bn_grad/nn.py``), so a
converted model exports exactly as its torch twin: eval-mode BatchNorms become
``BatchNormalization`` (or are folded into a preceding Conv/Gemm, as torch's
are), and a training-mode export is whatever torch's exporters make of torch's
BatchNorm. Torch has no masked batch norm: with a mask, the forward is
:func:`masked_batch_norm`, made of torch operators that both exporters
translate into standard ONNX (``BatchNormalization`` then ``Where`` with
frozen statistics; ``ReduceSum`` over the valid positions for batch statistics).

Operator: for graphs that hold ``torch_bn_grad::batch_norm_forward`` itself
(a ``torch.jit.script``-ed converted model, or code calling
``torch_bn_grad.batch_norm_forward``), :func:`register` gives the
TorchScript-based exporter (``dynamo=False``) a symbolic through the public
``torch.onnx.register_custom_op_symbolic``: one standard
``BatchNormalization`` (opset 15 and later), for frozen statistics (eval)
and channel-first data with 1-D statistics (what the modules use). Batch
statistics (a scripted model exported in training mode) and other forms raise
an export error naming the operator.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from torch_bn_grad import _channels
from torch_bn_grad._masked_autograd import valid_positions
from torch_bn_grad._running_stats import update_running_stats

__all__ = ["masked_batch_norm", "register"]

OPSET = 15  # BatchNormalization-15 (statistics may be float32 for half inputs), CastLike


# ---------------------------------------------------------------- the masked modules' forward
def masked_batch_norm(
    input: Tensor,
    mask: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    training: bool,
    momentum: Union[float, Tensor],
    eps: float,
) -> Tensor:
    """``_masked.masked_batch_norm`` (arguments checked) in torch operators, for the exporters."""
    valid = valid_positions(mask)
    if not training:
        # Padded positions may hold anything (NaN included): Where picks 0 there.
        y = torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, False, 0.0, eps)
        return torch.where(valid, y, 0)
    x = input.to(_channels.accumulation_dtype(input))
    dims = [0] + list(range(2, input.dim()))
    count = mask.sum(dtype=torch.float64)  # valid positions per channel, as the operator's count
    n = count.to(x.dtype).clamp_min(1)
    mean = torch.where(valid, x, 0).sum(dims, keepdim=True) / n
    centered = torch.where(valid, x - mean, 0)
    var = (centered * centered).sum(dims, keepdim=True) / n
    y = centered * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * _channels.broadcastable(weight, y, "NCX")
    if bias is not None:
        y = y + _channels.broadcastable(bias, y, "NCX")
    if running_mean is not None or running_var is not None:
        update_running_stats(running_mean, running_var, mean.flatten(), var.flatten(), count, momentum)
    return torch.where(valid, y, 0).to(input.dtype)


# ---------------------------------------------------------------- the operator's symbolic
def _batch_norm_forward_symbolic(g, src, gamma, beta, mean, variance, epsilon, data_format):
    from torch.onnx import symbolic_helper as helper

    fmt = helper._maybe_get_const(data_format, "s")
    eps = helper._maybe_get_const(epsilon, "f")
    frozen = not helper._is_none(mean)
    rank = helper._get_tensor_rank(src)
    stats = next((t for t in (mean, variance, gamma, beta) if not helper._is_none(t)), None)
    stats_rank = helper._get_tensor_rank(stats) if stats is not None else 1
    if fmt != "NCX" or stats_rank != 1 or (rank is not None and rank < 2):
        return helper._unimplemented(
            "torch_bn_grad::batch_norm_forward",
            f"ONNX export supports data_format='NCX' with 1-D statistics only (got {fmt!r}, statistics of rank "
            f"{stats_rank})",
            src,
        )
    if not frozen:
        return helper._unimplemented(
            "torch_bn_grad::batch_norm_forward",
            "ONNX export of the operator with batch statistics (training) is not supported; export the model "
            "in eval mode, or use torch_bn_grad.nn modules (not scripted), which export as torch's BatchNorm",
            src,
        )
    if helper._is_none(gamma) or helper._is_none(beta):
        # ones/zeros shaped like the statistics, in their dtype.
        zeros = g.op("Mul", mean, g.op("CastLike", g.op("Constant", value_t=torch.tensor(0.0)), mean))
        ones = g.op("Add", zeros, g.op("CastLike", g.op("Constant", value_t=torch.tensor(1.0)), mean))
        gamma = ones if helper._is_none(gamma) else gamma
        beta = zeros if helper._is_none(beta) else beta
    dst = g.op("BatchNormalization", src, gamma, beta, mean, variance, epsilon_f=eps, training_mode_i=0)
    return dst, mean, variance


def register() -> None:
    """Give the TorchScript-based ONNX exporter a symbolic for the forward operator."""
    torch.onnx.register_custom_op_symbolic(
        "torch_bn_grad::batch_norm_forward", _batch_norm_forward_symbolic, OPSET
    )
