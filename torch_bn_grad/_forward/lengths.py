"""The ``lengths=`` form of masked batch norm: valid lengths per sample of an
(N, C, L) batch, made into the ``(N, L)`` mask that ``mask=`` takes.

The mask is ``arange(L) < lengths[:, None]``, built with tensor operations on
the input's device: nothing reads the lengths on the host, so a CUDA step does
not wait for them and ``torch.compile`` traces it into the graph. The values
are not checked (that would read them): a length below 0 counts as 0, one
above L as L. TorchScript compiles these functions (the modules' scripted
forward calls them too).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["mask_from_lengths", "resolve_mask"]


def mask_from_lengths(op: str, input: Tensor, lengths: Tensor) -> Tensor:
    """The bool ``(N, L)`` mask of ``input`` (N, C, L) whose sample i is valid at
    positions ``[0, lengths[i])``; errors name ``lengths``, what it must be and
    what it is."""
    if not torch.jit.is_scripting() and not isinstance(lengths, Tensor):
        raise TypeError(f"{op}: lengths must be an integer tensor (a valid length per sample), "
                        f"got {type(lengths).__name__}")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        if torch.jit.is_scripting():  # TorchScript prints a dtype as its enum number
            raise TypeError(f"{op}: lengths must be an integer tensor (a valid length per sample)")
        raise TypeError(f"{op}: lengths must be an integer tensor (a valid length per sample), got {lengths.dtype}")
    if input.dim() != 3:
        raise ValueError(f"{op}: lengths takes an input of rank 3 (N, C, L), got shape {list(input.shape)} "
                         "(use mask= for other ranks)")
    if lengths.dim() != 1 or lengths.shape[0] != input.shape[0]:
        raise ValueError(f"{op}: lengths must have shape [{input.shape[0]}] (one length per sample of input's "
                         f"shape {list(input.shape)}), got {list(lengths.shape)}")
    if lengths.device != input.device:
        raise ValueError(f"{op}: lengths must be on input's device ({input.device}), got {lengths.device}")
    return torch.arange(input.shape[2], device=input.device) < lengths[:, None]


def resolve_mask(op: str, input: Tensor, mask: Optional[Tensor], lengths: Optional[Tensor]) -> Optional[Tensor]:
    """The mask a masked batch norm takes from ``mask=`` or ``lengths=`` (at most one
    of them: ValueError naming both); None for neither."""
    if lengths is None:
        return mask
    if mask is not None:
        raise ValueError(f"{op}: give mask or lengths, not both")
    return mask_from_lengths(op, input, lengths)
