"""Drop-in ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` modules and ``convert_batchnorm``."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.batchnorm import SyncBatchNorm as _TorchSyncBatchNorm  # bound here: programs rebind torch.nn's

from torch_bn_grad import _compat, errors
from torch_bn_grad._conversion import convert as _convert
from torch_bn_grad._conversion import fuse as _fuse
from torch_bn_grad._forward.act_module import BatchNormActBase
from torch_bn_grad._forward.module import BatchNormBase
from torch_bn_grad._forward.normalization import Normalization
from torch_bn_grad._rules.running_stats import skip_nonfinite_setting
from torch_bn_grad.distributed import sync_batch_norm

__all__ = [
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
    "BatchNormAct1d", "BatchNormAct2d", "BatchNormAct3d", "SyncBatchNormAct",
    "BatchNormActSequential", "BatchNormActBase", "BatchNormBase",
    "convert_batchnorm",
]


class BatchNorm1d(BatchNormBase, torch.nn.BatchNorm1d):
    """Drop-in for :class:`torch.nn.BatchNorm1d` (inputs (N, C) or (N, C, L))."""


class BatchNorm2d(BatchNormBase, torch.nn.BatchNorm2d):
    """Drop-in for :class:`torch.nn.BatchNorm2d` (inputs (N, C, H, W))."""


class BatchNorm3d(BatchNormBase, torch.nn.BatchNorm3d):
    """Drop-in for :class:`torch.nn.BatchNorm3d` (inputs (N, C, D, H, W))."""


class SyncBatchNorm(BatchNormBase, _BatchNorm):
    """Drop-in for :class:`torch.nn.SyncBatchNorm` (inputs (N, C, *)), same constructor.

    In training, with an initialized ``torch.distributed`` process group of more
    than one process (``process_group``, else the world), the statistics and
    the input gradient are those of the whole batch spread over the group's
    processes, which may hold different batch sizes, an empty one included.
    Parameter gradients stay local (DDP averages them). One collective per
    direction, no host synchronization, and it compiles without graph breaks
    (see :mod:`torch_bn_grad.distributed`). Otherwise (eval mode, no process
    group, one process) it is a local BatchNorm, as torch's is.

    It derives from ``_BatchNorm``, not from ``torch.nn.SyncBatchNorm``, which
    DistributedDataParallel refuses in CPU modules; so it also runs on gloo.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        bias: bool = True,
        skip_nonfinite_stats: Optional[bool] = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         skip_nonfinite_stats=skip_nonfinite_stats, **_compat.batchnorm_bias_kwargs(bias))
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        # torch's SyncBatchNorm checks, with its messages.
        _TorchSyncBatchNorm._check_input_dim(self, input)
        _TorchSyncBatchNorm._check_non_zero_input_channels(self, input)

    def _normalize(self, input: Tensor, norm: Normalization) -> Tensor:
        group = self._sync_group() if self.training else None
        if group is None:
            return super()._normalize(input, norm)
        running_mean, running_var, weight, bias, _, momentum, eps = norm
        skip, counter = self._skipping()
        try:
            return sync_batch_norm(input, running_mean, running_var, weight, bias, momentum, eps, group,
                                   skip_nonfinite_stats=skip, num_batches_tracked=counter)
        except (ValueError, TypeError) as error:  # as functional.batch_norm's: see errors.py
            raise errors.torch_compatible(error) from None

    def _normalize_masked(self, input: Tensor, mask: Tensor, norm: Normalization) -> Tensor:
        group = self._sync_group() if self.training else None
        if group is None:
            return super()._normalize_masked(input, mask, norm)
        running_mean, running_var, weight, bias, _, momentum, eps = norm
        skip, counter = self._skipping()
        try:
            return sync_batch_norm(input, running_mean, running_var, weight, bias, momentum, eps, group,
                                   mask=mask, skip_nonfinite_stats=skip, num_batches_tracked=counter)
        except (ValueError, TypeError) as error:
            raise errors.torch_compatible(error) from None

    def _sync_group(self) -> Optional[dist.ProcessGroup]:
        """The process group to synchronize over, or None to run locally."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None
    ) -> torch.nn.Module:
        """``convert_batchnorm(module, sync=True, process_group=process_group)``: this library's
        SyncBatchNorm in place of every torch BatchNorm (torch's method would build its own)."""
        return convert_batchnorm(module, sync=True, process_group=process_group)


class BatchNormAct1d(BatchNormActBase, torch.nn.BatchNorm1d):
    """``activation(BatchNorm1d(input) + residual)`` in one operator; torch's
    ``BatchNorm1d`` state_dict, constructor (plus ``activation``,
    ``negative_slope``, ``memory_saving``) and train/eval behaviour."""


class BatchNormAct2d(BatchNormActBase, torch.nn.BatchNorm2d):
    """``activation(BatchNorm2d(input) + residual)`` in one operator; torch's
    ``BatchNorm2d`` state_dict, constructor (plus ``activation``,
    ``negative_slope``, ``memory_saving``) and train/eval behaviour."""


class BatchNormAct3d(BatchNormActBase, torch.nn.BatchNorm3d):
    """``activation(BatchNorm3d(input) + residual)`` in one operator; torch's
    ``BatchNorm3d`` state_dict, constructor (plus ``activation``,
    ``negative_slope``, ``memory_saving``) and train/eval behaviour."""


class SyncBatchNormAct(BatchNormActBase, SyncBatchNorm):
    """:class:`SyncBatchNorm` followed by the residual add and the activation.

    With whole-group statistics (training, a process group of more than one
    process), the normalization is :class:`SyncBatchNorm`'s and the add and
    activation are composed after it (torch operations, so ``memory_saving``
    saves nothing there); otherwise (eval, no group) it is the fused local
    operator, as :class:`BatchNormAct2d`."""

    def _composes(self, input: Tensor, residual: Optional[Tensor]) -> bool:
        return (self.training and self._sync_group() is not None) or super()._composes(input, residual)


class BatchNormActSequential(torch.nn.Sequential):
    """torch's batch norm (``[0]``) then its activation module (``[1]``), in place of a fused
    module: ``forward(input, residual=None)`` is ``act(bn(input) + residual)``."""

    def forward(self, input: Tensor, residual: Optional[Tensor] = None) -> Tensor:  # type: ignore[override]
        y = self[0](input)
        if residual is not None:
            y = y + residual
        return self[1](y)


# The classes a conversion produces, for the conversion modules below this one.
TARGETS = _convert.Targets(
    plain={torch.nn.BatchNorm1d: BatchNorm1d, torch.nn.BatchNorm2d: BatchNorm2d, torch.nn.BatchNorm3d: BatchNorm3d},
    sync=SyncBatchNorm,
    forward=BatchNormBase,
    act_forward=BatchNormActBase,
    fused={BatchNorm1d: BatchNormAct1d, BatchNorm2d: BatchNormAct2d, BatchNorm3d: BatchNormAct3d,
           SyncBatchNorm: SyncBatchNormAct},
    home=__name__,
)


def convert_batchnorm(
    module: torch.nn.Module,
    *,
    sync: bool = False,
    process_group: Optional[dist.ProcessGroup] = None,
    subclasses: bool = False,
    fuse: bool = False,
    memory_saving: bool = False,
    skip_nonfinite_stats: Optional[bool] = None,
) -> torch.nn.Module:
    """Replace every torch ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` in ``module`` with this library's.

    With ``sync=True`` every one becomes a :class:`SyncBatchNorm` over
    ``process_group`` (None: the world); a torch ``SyncBatchNorm`` becomes ours
    even with ``sync=False``, keeping its own group unless ``process_group``
    is given. timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` (whose
    forward is the batch norm, then the module's ``drop``, then its ``act``)
    become a class derived from timm's with this library's batch norm in
    front, ``drop`` and ``act`` kept. Other subclasses of torch's BatchNorm
    are left alone unless ``subclasses=True``: then a subclass whose
    ``forward`` is torch's own becomes a class derived from it with this
    library's forward. What is left alone (other subclasses, the Lazy
    variants) is named in one ``UserWarning``. The replacements share the
    original Parameter and buffer tensors and keep ``training``,
    ``requires_grad``, device, dtype, attributes and hooks; children are
    replaced in place and the root is returned (or its replacement, if the root
    itself is a BatchNorm). Converting twice changes nothing.

    With ``fuse=True`` it also fuses each BatchNorm with the activation after
    it (``ReLU``/``LeakyReLU``/``SiLU`` modules, ``F.relu``/``F.leaky_relu``/
    ``F.silu``/``torch.relu`` calls), and with a residual ``+`` between them,
    into :class:`BatchNormAct2d` (1d/3d, :class:`SyncBatchNormAct`), found by
    ``torch.fx`` symbolic tracing (see :mod:`torch_bn_grad._conversion.fuse`), and fuses
    timm's ``BatchNormAct2d`` where its act allows. Pairs
    inside an ``nn.Sequential`` are fused in place (the activation becomes an
    ``nn.Identity``) and the model keeps its class; other patterns make the
    returned model a ``torch.fx.GraphModule`` with the same state_dict. Use the
    returned model. What is not fused stays converted, unfused, named in a
    ``UserWarning``. ``memory_saving=True`` (with ``fuse``) sets
    ``memory_saving`` on the fused modules whose activation allows it
    (identity, leaky_relu with a positive slope).

    ``skip_nonfinite_stats`` True or False sets that switch (:class:`BatchNormBase`) on every
    batch norm of ours in the result; None leaves each's, new ones with the config's.
    """
    if memory_saving and not fuse:
        raise ValueError("convert_batchnorm: memory_saving=True needs fuse=True")
    if skip_nonfinite_stats is not None:
        skip_nonfinite_setting("convert_batchnorm", skip_nonfinite_stats)  # checked before anything changes
    if fuse:
        module = _fuse.fuse(module, TARGETS, sync, process_group, subclasses, memory_saving)
    else:
        conversion = _convert.Conversion(TARGETS, sync, process_group, subclasses)
        module = conversion.tree(module)
        conversion.skipped.warn(stacklevel=2)
    if skip_nonfinite_stats is not None:
        for child in module.modules():
            if isinstance(child, BatchNormBase):
                child.skip_nonfinite_stats = skip_nonfinite_stats
    return module


def __getattr__(name: str) -> type:
    """A class that ``convert_batchnorm`` derived from a subclass, rebuilt by name when unpickling."""
    return _convert.rebuild(name, TARGETS, __name__)
