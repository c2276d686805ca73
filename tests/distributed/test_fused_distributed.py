"""SyncBatchNormAct in a 2-process gloo DistributedDataParallel run: a small
residual model converted with convert_batchnorm(sync=True, fuse=True), each
rank holding an uneven slice of the batch, against torch's BatchNorm + add +
ReLU in one process on the whole batch (float64): outputs, input gradients,
running statistics, and the parameter gradients DDP averages.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import torch_bn_grad
from support.recorded_steps import record_steps
from support.spawned_ranks import WORLD_SIZE, run_on_ranks

SIZES = (3, 2)  # per-rank batch sizes
STEPS = 2
TIMEOUT_S = 180


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Sequential(nn.BatchNorm2d(3), nn.LeakyReLU(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x)) + x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Block().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randn(sum(SIZES), 3, 4, 4, generator=g, dtype=torch.float64) * (step + 1),
            torch.randn(sum(SIZES), 3, 4, 4, generator=g, dtype=torch.float64))


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(SIZES[:rank])
    return t[start:start + SIZES[rank]]


def _train(rank: int) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch_bn_grad.convert_batchnorm(_model(), sync=True, fuse=True)
    kinds = sorted(type(m).__name__ for m in model.modules() if isinstance(m, torch_bn_grad.nn.SyncBatchNorm))
    ddp = nn.parallel.DistributedDataParallel(model)
    batches = ((_local(x, rank), _local(dy, rank)) for x, dy in map(_batch, range(STEPS)))
    return {"kinds": kinds, **record_steps(ddp, model, batches)}


def test_ddp_sync_fused_matches_whole_batch(tmp_path):
    per_rank = run_on_ranks(_train, (), tmp_path, TIMEOUT_S)
    ref_model = _model()
    ref = record_steps(ref_model, ref_model, map(_batch, range(STEPS)))
    for step in range(STEPS):
        for rank, got in enumerate(per_rank):
            assert got["kinds"] == ["SyncBatchNormAct", "SyncBatchNormAct"]
            torch.testing.assert_close(got["outputs"][step], _local(ref["outputs"][step], rank))
            torch.testing.assert_close(got["input_grads"][step], _local(ref["input_grads"][step], rank))
            for name, grad in ref["param_grads"][step].items():  # DDP averages: the mean of the ranks' shares
                torch.testing.assert_close(got["param_grads"][step][name] * WORLD_SIZE, grad)
            for name, buffer in ref["running"][step].items():
                torch.testing.assert_close(got["running"][step][name], buffer)


def test_convert_sync_fuse_without_process_group_is_local():
    model = _model()
    fused = torch_bn_grad.convert_batchnorm(copy.deepcopy(model), sync=True, fuse=True)
    x = _batch(0)[0]
    torch.testing.assert_close(fused(x), model(x))
