"""The masked operators' handles and the two views of a mask that every masked
path shares (the forward, the ONNX form, the distributed stages, the autograd
formula)."""

from __future__ import annotations

import torch
from torch import Tensor

from torch_bn_grad._rules import channels as _channels

FORWARD = torch.ops.torch_bn_grad.batch_norm_masked_forward.default
BACKWARD = torch.ops.torch_bn_grad.batch_norm_masked_backward.default
FORWARD_ACT = torch.ops.torch_bn_grad.batch_norm_masked_act_forward.default


def valid_positions(mask: Tensor) -> Tensor:
    """The mask (N, *X) broadcast against its input (N, C, *X)."""
    return mask.unsqueeze(1)


def per_channel(stats: Tensor, src: Tensor) -> Tensor:
    """A (C,) tensor viewed to broadcast against ``src`` (N, C, *X)."""
    return _channels.broadcastable(stats, src, "NCX")
