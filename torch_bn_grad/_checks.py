"""Argument checks made in Python: what cannot reach the C++ checks
(``csrc/batch_norm_args.cpp``), arguments of the wrong Python type, and the
fake implementations' device check."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def check_data_format(op: str, data_format: object) -> None:
    if not isinstance(data_format, str):
        raise ValueError(f"{op}: data_format must be 'NCX' or 'NXC', got {data_format!r}")


def epsilon_value(op: str, epsilon: object) -> float:
    try:
        return float(epsilon)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{op}: epsilon must be a real number, got {epsilon!r}") from None


def output_mask_value(op: str, output_mask: Sequence[bool]) -> list[bool]:
    mask = list(output_mask)
    if len(mask) != 3:
        raise ValueError(
            f"{op}: output_mask must have 3 entries (diff_src, diff_gamma, diff_beta), got {len(mask)}"
        )
    return [bool(m) for m in mask]


def check_same_device(op: str, src: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None:
            torch._check_value(
                t.device == src.device,
                lambda: f"{op}: {name} must be on src's device ({src.device}), got {t.device}",
            )
