"""The split-stage operators: the per-process pieces of a batch norm whose
statistics span several processes (:class:`torch_bn_grad.nn.SyncBatchNorm`).

A training step over a process group runs, on every process:

1. :func:`batch_norm_local_stats` on the local slice of the batch, one
   collective to combine the packed ``(count, mean, m2)`` rows of all processes
   (:func:`combine_stats`), then the forward operator with the combined
   (frozen) mean and variance;
2. in the backward, :func:`batch_norm_grad_sums` about the global mean, one
   collective summing the packed sums, then :func:`batch_norm_grad_input`.

They take 1-D statistics (``src`` of rank 2 to 8, channel axis chosen by
``data_format``); their statistics are float64. They have no autograd
formula of their own: the autograd of a synchronized batch norm is the
composition above (see :mod:`torch_bn_grad.distributed`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_bn_grad._rules.checks import check_data_format, epsilon_value

__all__ = ["batch_norm_local_stats", "batch_norm_grad_sums", "batch_norm_grad_input", "combine_stats"]


def batch_norm_local_stats(src: Tensor, *, data_format: str = "NCX") -> Tensor:
    """Per-channel ``(count, mean, m2)`` of ``src`` as the rows of a ``(3, C)`` float64 tensor.

    ``m2 = sum((src - mean)^2)`` is the centred second moment. An empty ``src``
    gives zeros, which :func:`combine_stats` treats as "no samples".
    """
    check_data_format("batch_norm_local_stats", data_format)
    return torch.ops.torch_bn_grad.batch_norm_local_stats.default(src, data_format)


def batch_norm_grad_sums(src: Tensor, diff_dst: Tensor, mean: Tensor, *, data_format: str = "NCX") -> Tensor:
    """Per-channel ``(sum(diff_dst), sum(diff_dst * (src - mean)))`` as the rows of a ``(2, C)`` float64 tensor.

    ``mean`` (float64, ``(C,)``) is the mean of the whole batch, so that the
    sums of all processes add up to the whole batch's sums.
    """
    check_data_format("batch_norm_grad_sums", data_format)
    return torch.ops.torch_bn_grad.batch_norm_grad_sums.default(src, diff_dst, mean, data_format)


def batch_norm_grad_input(
    src: Tensor,
    diff_dst: Tensor,
    mean: Tensor,
    variance: Tensor,
    gamma: Optional[Tensor],
    count: Tensor,
    grad_sums: Tensor,
    *,
    epsilon: float = 1e-5,
    data_format: str = "NCX",
) -> Tensor:
    """Training-mode ``diff_src`` of the local slice of a batch, from whole-batch quantities.

    ``mean``, ``variance`` (biased) and ``count`` (elements per channel) are the
    whole batch's, float64 of shape ``(C,)``; ``grad_sums`` holds the rows of
    :func:`batch_norm_grad_sums` summed over the whole batch. Returns
    ``g * rstd * (diff_dst - sum_dy / count - (src - mean) * rstd^2 * sum_dy_xc / count)``
    in ``src``'s dtype and memory format.
    """
    op = "batch_norm_grad_input"
    check_data_format(op, data_format)
    return torch.ops.torch_bn_grad.batch_norm_grad_input.default(
        src, diff_dst, mean, variance, gamma, count, grad_sums, epsilon_value(op, epsilon), data_format
    )


def combine_stats(stats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Combines the ``(P, 3, C)`` rows of :func:`batch_norm_local_stats` of P parts.

    Chan et al.'s parallel formula in closed form: with ``n = sum(n_i)``,
    ``mean = sum(n_i * mean_i) / n`` and ``m2 = sum(m2_i) + sum(n_i * (mean_i - mean)^2)``,
    every term centred (no sum of squares). Parts with ``n_i = 0`` contribute
    nothing. Returns ``(count, mean, biased variance)``, each ``(C,)``; with no
    sample at all the mean and variance are 0 (never NaN), and ``count`` tells.
    """
    counts, means, m2s = stats.unbind(1)
    count = counts.sum(0)
    weights = counts / count.clamp_min(1)
    mean = (weights * means).sum(0)
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return count, mean, m2 / count.clamp_min(1)
