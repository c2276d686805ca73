"""The activations of the fused batch-norm modules, by name, in one place:
their validation and their plain (composed) form, used by ``SyncBatchNormAct``
with whole-group statistics, by the modules' fallback for a residual that is
not of the input's shape and dtype, and by ``convert_batchnorm(fuse=True)``."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

ACTIVATIONS = ("identity", "relu", "leaky_relu", "silu")


def check(activation: str, negative_slope: float, memory_saving: bool, where: str) -> None:
    """Raise ``ValueError`` for an unknown activation, a non-finite slope, or
    ``memory_saving`` with an activation whose input cannot be recovered from
    its output (only identity and leaky_relu with a positive slope can)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, (int, float)) \
            or not math.isfinite(negative_slope):
        raise ValueError(f"{where}: negative_slope must be a finite number, got {negative_slope!r}")
    if memory_saving and not (activation == "identity" or (activation == "leaky_relu" and negative_slope > 0)):
        raise ValueError(
            f"{where}: memory_saving=True needs an invertible activation (identity, or leaky_relu with "
            f"negative_slope > 0), got activation={activation!r}, negative_slope={negative_slope}")


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
