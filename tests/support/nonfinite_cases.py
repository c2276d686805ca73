"""The layers and batches of the non-finite statistics tests (tests/modules/test_nonfinite_stats.py, tests/distributed/test_nonfinite_stats_distributed.py).

A case builds this library's module with ``skip_nonfinite_stats`` on or off and
torch's counterpart, and runs a training step on either; the torch step of a
masked case is torch's BatchNorm1d on the valid positions gathered into rows,
which is what the masked batch norm's running statistics follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

import torch_bn_grad
from .masked_reference import lengths_mask

CHANNELS = 3
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[..., torch.nn.Module]  # (momentum, skip) -> ours
    torch_build: Callable[[Optional[float]], torch.nn.Module]
    shape: tuple[int, ...]
    masked: bool = False
    residual: bool = False

    def batch(self, seed: int) -> tuple[Tensor, ...]:
        """(x,), (x, residual) or (x, mask); the mask's padding holds NaN, which must not matter."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.shape, generator=g) * 2 + 1
        if self.residual:
            return x, torch.randn(self.shape, generator=g)
        if self.masked:
            mask = lengths_mask([self.shape[2], 3, 5, 1][: self.shape[0]], self.shape[2])
            return torch.where(mask.unsqueeze(1), x, float("nan")), mask
        return (x,)

    def poisoned(self, seed: int, value: float) -> tuple[Tensor, ...]:
        """A batch with one ``value`` (inf, -inf or NaN) at a valid position of channel 1."""
        batch = self.batch(seed)
        x = batch[0].clone()
        x[0, 1].view(-1)[0] = value
        return (x,) + batch[1:]

    def run(self, module: torch.nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
        if self.residual:
            return module(batch[0], residual=batch[1])
        return module(*batch)

    def run_torch(self, module: torch.nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
        if self.masked:
            x, mask = batch
            return module(x.movedim(1, -1)[mask])  # (valid positions, C)
        out = module(batch[0])
        if self.residual:
            out = torch.relu(out + batch[1])
        return out


CASES = {
    "BatchNorm2d": Case(
        "BatchNorm2d", lambda m, skip: torch_bn_grad.nn.BatchNorm2d(CHANNELS, momentum=m, skip_nonfinite_stats=skip),
        lambda m: torch.nn.BatchNorm2d(CHANNELS, momentum=m), (4, CHANNELS, 5, 6)),
    "BatchNormAct2d": Case(
        "BatchNormAct2d",
        lambda m, skip: torch_bn_grad.nn.BatchNormAct2d(CHANNELS, momentum=m, skip_nonfinite_stats=skip),
        lambda m: torch.nn.BatchNorm2d(CHANNELS, momentum=m), (4, CHANNELS, 5, 6), residual=True),
    "masked BatchNorm1d": Case(
        "masked BatchNorm1d",
        lambda m, skip: torch_bn_grad.nn.BatchNorm1d(CHANNELS, momentum=m, skip_nonfinite_stats=skip),
        lambda m: torch.nn.BatchNorm1d(CHANNELS, momentum=m), (4, CHANNELS, 7), masked=True),
    "SyncBatchNorm": Case(  # no process group here: a local batch norm, as torch's
        "SyncBatchNorm",
        lambda m, skip: torch_bn_grad.nn.SyncBatchNorm(CHANNELS, momentum=m, skip_nonfinite_stats=skip),
        lambda m: torch.nn.BatchNorm2d(CHANNELS, momentum=m), (4, CHANNELS, 5, 6)),
}


def buffers(module: torch.nn.Module) -> dict[str, Tensor]:
    return {name: getattr(module, name).detach().clone() for name in BUFFERS}


def assert_bitwise(actual: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    for name in BUFFERS:
        a, e = actual[name], expected[name]
        assert a.dtype == e.dtype and torch.equal(a.view(-1).view(torch.uint8) if a.is_floating_point() else a,
                                                  e.view(-1).view(torch.uint8) if e.is_floating_point() else e), (
            f"{what}: {name} {a} != {e}")


def assert_as_torch(actual: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    """Running statistics as torch's, the count exactly. Non-finite where torch's are, not
    necessarily alike: a batch mean over an inf is inf in torch's kernels, NaN in the
    compensated sums of this library's."""
    assert torch.equal(actual["num_batches_tracked"], expected["num_batches_tracked"]), what
    for name in BUFFERS[:2]:
        a, e = actual[name], expected[name]
        assert torch.equal(torch.isfinite(a), torch.isfinite(e)), f"{what}: {name} {a} against torch's {e}"
        torch.testing.assert_close(a.nan_to_num(0.0, 0.0, 0.0), e.nan_to_num(0.0, 0.0, 0.0), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: {name}: {m}")


def torch_from(case: Case, momentum: Optional[float], state: dict[str, Tensor]) -> torch.nn.Module:
    """Torch's module holding ``state`` (this library's buffers), in training mode."""
    reference = case.torch_build(momentum)
    reference.load_state_dict({**reference.state_dict(), **state})
    return reference
