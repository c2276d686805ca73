"""ONNX export of this library's BatchNorms and operators.

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

Operators: for graphs that hold ``torch_bn_grad::batch_norm_forward`` or
``batch_norm_masked_forward`` themselves (a ``torch.jit.script``-ed model, or
code calling the operators), :func:`register` gives the TorchScript-based
exporter (``dynamo=False``) symbolics through the public
``torch.onnx.register_custom_op_symbolic`` (opset 15 and later), for
channel-first data with 1-D statistics (what the modules use): one standard
``BatchNormalization`` for frozen statistics, and, for the masked operator,
the masked batch statistics too. The unmasked operator with batch statistics
(a scripted model exported in training mode) and other forms raise an export
error naming the operator.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._forward.masked_operators import valid_positions
from torch_bn_grad._forward.normalization import Normalization
from torch_bn_grad._rules.running_stats import update_running_stats

__all__ = ["masked_batch_norm", "register"]

OPSET = 15  # BatchNormalization-15 (statistics may be float32 for half inputs), CastLike
ONNX_FLOAT, ONNX_DOUBLE = 1, 11  # onnx.TensorProto's element types


# ---------------------------------------------------------------- the masked modules' forward
def masked_batch_norm(input: Tensor, mask: Tensor, norm: Normalization) -> Tensor:
    """``_forward/masked.py``'s ``batch_norm`` (arguments checked) in torch operators, for the exporters."""
    running_mean, running_var, weight, bias, training, momentum, eps = norm
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


# ---------------------------------------------------------------- the operators' symbolics
def _batch_norm_forward_symbolic(g, src, gamma, beta, mean, variance, epsilon, data_format):
    from torch.onnx import symbolic_helper as helper

    op = "torch_bn_grad::batch_norm_forward"
    fmt = helper._maybe_get_const(data_format, "s")
    frozen = not helper._is_none(mean)
    if fmt != "NCX":
        return helper._unimplemented(op, f"ONNX export supports data_format='NCX' only (got {fmt!r})", src)
    unsupported = _unsupported_form(src, (mean, variance, gamma, beta))
    if unsupported:
        return helper._unimplemented(op, unsupported, src)
    if not frozen:
        return helper._unimplemented(
            op,
            "ONNX export of the operator with batch statistics (training) is not supported; export the model "
            "in eval mode, or use torch_bn_grad.nn modules (not scripted), which export as torch's BatchNorm",
            src,
        )
    eps = helper._maybe_get_const(epsilon, "f")
    gamma, beta = _affine_or_identity(g, gamma, beta, mean)
    dst = g.op("BatchNormalization", src, gamma, beta, mean, variance, epsilon_f=eps, training_mode_i=0)
    return dst, mean, variance


def _batch_norm_masked_forward_symbolic(g, src, mask, gamma, beta, mean, variance, epsilon):
    from torch.onnx import symbolic_helper as helper

    rank = helper._get_tensor_rank(src)
    unsupported = _unsupported_form(src, (mean, variance, gamma, beta))
    if unsupported or rank is None:
        return helper._unimplemented("torch_bn_grad::batch_norm_masked_forward",
                                     unsupported or "ONNX export needs src's rank", src)
    eps = helper._maybe_get_const(epsilon, "f")
    valid = g.op("Unsqueeze", mask, _constant(g, [1]))
    count = g.op("ReduceSum", g.op("Cast", mask, to_i=ONNX_DOUBLE), keepdims_i=0)  # 0-dim float64, as the operator's
    if not helper._is_none(mean):
        gamma, beta = _affine_or_identity(g, gamma, beta, mean)
        y = g.op("BatchNormalization", src, gamma, beta, mean, variance, epsilon_f=eps, training_mode_i=0)
        return _where_valid(g, valid, y), mean, variance, count
    dst, mean, variance = _masked_batch_statistics(g, src, valid, count, gamma, beta, eps, rank)
    return dst, mean, variance, count


def _masked_batch_statistics(g, src, valid, count, gamma, beta, eps: float, rank: int):
    """(dst, mean, biased variance) with the statistics of the valid positions, as
    :func:`masked_batch_norm` composes them (float32 for half-precision data)."""
    from torch.onnx import symbolic_helper as helper

    half = getattr(helper._try_get_scalar_type(src), "name", None) in ("HALF", "BFLOAT16")
    x = g.op("Cast", src, to_i=ONNX_FLOAT) if half else src
    axes = _constant(g, [0] + list(range(2, rank)))
    n = g.op("Max", g.op("CastLike", count, x), g.op("CastLike", _constant(g, 1.0), x))  # count 0: zeros, not NaN
    mean = g.op("Div", g.op("ReduceSum", _where_valid(g, valid, x), axes, keepdims_i=1), n)
    centered = _where_valid(g, valid, g.op("Sub", x, mean))
    variance = g.op("Div", g.op("ReduceSum", g.op("Mul", centered, centered), axes, keepdims_i=1), n)
    eps_like_x = g.op("CastLike", _constant(g, torch.tensor(eps, dtype=torch.float64)), x)
    y = g.op("Div", centered, g.op("Sqrt", g.op("Add", variance, eps_like_x)))
    per_channel = _constant(g, [1, -1] + [1] * (rank - 2))
    if not helper._is_none(gamma):
        y = g.op("Mul", y, g.op("Reshape", g.op("CastLike", gamma, x), per_channel))
    if not helper._is_none(beta):
        y = g.op("Add", y, g.op("Reshape", g.op("CastLike", beta, x), per_channel))
    flat = _constant(g, [-1])
    dst = _where_valid(g, valid, g.op("CastLike", y, src))
    return dst, g.op("Reshape", mean, flat), g.op("Reshape", variance, flat)


def _unsupported_form(src, stats) -> Optional[str]:
    """Why the symbolics cannot translate these arguments (None: they can): channel-first
    data of rank 2 or more with 1-D statistics."""
    from torch.onnx import symbolic_helper as helper

    rank = helper._get_tensor_rank(src)
    given = next((t for t in stats if not helper._is_none(t)), None)
    stats_rank = helper._get_tensor_rank(given) if given is not None else 1
    if stats_rank != 1 or (rank is not None and rank < 2):
        return f"ONNX export supports src of rank 2 or more with 1-D statistics only (got statistics of rank " \
               f"{stats_rank}, src of rank {rank})"
    return None


def _affine_or_identity(g, gamma, beta, like):
    """gamma and beta, ones and zeros shaped like ``like`` (in its dtype) where absent."""
    from torch.onnx import symbolic_helper as helper

    if helper._is_none(gamma) or helper._is_none(beta):
        zeros = g.op("Mul", like, g.op("CastLike", _constant(g, 0.0), like))
        ones = g.op("Add", zeros, g.op("CastLike", _constant(g, 1.0), like))
        gamma = ones if helper._is_none(gamma) else gamma
        beta = zeros if helper._is_none(beta) else beta
    return gamma, beta


def _where_valid(g, valid, values):
    """``values`` at valid positions, 0 at padded ones (whatever they hold there)."""
    return g.op("Where", valid, values, g.op("CastLike", _constant(g, 0.0), values))


def _constant(g, value):
    return g.op("Constant", value_t=value if isinstance(value, Tensor) else torch.tensor(value))


def register() -> None:
    """Give the TorchScript-based ONNX exporter symbolics for the forward operators."""
    torch.onnx.register_custom_op_symbolic(
        "torch_bn_grad::batch_norm_forward", _batch_norm_forward_symbolic, OPSET
    )
    torch.onnx.register_custom_op_symbolic(
        "torch_bn_grad::batch_norm_masked_forward", _batch_norm_masked_forward_symbolic, OPSET
    )
