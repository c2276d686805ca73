"""SyncBatchNorm on CUDA tensors: two processes sharing one GPU, on NCCL where
it accepts that (NCCL refuses two ranks on one device), else on gloo with CUDA
tensors, against torch's single-process BatchNorm on the whole batch in
float64; and a world of one NCCL process, which runs as a local BatchNorm.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_bn_grad
from support.recorded_steps import record_steps
from support.reference import TOLERANCES
from support.spawned_ranks import WORLD_SIZE, run_on_ranks

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_available()),
                                reason="needs a CUDA device and torch.distributed")

SIZES = (5, 3)  # per-rank batch sizes: uneven
assert len(SIZES) == WORLD_SIZE
ITEM = (6, 7, 5)  # (C, H, W)
STEPS = 2
TIMEOUT_S = 180


def _module() -> torch.nn.BatchNorm2d:
    bn = torch.nn.BatchNorm2d(ITEM[0])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=g)
        bn.bias.normal_(generator=g)
    return bn


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (sum(SIZES), *ITEM)
    return torch.randn(shape, generator=g, dtype=torch.float64) * (step + 1) + step, \
        torch.randn(shape, generator=g, dtype=torch.float64)


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[sum(SIZES[:rank]):sum(SIZES[:rank + 1])]


def _train(rank: int) -> dict:
    """This rank's steps with our SyncBatchNorm on its slice, on CUDA tensors (the ranks
    share device 0 where only one GPU is visible)."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    model = torch_bn_grad.convert_batchnorm(_module(), sync=True).cuda().float()
    batches = ((_local(x, rank).float().cuda().contiguous(memory_format=torch.channels_last),
                _local(dy, rank).float().cuda()) for x, dy in map(_batch, range(STEPS)))
    return record_steps(model, model, batches, keep=torch.Tensor.cpu)


def _reference() -> dict:
    model = _module().double()
    return record_steps(model, model, map(_batch, range(STEPS)))


def _close(actual, expected, what, scale=1.0):
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol["atol"] * scale, rtol=tol["rtol"],
                               msg=lambda m: f"{what}: {m}")


def test_two_processes_on_one_gpu_match_the_whole_batch(tmp_path):
    backend = "nccl"
    try:
        per_rank = run_on_ranks(_train, (), tmp_path / "nccl", TIMEOUT_S, backend="nccl")
    except (AssertionError, pytest.skip.Exception) as nccl_refused:  # e.g. two ranks on one GPU
        backend = "gloo"
        print(f"NCCL did not run ({str(nccl_refused).splitlines()[-1]}): gloo carries the CUDA tensors")
        per_rank = run_on_ranks(_train, (), tmp_path / "gloo", TIMEOUT_S, backend="gloo")
    print(f"SyncBatchNorm on CUDA tensors ran on {backend}")
    ref = _reference()
    count = sum(SIZES) * ITEM[1] * ITEM[2]
    for step in range(STEPS):
        for rank, got in enumerate(per_rank):
            where = f"{backend}, step {step}, rank {rank}"
            _close(got["outputs"][step], _local(ref["outputs"][step], rank), f"output, {where}")
            _close(got["input_grads"][step], _local(ref["input_grads"][step], rank), f"input gradient, {where}", 2)
            for name, theirs in ref["running"][step].items():
                _close(got["running"][step][name], theirs, f"running statistic {name}, {where}")
        for name, expected in ref["param_grads"][step].items():
            summed = sum(got["param_grads"][step][name].double() for got in per_rank)
            _close(summed, expected, f"parameter {name} gradient summed over ranks, {backend}, step {step}", count)


def test_world_of_one_nccl_process_runs_as_local_batch_norm():
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        torch_bn = _module().cuda()
        ours = torch_bn_grad.convert_batchnorm(_module(), sync=True).cuda()
        x = torch.randn(4, *ITEM, device="cuda", requires_grad=True)
        x_ours = x.detach().clone().requires_grad_()
        dy = torch.randn(4, *ITEM, device="cuda")
        expected = torch_bn(x)
        expected.backward(dy)
        out = ours(x_ours)
        out.backward(dy)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(ours.buffers(), torch_bn.buffers()):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_ours.grad, x.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.weight.grad, torch_bn.weight.grad, rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()
