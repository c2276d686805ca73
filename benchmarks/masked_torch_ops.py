"""A masked BatchNorm1d written from torch operations, the way PyTorch code that
needs one usually writes it: the comparison point of ``benchmarks/masked.py``
(variant ``torch_ops``) and of ``tests/masked/test_masked_vs_torch_ops.py``.

Statistics from masked sums, the variance as E[x^2] - E[x]^2 (biased) in the
data's dtype, the output ``(x - mean) * rsqrt(var + eps) * weight + bias``
everywhere (padded positions hold normalized padding, not zeros), and the
running statistics updated as torch's BatchNorm does, the variance unbiased
with the valid count. Multiplying by the mask reads the padding: a NaN or
inf there reaches every output.
"""

from __future__ import annotations

import torch
from torch import Tensor


class TorchOpsMaskedBatchNorm1d(torch.nn.BatchNorm1d):
    """``forward(x, mask)``: x (N, C, L), mask (N, L) bool, True at valid positions."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        weights = mask.unsqueeze(1).to(x.dtype)  # (N, 1, L)
        if self.training:
            count = weights.sum()
            mean = (x * weights).sum((0, 2)) / count
            var = (x * x * weights).sum((0, 2)) / count - mean * mean
            if self.track_running_stats:
                with torch.no_grad():
                    self.num_batches_tracked += 1
                    factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                    unbiased = var * count / (count - 1)
                    self.running_mean.mul_(1 - factor).add_(factor * mean)
                    self.running_var.mul_(1 - factor).add_(factor * unbiased)
        else:
            mean, var = self.running_mean, self.running_var
        y = (x - mean[:, None]) * torch.rsqrt(var[:, None] + self.eps)
        if self.affine:
            y = y * self.weight[:, None] + self.bias[:, None]
        return y
