"""Whether a call runs eagerly, the one rule for the one-call operator overloads
(``.update``: the training forward and the running statistics' update;
``.frozen``: an eval forward's output alone): not traced by torch.compile and
not under a torch.func transform. Traced code keeps the plain operators and
tensor arithmetic, which the compiler's lowering and the transforms' rules
know."""

from __future__ import annotations

import torch
from torch import Tensor

from torch_bn_grad import _compat


def is_eager(t: Tensor) -> bool:
    """Whether code holding ``t`` runs eagerly (see the module's docstring)."""
    return not torch.compiler.is_compiling() and not _compat.is_functorch_wrapped_tensor(t)
