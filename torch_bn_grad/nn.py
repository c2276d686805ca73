"""Drop-in ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` modules and ``convert_batchnorm``."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.batchnorm import SyncBatchNorm as _TorchSyncBatchNorm  # bound here: programs rebind torch.nn's

from torch_bn_grad import _activation, _compat, _convert, _fuse, _script, errors, functional
from torch_bn_grad._lengths import resolve_mask
from torch_bn_grad.distributed import sync_batch_norm
from torch_bn_grad._checks import check_mask
from torch_bn_grad._masked import masked_add_activate, masked_batch_norm, masked_batch_norm_act
from torch_bn_grad._running_stats import skip_nonfinite_setting

__all__ = [
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
    "BatchNormAct1d", "BatchNormAct2d", "BatchNormAct3d", "SyncBatchNormAct",
    "convert_batchnorm",
]


# What ``_BatchNorm.forward`` normalizes with, as the modules choose it: (running_mean,
# running_var, use_batch_stats, momentum factor: a tensor for the cumulative average).
# A plain tuple: a NamedTuple's construction costs a small eval forward a few percent.
Statistics = tuple[Optional[Tensor], Optional[Tensor], bool, Union[float, Tensor]]


class FusedForward:
    """The forward shared by the modules: torch's ``_BatchNorm.forward`` semantics
    on this library's operators. ``momentum=None`` (cumulative average) keeps
    its factor a tensor, so that it traces without a graph break.

    Parameters and buffers are read from ``_parameters`` and ``_buffers``, where
    ``nn.Module.__setattr__`` (and ``torch.func.functional_call``) put them:
    ``nn.Module.__getattr__``'s lookups of ``weight`` and ``running_mean`` would
    be a large share of a small eval forward.

    ``skip_nonfinite_stats`` (keyword-only; None: ``config.skip_nonfinite_stats``):
    a training batch whose statistics are not finite leaves ``running_mean``,
    ``running_var`` and ``num_batches_tracked`` as they were (see
    :func:`torch_bn_grad.functional.batch_norm`). An attribute, not a buffer:
    state_dicts stay torch's."""

    # Torch's behaviour for pickles of versions without it; unannotated: TorchScript reads annotations as strings.
    skip_nonfinite_stats = False

    def __init__(self, *args: Any, skip_nonfinite_stats: Optional[bool] = None, **kwargs: Any) -> None:
        """The constructor arguments of the torch class it derives from, then ``skip_nonfinite_stats``."""
        super().__init__(*args, **kwargs)
        self.skip_nonfinite_stats = skip_nonfinite_setting(type(self).__name__, skip_nonfinite_stats)

    def _affine(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        parameters = self._parameters
        return parameters.get("weight"), parameters.get("bias")

    def forward(self, input: Tensor, mask: Optional[Tensor] = None, lengths: Optional[Tensor] = None) -> Tensor:
        """``mask`` (padded batches, see :func:`torch_bn_grad.functional.batch_norm`): bool
        of ``input``'s shape without dim 1, True at valid positions; or, for (N, C, L)
        input, ``lengths``: int (N,), sample i valid at positions ``[0, lengths[i])``."""
        self._check_input_dim(input)
        if torch.jit.is_scripting():  # a compile-time constant: TorchScript compiles this branch only
            return self._scripted_normalize(input, resolve_mask("batch_norm", input, mask, lengths))
        if mask is not None or lengths is not None:  # no torch forward for graph tools: torch has no masked batch norm
            return self._masked_forward(input, mask, lengths)
        if self._runs_torch_forward():
            return _BatchNorm.forward(self, input)
        return self._normalize(input, self._statistics())

    def _masked_forward(self, input: Tensor, mask: Optional[Tensor], lengths: Optional[Tensor]) -> Tensor:
        try:  # not in forward, which TorchScript compiles
            mask = resolve_mask(type(self).__name__, input, mask, lengths)
            check_mask(type(self).__name__, input, mask)  # before num_batches_tracked counts the batch
            return self._normalize_masked(input, mask, self._statistics())
        except (ValueError, TypeError) as error:  # as functional.batch_norm's: see errors.py
            raise errors.torch_compatible(error) from None

    def _scripted_normalize(self, input: Tensor, mask: Optional[Tensor]) -> Tensor:
        """The batch norm as TorchScript compiles it (see _script.py)."""
        return _script.module_forward(
            input, mask, self.weight, self.bias, self.running_mean, self.running_var, self.num_batches_tracked,
            self.training, self.track_running_stats, self.momentum, self.eps, self.skip_nonfinite_stats,
        )

    def _runs_torch_forward(self) -> bool:
        """Whether the forward is torch's ``_BatchNorm.forward``, for the graph
        tools that recognize only torch's batch norm: the ONNX exporters, which
        translate it (see _onnx.py), and ``torch.jit.trace`` in eval mode, whose
        ``aten::batch_norm`` ``torch.jit.freeze`` and ``optimize_for_inference``
        fold into a preceding convolution (scripted modules keep this library's
        operator, _script.py)."""
        return _compat.in_onnx_export() or (not self.training and _compat.jit_tracing())

    def _statistics(self) -> Statistics:
        """What ``_BatchNorm.forward`` normalizes with, counting this batch in
        ``num_batches_tracked``."""
        training, momentum = self.training, self.momentum
        buffers = self._buffers
        running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
        factor = _script.count_batch(buffers.get("num_batches_tracked"), training and self.track_running_stats,
                                     momentum)
        if not training:
            return running_mean, running_var, running_mean is None and running_var is None, factor
        if not self.track_running_stats:
            return None, None, True, factor
        return running_mean, running_var, True, factor

    def _normalize(self, input: Tensor, stats: Statistics) -> Tensor:
        """The batch norm itself, once the module has chosen its statistics."""
        running_mean, running_var, use_batch_stats, momentum = stats
        return functional.batch_norm(input, running_mean, running_var, *self._affine(), use_batch_stats, momentum,
                                     self.eps, **self._skipping())

    def _normalize_masked(self, input: Tensor, mask: Tensor, stats: Statistics) -> Tensor:
        """The masked batch norm, once the module has chosen its statistics."""
        running_mean, running_var, use_batch_stats, momentum = stats
        return masked_batch_norm(input, mask, running_mean, running_var, *self._affine(), use_batch_stats, momentum,
                                 self.eps, op=type(self).__name__, **self._skipping())

    def _skipping(self) -> dict[str, Any]:
        """The functional API's ``skip_nonfinite_stats`` arguments (the counter ``_statistics`` counted in)."""
        if not self.skip_nonfinite_stats:
            return {}
        return {"skip_nonfinite_stats": True, "num_batches_tracked": self._buffers.get("num_batches_tracked")}

    def extra_repr(self) -> str:
        text = super().extra_repr()  # type: ignore[misc]
        return text + ", skip_nonfinite_stats=True" if self.skip_nonfinite_stats else text


class BatchNorm1d(FusedForward, torch.nn.BatchNorm1d):
    """Drop-in for :class:`torch.nn.BatchNorm1d` (inputs (N, C) or (N, C, L))."""


class BatchNorm2d(FusedForward, torch.nn.BatchNorm2d):
    """Drop-in for :class:`torch.nn.BatchNorm2d` (inputs (N, C, H, W))."""


class BatchNorm3d(FusedForward, torch.nn.BatchNorm3d):
    """Drop-in for :class:`torch.nn.BatchNorm3d` (inputs (N, C, D, H, W))."""


class SyncBatchNorm(FusedForward, _BatchNorm):
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

    def _normalize(self, input: Tensor, stats: Statistics) -> Tensor:
        group = self._sync_group() if self.training else None
        if group is None:
            return super()._normalize(input, stats)
        running_mean, running_var, _, momentum = stats
        try:
            return sync_batch_norm(input, running_mean, running_var, *self._affine(), momentum, self.eps, group,
                                   **self._skipping())
        except (ValueError, TypeError) as error:  # as functional.batch_norm's: see errors.py
            raise errors.torch_compatible(error) from None

    def _normalize_masked(self, input: Tensor, mask: Tensor, stats: Statistics) -> Tensor:
        group = self._sync_group() if self.training else None
        if group is None:
            return super()._normalize_masked(input, mask, stats)
        running_mean, running_var, _, momentum = stats
        try:
            return sync_batch_norm(input, running_mean, running_var, *self._affine(), momentum, self.eps, group,
                                   mask=mask, **self._skipping())
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


class ActForward(FusedForward):
    """The forward of the fused modules: ``activation(batch_norm(input) + residual)``
    with ``_BatchNorm``'s choice of statistics (shared with :class:`FusedForward`),
    through :func:`torch_bn_grad.functional.batch_norm_act`."""

    def __init__(
        self,
        *args: Any,
        activation: str = "relu",
        negative_slope: float = 0.01,
        memory_saving: bool = False,
        **kwargs: Any,
    ) -> None:
        """The constructor arguments of the BatchNorm class it fuses, then the activation's."""
        if "bias" in kwargs:
            kwargs.update(_compat.batchnorm_bias_kwargs(kwargs.pop("bias")))
        super().__init__(*args, **kwargs)
        self._set_activation(activation, negative_slope, memory_saving)

    def _set_activation(self, activation: str, negative_slope: float, memory_saving: bool) -> None:
        # The operators' check, at construction: a module that builds also runs.
        slope = _activation.check(type(self).__name__, activation, negative_slope, memory_saving)
        self.activation = activation
        self.negative_slope = slope
        self.memory_saving = bool(memory_saving)

    def forward(  # type: ignore[override]
        self, input: Tensor, residual: Optional[Tensor] = None, mask: Optional[Tensor] = None,
        lengths: Optional[Tensor] = None,
    ) -> Tensor:
        """``mask`` or ``lengths`` as in :meth:`BatchNorm1d.forward`: padded positions output 0,
        whatever ``residual`` holds there (one fused operator on the CPU, see
        :func:`torch_bn_grad.functional.batch_norm_act`)."""
        self._check_input_dim(input)
        if torch.jit.is_scripting():  # a compile-time constant, as in FusedForward.forward
            mask = resolve_mask("batch_norm_act", input, mask, lengths)
            y = self._scripted_normalize(input, mask)
            if mask is not None:
                return masked_add_activate(y, mask, residual, self.activation, self.negative_slope)
            return self._add_activate(y, residual)
        if mask is not None or lengths is not None:
            return self._masked_act_forward(input, residual, mask, lengths)
        if self._runs_torch_forward():  # torch's batch norm for graph tools, then the add and activation
            return self._add_activate(_BatchNorm.forward(self, input), residual)
        return self._normalize_act(input, residual, self._statistics())

    def _masked_act_forward(self, input: Tensor, residual: Optional[Tensor], mask: Optional[Tensor],
                            lengths: Optional[Tensor]) -> Tensor:
        try:  # as in FusedForward._masked_forward
            mask = resolve_mask(type(self).__name__, input, mask, lengths)
            check_mask(type(self).__name__, input, mask)
            return self._normalize_masked_act(input, residual, mask, self._statistics())
        except (ValueError, TypeError) as error:
            raise errors.torch_compatible(error) from None

    def _add_activate(self, y: Tensor, residual: Optional[Tensor]) -> Tensor:
        """The add and activation as torch operations, after a normalization that did not fuse them."""
        if residual is not None:
            y = y + residual
        return _activation.activate(y, self.activation, self.negative_slope)

    def _composes(self, input: Tensor, residual: Optional[Tensor]) -> bool:
        """Whether the add and activation run after the normalization (``_add_activate``)
        rather than in the fused operator: for a broadcast or type-promoting residual,
        computed as torch would, unfused."""
        return not _activation.fuses_residual(input, residual)

    def _normalize_act(self, input: Tensor, residual: Optional[Tensor], stats: Statistics) -> Tensor:
        if self._composes(input, residual):
            y = self._normalize(input, stats)
            return self._add_activate(y, residual)
        running_mean, running_var, use_batch_stats, momentum = stats
        return functional.batch_norm_act(
            input, running_mean, running_var, *self._affine(), use_batch_stats, momentum, self.eps,
            residual=residual, activation=self.activation, negative_slope=self.negative_slope,
            memory_saving=self.memory_saving, **self._skipping(),
        )

    def _normalize_masked_act(self, input: Tensor, residual: Optional[Tensor], mask: Tensor,
                              stats: Statistics) -> Tensor:
        if self._composes(input, residual):
            y = self._normalize_masked(input, mask, stats)
            return masked_add_activate(y, mask, residual, self.activation, self.negative_slope)
        running_mean, running_var, use_batch_stats, momentum = stats
        return masked_batch_norm_act(input, mask, running_mean, running_var, *self._affine(), use_batch_stats,
                                     momentum, self.eps, residual, self.activation, self.negative_slope,
                                     op=type(self).__name__, **self._skipping())

    def extra_repr(self) -> str:
        text = f"{super().extra_repr()}, activation={self.activation!r}"
        if self.activation == "leaky_relu":
            text += f", negative_slope={self.negative_slope}"
        if self.memory_saving:
            text += ", memory_saving=True"
        return text


class BatchNormAct1d(ActForward, torch.nn.BatchNorm1d):
    """``activation(BatchNorm1d(input) + residual)`` in one operator; torch's
    ``BatchNorm1d`` state_dict, constructor (plus ``activation``,
    ``negative_slope``, ``memory_saving``) and train/eval behaviour."""


class BatchNormAct2d(ActForward, torch.nn.BatchNorm2d):
    """``activation(BatchNorm2d(input) + residual)`` in one operator; torch's
    ``BatchNorm2d`` state_dict, constructor (plus ``activation``,
    ``negative_slope``, ``memory_saving``) and train/eval behaviour."""


class BatchNormAct3d(ActForward, torch.nn.BatchNorm3d):
    """``activation(BatchNorm3d(input) + residual)`` in one operator; torch's
    ``BatchNorm3d`` state_dict, constructor (plus ``activation``,
    ``negative_slope``, ``memory_saving``) and train/eval behaviour."""


class SyncBatchNormAct(ActForward, SyncBatchNorm):
    """:class:`SyncBatchNorm` followed by the residual add and the activation.

    With whole-group statistics (training, a process group of more than one
    process), the normalization is :class:`SyncBatchNorm`'s and the add and
    activation are composed after it (torch operations, so ``memory_saving``
    saves nothing there); otherwise (eval, no group) it is the fused local
    operator, as :class:`BatchNormAct2d`."""

    def _composes(self, input: Tensor, residual: Optional[Tensor]) -> bool:
        return (self.training and self._sync_group() is not None) or super()._composes(input, residual)


# The classes a conversion produces, for the conversion modules below this one.
TARGETS = _convert.Targets(
    plain={torch.nn.BatchNorm1d: BatchNorm1d, torch.nn.BatchNorm2d: BatchNorm2d, torch.nn.BatchNorm3d: BatchNorm3d},
    sync=SyncBatchNorm,
    forward=FusedForward,
    act_forward=ActForward,
    fused={BatchNorm1d: BatchNormAct1d, BatchNorm2d: BatchNormAct2d, BatchNorm3d: BatchNormAct3d,
           SyncBatchNorm: SyncBatchNormAct},
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
    ``torch.fx`` symbolic tracing (see :mod:`torch_bn_grad._fuse`), and fuses
    timm's ``BatchNormAct2d`` where its act allows. Pairs
    inside an ``nn.Sequential`` are fused in place (the activation becomes an
    ``nn.Identity``) and the model keeps its class; other patterns make the
    returned model a ``torch.fx.GraphModule`` with the same state_dict. Use the
    returned model. What is not fused stays converted, unfused, named in a
    ``UserWarning``. ``memory_saving=True`` (with ``fuse``) sets
    ``memory_saving`` on the fused modules whose activation allows it
    (identity, leaky_relu with a positive slope).

    ``skip_nonfinite_stats`` True or False sets that switch (:class:`FusedForward`) on every
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
            if isinstance(child, FusedForward):
                child.skip_nonfinite_stats = skip_nonfinite_stats
    return module


def __getattr__(name: str) -> type:
    """A class that ``convert_batchnorm`` derived from a subclass, rebuilt by name when unpickling."""
    return _convert.rebuild(name, TARGETS, __name__)
