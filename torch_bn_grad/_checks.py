"""Argument checks made in Python: what cannot reach the C++ checks
(``csrc/args/batch_norm_args.cpp``), arguments of the wrong Python type, and the
fake implementations' device check. The activation arguments' check is
``_activation.check``."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from torch_bn_grad import _activation

# The operator wrappers' name for the activation check, whose rule is _activation's.
check_activation = _activation.check


def check_data_format(op: str, data_format: object) -> None:
    if not isinstance(data_format, str):
        raise ValueError(f"{op}: data_format must be 'NCX' or 'NXC', got {data_format!r}")


def epsilon_value(op: str, epsilon: object) -> float:
    try:
        return float(epsilon)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{op}: epsilon must be a real number, got {epsilon!r}") from None


def output_mask_value(
    op: str, output_mask: Sequence[bool], names: Sequence[str] = ("diff_src", "diff_gamma", "diff_beta")
) -> list[bool]:
    mask = list(map(bool, output_mask))
    if len(mask) != len(names):
        raise ValueError(
            f"{op}: output_mask must have {len(names)} entries ({', '.join(names)}), got {len(mask)}"
        )
    return mask


def check_same_device(op: str, src: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None:
            torch._check_value(
                t.device == src.device,
                lambda: f"{op}: {name} must be on src's device ({src.device}), got {t.device}",
            )


def check_mask(op: str, src: Tensor, mask: object) -> None:
    """A masked batch norm's mask: bool, of ``src``'s shape without the channel dim 1
    (TypeError, ValueError naming the expected shape). Plain raises, which
    torch.compile traces (the values checked are static or guarded)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{op}: mask must be a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{op}: mask must have dtype torch.bool (True: a valid position), got {mask.dtype}")
    if src.dim() < 2:
        raise ValueError(f"{op}: input must have rank 2 or more (N, C, *), got shape {tuple(src.shape)}")
    expected = (src.shape[0], *src.shape[2:])
    if tuple(mask.shape) != expected:
        raise ValueError(f"{op}: mask must have shape {tuple(expected)} (input's shape {tuple(src.shape)} without "
                         f"the channel dim 1), got {tuple(mask.shape)}")
