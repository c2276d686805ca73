"""Argument checks made in Python: what cannot reach the C++ checks
(``csrc/args/batch_norm_args.cpp``), arguments of the wrong Python type, the
functional and module paths' checks of the running statistics and ``eps``
(written so that TorchScript compiles them, for ``_forward/scripted.py``), and the fake
implementations' device check. The activation arguments' check is
``_activation.check``."""

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


def output_mask_value(
    op: str, output_mask: Sequence[bool], names: Sequence[str] = ("diff_src", "diff_gamma", "diff_beta")
) -> list[bool]:
    mask = list(map(bool, output_mask))
    if len(mask) != len(names):
        raise ValueError(
            f"{op}: output_mask must have {len(names)} entries ({', '.join(names)}), got {len(mask)}"
        )
    return mask


def check_running_stats(op: str, running_mean: Optional[Tensor], running_var: Optional[Tensor]) -> None:
    """Eval mode normalizes with the running statistics: both must be given."""
    if running_mean is None or running_var is None:
        raise ValueError(op + ": running_mean and running_var must be given when training=False")


def check_training_eps(op: str, eps: float) -> None:
    """Batch statistics are normalized with ``rsqrt(variance + eps)``, which a
    constant channel (variance 0) makes infinite unless ``eps > 0``."""
    if not eps > 0:
        raise ValueError(op + ": eps must be positive in training, got " + str(eps))


def check_statistics(op: str, training: bool, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                     eps: float) -> None:
    """What a batch norm needs before it normalizes: the running statistics in eval
    mode, a positive ``eps`` in training."""
    if training:
        check_training_eps(op, eps)
    else:
        check_running_stats(op, running_mean, running_var)


def check_training(op: str, input: Tensor, eps: float) -> None:
    """torch's training check (more than one value per channel, after the rank the
    channel axis needs), then a positive ``eps``."""
    if input.dim() < 2:
        raise ValueError(op + ": expected input of rank 2 or more (N, C, *), got shape " + str(list(input.shape)))
    size_prods = input.size(0)
    for size in input.size()[2:]:
        size_prods *= size
    if size_prods == 1:
        raise ValueError("Expected more than 1 value per channel when training, got input size "
                         + str(input.size()))
    check_training_eps(op, eps)


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
