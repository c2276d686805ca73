"""A dispatch mode that records the operators a call reaches below autograd."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class RecordedOps(TorchDispatchMode):
    """The operators a call reaches below autograd, by name, in order; each runs as it is."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
