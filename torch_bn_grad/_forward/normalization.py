"""What a forward path normalizes with, one value that every path takes:
``(running_mean, running_var, weight, bias, training, momentum, eps)`` in
``torch.nn.functional.batch_norm``'s order and meaning (``training``: normalize
with the batch's statistics; ``momentum`` may be a 0-dim tensor, the modules'
cumulative average). The functional API builds it from its arguments, the
modules from their parameters, buffers and choice of statistics."""

from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

__all__ = ["Normalization"]

# A plain tuple: a NamedTuple's construction costs a small eval forward a few percent.
Normalization = tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor], bool,
                      Union[float, Tensor], float]
