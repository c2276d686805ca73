"""The running-statistics update, in one place (functional, modules, SyncBatchNorm)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from torch_bn_grad import _compat, config
from torch_bn_grad._rules.eager import is_eager


_UPDATE_OP = torch.ops.torch_bn_grad.batch_norm_update_running_stats.default
_COUNTED_UPDATE_OP = torch.ops.torch_bn_grad.batch_norm_update_running_stats.counted


def skip_nonfinite_setting(owner: str, value: Optional[bool]) -> bool:
    """A ``skip_nonfinite_stats`` argument's value (modules, ``convert_batchnorm``):
    ``config.skip_nonfinite_stats`` for None."""
    if value is None:
        return config.skip_nonfinite_stats
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: skip_nonfinite_stats must be a bool or None, got {value!r}")
    return value


def count_batch(
    num_batches_tracked: Optional[Tensor], tracking: bool, momentum: Optional[float]
) -> Union[float, Tensor]:
    """Counts a training batch in ``num_batches_tracked`` (when ``tracking``) and returns
    the running statistics' update factor: ``momentum``, or for ``momentum=None`` the
    cumulative average's ``1 / n``, a tensor (so that it traces without a graph break)
    in float64 (``1 /`` an int64 tensor would be float32, off by 1e-8 relative). TorchScript
    compiles it (the scripted forward's), as the eager modules call it."""
    factor: Union[float, Tensor] = 0.0 if momentum is None else momentum
    if tracking and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        if momentum is None:
            factor = 1.0 / num_batches_tracked.double()
    return factor


def _scalar_count(count: Union[int, Tensor]) -> bool:
    """A 0-dim count tensor (the masked operators' valid count) outside torch.jit.trace,
    which would freeze a value read from it."""
    return type(count) is Tensor and count.dim() == 0 and not _compat.jit_tracing()


def forward_update_applies(input: Tensor, momentum: Union[float, Tensor]) -> bool:
    """Whether a training forward takes its operator's ``.update`` overload (the forward
    and the update in one call): an eager step with a host-known momentum, where the
    update would take its one-call operator with the elements per channel as count."""
    return type(momentum) is float and is_eager(input)


def _one_call_applies(count: Union[int, Tensor], momentum: Union[float, Tensor], mean: Tensor) -> bool:
    """Eager steps with host-known count and momentum take the operator (one call,
    the same roundings)."""
    return type(count) is int and forward_update_applies(mean, momentum)


def _device_count_applies(count: Union[int, Tensor], momentum: Union[float, Tensor], mean: Tensor) -> bool:
    """A 0-dim count on the statistics' GPU (the masked operators' valid count) in an
    eager step: the operator reads it there, in the update's one kernel."""
    return (_scalar_count(count) and count.device == mean.device and count.device.type != "cpu"
            and type(momentum) is float and is_eager(mean))


def _host_count(count: Union[int, Tensor]) -> Union[int, Tensor]:
    """A 0-dim CPU count tensor (the masked operators') as an int in eager steps, so that
    the update takes the operator: reading it waits for no device, and the tensor
    arithmetic would be a dozen small operators, a large share of a small layer's step."""
    if _scalar_count(count) and count.device.type == "cpu" and is_eager(count):
        return int(count)
    return count


def update_running_stats(
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    mean: Tensor,
    variance: Tensor,
    count: Union[int, Tensor],
    momentum: Union[float, Tensor],
    skip_nonfinite: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> None:
    """``running += momentum * (batch - running)`` in place, ``running_var`` with the
    unbiased variance, as torch's BatchNorm does.

    ``count`` is the number of elements per channel: an ``int`` known on the host
    (0: nothing changes), or a tensor (SyncBatchNorm: the whole batch's count,
    decided on the device without a host synchronization). ``momentum`` may be a
    tensor (the modules' cumulative average), so that it traces without a graph break.
    ``skip_nonfinite`` and ``num_batches_tracked``: see :func:`update_with_count_tensor`.
    """
    if skip_nonfinite:
        # The operators update unconditionally: the tensor arithmetic's blend decides
        # on the device (one count tensor per step: a fill, no copy from the host).
        if not isinstance(count, Tensor):
            if count == 0:
                return
            count = torch.full((), count, dtype=torch.float64, device=mean.device)
        update_with_count_tensor(running_mean, running_var, mean, variance, count, momentum, True,
                                 num_batches_tracked)
        return
    count = _host_count(count)
    if _one_call_applies(count, momentum, mean):
        # Not detached: the operator's Autograd kernel runs it below autograd, recording nothing.
        _UPDATE_OP(running_mean, running_var, mean, variance, count, momentum)
        return
    if _device_count_applies(count, momentum, mean):
        _COUNTED_UPDATE_OP(running_mean, running_var, mean, variance, count, momentum)
        return
    if isinstance(count, Tensor):
        update_with_count_tensor(running_mean, running_var, mean, variance, count, momentum)
        return
    # An int, or a SymInt under torch.compile.
    if count == 0:
        return
    # Detached rather than under no_grad (a context costs more than the update on small layers):
    # the buffers never require grad, so nothing is recorded.
    mean, variance = mean.detach(), variance.detach()
    bessel = count / (count - 1) if count > 1 else 1.0
    for running, batch in ((running_mean, mean), (running_var, variance * bessel)):
        if running is not None:
            running.lerp_(batch.to(running.dtype), momentum)


def update_with_count_tensor(
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    mean: Tensor,
    variance: Tensor,
    count: Tensor,
    momentum: Union[float, Tensor],
    skip_nonfinite: bool = False,
    num_batches_tracked: Optional[Tensor] = None,
) -> None:
    """The update for a ``count`` tensor (0-dim, or one per channel) in tensor arithmetic,
    the count never read on the host: no change where it is 0, the variance unbiased
    with it (count 1: the variance itself). TorchScript compiles it: the scripted
    modules' update (``_forward/scripted.py``).

    ``skip_nonfinite``: a batch whose mean or unbiased variance, in the buffers' dtype,
    is not finite in some counted channel changes neither buffer, decided on the device
    (no host synchronization); ``num_batches_tracked``, the counter that already counted
    this batch (``_BatchNorm.forward`` counts it first), then loses it again."""
    mean, variance = mean.detach(), variance.detach()  # as in update_running_stats: nothing recorded
    bessel = count / (count - 1).clamp_min(1)
    seen = count > 0
    batch_mean = mean if running_mean is None else mean.to(running_mean.dtype)
    batch_var = variance * bessel
    if running_var is not None:
        batch_var = batch_var.to(running_var.dtype)
    if skip_nonfinite:
        bad = _nonfinite(batch_mean, seen, running_mean is not None) | _nonfinite(batch_var, seen,
                                                                                   running_var is not None)
        seen = seen & ~bad
        if num_batches_tracked is not None:
            num_batches_tracked.sub_(bad.to(num_batches_tracked.dtype))
    if running_mean is not None:
        running_mean.copy_(torch.where(seen, _lerp(running_mean, batch_mean, momentum), running_mean))
    if running_var is not None:
        running_var.copy_(torch.where(seen, _lerp(running_var, batch_var, momentum), running_var))


def _nonfinite(batch: Tensor, seen: Tensor, updates: bool) -> Tensor:
    """0-dim bool: whether a statistic that updates a buffer is not finite in a counted channel."""
    if not updates:
        return torch.zeros((), dtype=torch.bool, device=batch.device)
    return (seen & ~torch.isfinite(batch)).any()


def _lerp(running: Tensor, batch: Tensor, momentum: Union[float, Tensor]) -> Tensor:
    """``running.lerp(batch, momentum)`` in running's dtype."""
    # Two calls: TorchScript picks lerp's overload (Scalar or Tensor weight) by the weight's static type.
    if isinstance(momentum, float):
        return running.lerp(batch.to(running.dtype), momentum)
    return running.lerp(batch.to(running.dtype), momentum)
