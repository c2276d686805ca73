"""The activations of the fused batch-norm operators, by name, in one place:
their names, the check of their arguments, which of them can be inverted,
how their derivative is read from the output, and their plain (composed)
form. The operator wrappers, the fused modules, ``convert_batchnorm(fuse=True)``,
the masked, scripted and ONNX paths and the inductor rewrites all call these;
the C++ operators check the same rule (``csrc/args/batch_norm_args.cpp``)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

ACTIVATIONS = ("identity", "relu", "leaky_relu", "silu")

# torch's module class and function of each activation but identity, whose
# torch form is nn.Identity and no call at all: what convert_batchnorm(fuse=True)
# recognizes and revert_batchnorm puts back.
TORCH_MODULES: dict[str, type[torch.nn.Module]] = {
    "relu": torch.nn.ReLU, "leaky_relu": torch.nn.LeakyReLU, "silu": torch.nn.SiLU}
TORCH_FUNCTIONS = {
    "relu": torch.nn.functional.relu, "leaky_relu": torch.nn.functional.leaky_relu, "silu": torch.nn.functional.silu}


def torch_module(activation: str, negative_slope: float) -> torch.nn.Module:
    """torch's module for the named activation (``nn.Identity`` for identity)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    if activation == "identity":
        return torch.nn.Identity()
    if activation == "leaky_relu":
        return torch.nn.LeakyReLU(negative_slope)
    return TORCH_MODULES[activation]()


def check(op: str, activation: object, negative_slope: object, inverted: bool = False,
          flag: str = "memory_saving") -> float:
    """The activation arguments of ``op``; returns ``negative_slope`` as a float.

    ``ValueError`` for an unknown activation or a slope that is not finite and
    >= 0 (the fused backward reads the derivative from the output's sign,
    which a negative slope flips), ``TypeError`` for a slope that is not a real
    number. ``inverted``: ``flag=True`` was asked for, which recovers the input
    from the output, so the activation must be :func:`invertible`."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    if isinstance(negative_slope, bool):
        raise TypeError(f"{op}: negative_slope must be a real number, got {negative_slope!r}")
    try:
        slope = float(negative_slope)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{op}: negative_slope must be a real number, got {negative_slope!r}") from None
    if not (math.isfinite(slope) and slope >= 0):
        raise ValueError(f"{op}: negative_slope must be finite and >= 0 (the fused backward reads the "
                         f"activation's derivative from the output's sign), got {slope}")
    if inverted and not invertible(activation, slope):
        raise ValueError(f"{op}: {flag}=True needs an invertible activation ('identity', or 'leaky_relu' with "
                         f"negative_slope > 0), got activation={activation!r}, negative_slope={slope}")
    return slope


def invertible(activation: str, negative_slope: float) -> bool:
    """Whether the activation's input can be recovered from its output (what
    ``memory_saving``/``from_output`` need): identity, and leaky_relu with a
    positive slope."""
    return activation == "identity" or (activation == "leaky_relu" and negative_slope > 0)


def fuses_residual(input: Tensor, residual: Optional[Tensor]) -> bool:
    """Whether the fused operators take ``residual`` as it is: none, or one of
    ``input``'s shape, dtype and device (else the add is composed, as torch
    would broadcast and promote it)."""
    return residual is None or (
        residual.shape == input.shape and residual.dtype == input.dtype and residual.device == input.device)


def activate(y: Tensor, activation: str, negative_slope: float) -> Tensor:
    """``y`` through the named activation (out of place)."""
    if activation == "relu":
        return torch.relu(y)
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu(y, negative_slope)
    if activation == "silu":
        return torch.nn.functional.silu(y)
    return y


def gate_from_output(grad: Tensor, dst: Tensor, activation: str, negative_slope: float) -> Tensor:
    """``grad * act'(z)`` for identity, relu and leaky_relu, read from the output
    ``dst``: with ``negative_slope >= 0``, ``dst > 0`` exactly where ``z > 0``.
    Identity returns ``grad`` itself. (silu's derivative needs ``z``.)"""
    if activation == "relu":
        return torch.where(dst > 0, grad, 0)
    if activation == "leaky_relu":
        return torch.where(dst > 0, grad, grad * negative_slope)
    return grad
