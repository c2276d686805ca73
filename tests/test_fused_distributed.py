"""SyncBatchNormAct in a 2-process gloo DistributedDataParallel run: a small
residual model converted with convert_batchnorm(sync=True, fuse=True), each
rank holding an uneven slice of the batch, against torch's BatchNorm + add +
ReLU in one process on the whole batch (float64): outputs, input gradients,
running statistics, and the parameter gradients DDP averages.
"""

from __future__ import annotations

import copy
import datetime
import gc
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torch_bn_grad

WORLD_SIZE = 2
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


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = torch_bn_grad.convert_batchnorm(_model(), sync=True, fuse=True)
        kinds = sorted(type(m).__name__ for m in model.modules() if isinstance(m, torch_bn_grad.nn.SyncBatchNorm))
        ddp = nn.parallel.DistributedDataParallel(model)
        result: dict = {"kinds": kinds, "outputs": [], "input_grads": [], "param_grads": []}
        for step in range(STEPS):
            x, dy = _batch(step)
            x = _local(x, rank).requires_grad_()
            ddp.zero_grad(set_to_none=True)
            y = ddp(x)
            y.backward(_local(dy, rank))
            result["outputs"].append(y.detach())
            result["input_grads"].append(x.grad)
            result["param_grads"].append({n: p.grad for n, p in model.named_parameters()})
        result["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
        # DDP's reducer goes before its process group: destroyed after it, at
        # the worker's exit, it aborted the process now and then (SIGABRT,
        # "terminate called without an active exception", results saved).
        del ddp, model, y, x
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _spawn(out_dir: Path) -> list[dict]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    store = dist.TCPStore("127.0.0.1", 0, WORLD_SIZE, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    context = mp.start_processes(_worker, args=(store.port, str(out_dir)), nprocs=WORLD_SIZE, join=False,
                                 start_method="spawn")
    deadline, done, problem = time.monotonic() + TIMEOUT_S, False, None
    try:
        while not done and time.monotonic() < deadline:
            try:
                done = context.join(timeout=1)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
                problem = f"a worker failed: {error}"
                break
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    errors = [p.read_text() for p in sorted(out_dir.glob("*.error"))]
    assert not errors, "worker failed:\n" + "\n".join(errors)
    assert problem is None and done, problem or f"workers did not finish within {TIMEOUT_S} s"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def test_ddp_sync_fused_matches_whole_batch(tmp_path):
    per_rank = _spawn(tmp_path)
    ref = _model()
    for step in range(STEPS):
        x, dy = _batch(step)
        x.requires_grad_()
        ref.zero_grad(set_to_none=True)
        y = ref(x)
        y.backward(dy)
        for rank, got in enumerate(per_rank):
            assert got["kinds"] == ["SyncBatchNormAct", "SyncBatchNormAct"]
            torch.testing.assert_close(got["outputs"][step], _local(y.detach(), rank))
            torch.testing.assert_close(got["input_grads"][step], _local(x.grad, rank))
            for name, p in ref.named_parameters():  # DDP averages: the mean of the ranks' shares
                torch.testing.assert_close(got["param_grads"][step][name] * WORLD_SIZE, p.grad)
    for got in per_rank:
        for name, b in ref.named_buffers():
            torch.testing.assert_close(got["buffers"][name], b)


def test_convert_sync_fuse_without_process_group_is_local():
    model = _model()
    fused = torch_bn_grad.convert_batchnorm(copy.deepcopy(model), sync=True, fuse=True)
    x = _batch(0)[0]
    torch.testing.assert_close(fused(x), model(x))
