"""The fused modules' forward: ``activation(batch_norm(input) + residual)`` with
``_BatchNorm``'s choice of statistics (:class:`BatchNormBase`'s), down the same
paths: TorchScript, masked, torch's forward for graph tools (then the add and
activation as torch operations), or the fused operator (``_forward/plain.py``)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from torch_bn_grad import _compat, errors
from torch_bn_grad._forward import masked, plain
from torch_bn_grad._forward.lengths import resolve_mask
from torch_bn_grad._forward.module import BatchNormBase
from torch_bn_grad._forward.normalization import Normalization
from torch_bn_grad._rules import activation as _activation

__all__ = ["BatchNormActBase"]


class BatchNormActBase(BatchNormBase):
    """The forward of the fused modules: ``activation(batch_norm(input) + residual)``
    with ``_BatchNorm``'s choice of statistics (shared with :class:`BatchNormBase`),
    through the fused operators (:func:`torch_bn_grad.functional.batch_norm_act`'s)."""

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
        """``mask`` or ``lengths`` as in :meth:`BatchNormBase.forward`: padded positions output 0,
        whatever ``residual`` holds there (one fused operator on the CPU, see
        :func:`torch_bn_grad.functional.batch_norm_act`)."""
        self._check_input_dim(input)
        if torch.jit.is_scripting():  # a compile-time constant, as in BatchNormBase.forward
            mask = resolve_mask("batch_norm_act", input, mask, lengths)
            y = self._scripted_normalize(input, mask)
            if mask is not None:
                return masked.masked_add_activate(y, mask, residual, self.activation, self.negative_slope)
            return self._add_activate(y, residual)
        if mask is not None or lengths is not None:
            return self._normalize_masked_act(input, residual, self._resolved_mask(input, mask, lengths),
                                              self._normalization())
        if self._runs_torch_forward():  # torch's batch norm for graph tools, then the add and activation
            return self._add_activate(_BatchNorm.forward(self, input), residual)
        return self._normalize_act(input, residual, self._normalization())

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

    def _normalize_act(self, input: Tensor, residual: Optional[Tensor], norm: Normalization) -> Tensor:
        if self._composes(input, residual):
            return self._add_activate(self._normalize(input, norm), residual)
        try:
            return plain.batch_norm_act(input, norm, residual, self.activation, self.negative_slope,
                                        self.memory_saving, *self._skipping())
        except (ValueError, TypeError) as error:  # as functional.batch_norm_act's: see errors.py
            raise errors.torch_compatible(error) from None

    def _normalize_masked_act(self, input: Tensor, residual: Optional[Tensor], mask: Tensor,
                              norm: Normalization) -> Tensor:
        if self._composes(input, residual):
            y = self._normalize_masked(input, mask, norm)
            return masked.masked_add_activate(y, mask, residual, self.activation, self.negative_slope)
        skip, counter = self._skipping()
        try:
            return masked.batch_norm_act(input, mask, norm, residual, self.activation, self.negative_slope,
                                         type(self).__name__, skip_nonfinite_stats=skip, num_batches_tracked=counter)
        except (ValueError, TypeError) as error:
            raise errors.torch_compatible(error) from None

    def extra_repr(self) -> str:
        text = f"{super().extra_repr()}, activation={self.activation!r}"
        if self.activation == "leaky_relu":
            text += f", negative_slope={self.negative_slope}"
        if self.memory_saving:
            text += ", memory_saving=True"
        return text
