"""Drop-in ``BatchNorm1d/2d/3d`` modules and ``convert_batchnorm``."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from torch_bn_grad.functional import _batch_norm

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "convert_batchnorm"]


class _FusedForward:
    """The forward shared by the modules: torch's ``_BatchNorm.forward`` semantics
    on this library's operators. ``momentum=None`` (cumulative average) keeps
    its factor a tensor, so that it traces without a graph break."""

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor: Union[float, Tensor] = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                # float64: 1 / an int64 tensor would be float32, off by 1e-8 relative.
                factor = 1.0 / self.num_batches_tracked.double()
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep_running = not self.training or self.track_running_stats
        return _batch_norm(
            input,
            self.running_mean if keep_running else None,
            self.running_var if keep_running else None,
            self.weight,
            self.bias,
            use_batch_stats,
            factor,
            self.eps,
        )


class BatchNorm1d(_FusedForward, torch.nn.BatchNorm1d):
    """Drop-in for :class:`torch.nn.BatchNorm1d` (inputs (N, C) or (N, C, L))."""


class BatchNorm2d(_FusedForward, torch.nn.BatchNorm2d):
    """Drop-in for :class:`torch.nn.BatchNorm2d` (inputs (N, C, H, W))."""


class BatchNorm3d(_FusedForward, torch.nn.BatchNorm3d):
    """Drop-in for :class:`torch.nn.BatchNorm3d` (inputs (N, C, D, H, W))."""


_REPLACEMENTS: dict[type, type] = {
    torch.nn.BatchNorm1d: BatchNorm1d,
    torch.nn.BatchNorm2d: BatchNorm2d,
    torch.nn.BatchNorm3d: BatchNorm3d,
}


def _replacement(module: torch.nn.Module, sync: bool) -> Optional[torch.nn.Module]:
    """This library's module for a torch BatchNorm, sharing its tensors; None if not one."""
    target = _REPLACEMENTS.get(type(module))
    if target is None:
        return None
    if sync:
        raise NotImplementedError("convert_batchnorm(sync=True): SyncBatchNorm is not available yet")
    new = target(
        module.num_features,
        eps=module.eps,
        momentum=module.momentum,
        affine=module.affine,
        track_running_stats=module.track_running_stats,
        device="meta",
    )
    # Share the very same Parameter and buffer objects.
    for name, param in module._parameters.items():
        new._parameters[name] = param
    for name, buf in module._buffers.items():
        new._buffers[name] = buf
    new.train(module.training)
    return new


def convert_batchnorm(
    module: torch.nn.Module, *, sync: bool = False, process_group: Optional[object] = None
) -> torch.nn.Module:
    """Replace every torch ``BatchNorm1d/2d/3d`` in ``module`` with this library's.

    The replacements share the original Parameter and buffer tensors and keep
    ``training`` and ``requires_grad``. Only modules whose type is exactly one
    of torch's classes are replaced; children are replaced in place and the
    root is returned (or its replacement, if the root itself is a BatchNorm).
    Converting twice changes nothing.
    """
    del process_group  # used by the sync variant
    replaced = _replacement(module, sync)
    if replaced is not None:
        return replaced
    for name, child in module.named_children():
        new_child = convert_batchnorm(child, sync=sync)
        if new_child is not child:
            setattr(module, name, new_child)
    return module
