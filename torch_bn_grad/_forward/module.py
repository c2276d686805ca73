"""The modules' forward: torch's ``_BatchNorm.forward`` semantics on this library's
operators, shared by every BatchNorm module of ``torch_bn_grad.nn``.

``forward`` picks its path once and goes down it: TorchScript
(``_forward/scripted.py``), masked (``_forward/masked.py``), torch's own forward
for the graph tools that know only torch's batch norm, or the unmasked batch
norm (``_forward/plain.py``). The module's part is choosing the statistics
and counting the batch as ``_BatchNorm.forward`` does (``_normalization``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from torch_bn_grad import _compat, errors
from torch_bn_grad._forward import masked, plain, scripted
from torch_bn_grad._forward.lengths import resolve_mask
from torch_bn_grad._forward.normalization import Normalization
from torch_bn_grad._rules.checks import check_mask
from torch_bn_grad._rules.running_stats import count_batch, skip_nonfinite_setting

__all__ = ["BatchNormBase"]


class BatchNormBase:
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

    def forward(self, input: Tensor, mask: Optional[Tensor] = None, lengths: Optional[Tensor] = None) -> Tensor:
        """``mask`` (padded batches, see :func:`torch_bn_grad.functional.batch_norm`): bool
        of ``input``'s shape without dim 1, True at valid positions; or, for (N, C, L)
        input, ``lengths``: int (N,), sample i valid at positions ``[0, lengths[i])``."""
        self._check_input_dim(input)
        if torch.jit.is_scripting():  # a compile-time constant: TorchScript compiles this branch only
            return self._scripted_normalize(input, resolve_mask("batch_norm", input, mask, lengths))
        if mask is not None or lengths is not None:  # no torch forward for graph tools: torch has no masked batch norm
            return self._normalize_masked(input, self._resolved_mask(input, mask, lengths), self._normalization())
        if self._runs_torch_forward():
            return _BatchNorm.forward(self, input)
        return self._normalize(input, self._normalization())

    # ------------------------------------------------------------ what every path shares
    def _skipping(self) -> tuple[bool, Optional[Tensor]]:
        """The path functions' ``skip_nonfinite_stats`` and ``num_batches_tracked`` (the
        counter ``_normalization`` counted in)."""
        if not self.skip_nonfinite_stats:
            return False, None
        return True, self._buffers.get("num_batches_tracked")

    def _normalization(self) -> Normalization:
        """What ``_BatchNorm.forward`` normalizes with (the running statistics or the
        batch's, and the update factor), counting this batch in ``num_batches_tracked``."""
        training, momentum = self.training, self.momentum
        buffers, parameters = self._buffers, self._parameters
        running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
        weight, bias = parameters.get("weight"), parameters.get("bias")
        factor = count_batch(buffers.get("num_batches_tracked"), training and self.track_running_stats, momentum)
        if not training:
            return running_mean, running_var, weight, bias, running_mean is None and running_var is None, factor, \
                self.eps
        if not self.track_running_stats:
            return None, None, weight, bias, True, factor, self.eps
        return running_mean, running_var, weight, bias, True, factor, self.eps

    def _runs_torch_forward(self) -> bool:
        """Whether the forward is torch's ``_BatchNorm.forward``, for the graph
        tools that recognize only torch's batch norm: the ONNX exporters, which
        translate it (see _interop/onnx.py), and ``torch.jit.trace`` in eval mode, whose
        ``aten::batch_norm`` ``torch.jit.freeze`` and ``optimize_for_inference``
        fold into a preceding convolution (scripted modules keep this library's
        operator, _forward/scripted.py)."""
        return _compat.in_onnx_export() or (not self.training and _compat.jit_tracing())

    # ------------------------------------------------------------ the paths
    def _scripted_normalize(self, input: Tensor, mask: Optional[Tensor]) -> Tensor:
        """The batch norm as TorchScript compiles it (see _forward/scripted.py)."""
        return scripted.module_forward(
            input, mask, self.weight, self.bias, self.running_mean, self.running_var, self.num_batches_tracked,
            self.training, self.track_running_stats, self.momentum, self.eps, self.skip_nonfinite_stats,
        )

    def _resolved_mask(self, input: Tensor, mask: Optional[Tensor], lengths: Optional[Tensor]) -> Tensor:
        """The checked mask of ``mask=`` or ``lengths=``, before ``_normalization`` counts the batch."""
        try:  # not in forward, which TorchScript compiles
            mask = resolve_mask(type(self).__name__, input, mask, lengths)
            check_mask(type(self).__name__, input, mask)
            return mask
        except (ValueError, TypeError) as error:  # as functional.batch_norm's: see errors.py
            raise errors.torch_compatible(error) from None

    def _normalize(self, input: Tensor, norm: Normalization) -> Tensor:
        """The unmasked batch norm, once the module has chosen its statistics."""
        try:
            return plain.batch_norm(input, norm, *self._skipping())
        except (ValueError, TypeError) as error:  # as functional.batch_norm's: see errors.py
            raise errors.torch_compatible(error) from None

    def _normalize_masked(self, input: Tensor, mask: Tensor, norm: Normalization) -> Tensor:
        """The masked batch norm, once the module has chosen its statistics."""
        skip, counter = self._skipping()
        try:
            return masked.batch_norm(input, mask, norm, type(self).__name__, skip_nonfinite_stats=skip,
                                     num_batches_tracked=counter)
        except (ValueError, TypeError) as error:
            raise errors.torch_compatible(error) from None

    def extra_repr(self) -> str:
        text = super().extra_repr()  # type: ignore[misc]
        return text + ", skip_nonfinite_stats=True" if self.skip_nonfinite_stats else text
