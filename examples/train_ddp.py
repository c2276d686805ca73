"""Data-parallel training with DistributedDataParallel and torch_bn_grad's SyncBatchNorm.

The model and data of examples/common.py. Each process trains on its own slice
of every batch (the slices may differ in size); the BatchNorm statistics and
gradients span the whole batch. Runs on CPU with gloo (on CUDA with nccl when
every process has a GPU):

    torchrun --nproc_per_node 2 examples/train_ddp.py [--epochs 3] [--batch-size 64]

Prints the loss and accuracy per epoch (rank 0), then checks that the first
SyncBatchNorm layer matches one BatchNorm on the whole batch.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_bn_grad
from common import make_model, synthetic_data  # this script's directory


def local_slice(batch: int, rank: int, world: int) -> slice:
    """This rank's part of a batch, uneven on purpose: rank r gets about (r + 1) shares."""
    shares = [r + 1 for r in range(world)]
    bounds = [batch * sum(shares[:r]) // sum(shares) for r in range(world + 1)]
    return slice(bounds[rank], bounds[rank + 1])


def whole_batch_check(model: nn.Module, batch: int, rank: int, world: int) -> float:
    """Largest difference between the first SyncBatchNorm's input gradient on this rank's slice
    and that of the same layer, as torch's BatchNorm2d, on the whole batch in one process (float64)."""
    layer = next(m for m in model.modules() if isinstance(m, torch_bn_grad.nn.SyncBatchNorm))
    device = layer.weight.device
    single = torch.nn.BatchNorm2d(layer.num_features).to(device, torch.float64)
    single.load_state_dict(layer.state_dict())
    x = torch.randn(batch, layer.num_features, 6, 6, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(7)).to(device)
    part = local_slice(batch, rank, world)
    x_all, x_own = x.clone().requires_grad_(), x[part].clone().requires_grad_()
    synced = copy.deepcopy(layer).double().train()
    (single(x_all) ** 2).sum().backward()
    (synced(x_own) ** 2).sum().backward()
    return (x_own.grad - x_all.grad[part]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="whole batch, over all processes")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--image-size", type=int, default=24)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    log = print if rank == 0 else (lambda *a, **k: None)

    # Every rank builds the same data and model (same seed); each trains on its own slice.
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    images, labels = synthetic_data(args.samples, args.classes, args.image_size, g)
    split = args.samples * 3 // 4
    train_x, train_y = images[:split].to(device), labels[:split].to(device)
    test_x, test_y = images[split:].to(device), labels[split:].to(device)

    model = make_model(args.classes).to(device, memory_format=torch.channels_last)
    model = torch_bn_grad.convert_batchnorm(model, sync=True)
    n_bn = sum(isinstance(m, torch_bn_grad.nn.SyncBatchNorm) for m in model.modules())
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    part = local_slice(args.batch_size, rank, world)
    sizes = [len(range(args.batch_size)[local_slice(args.batch_size, r, world)]) for r in range(world)]
    log(f"torch {torch.__version__}, {world} processes ({dist.get_backend()}), "
        f"{n_bn} torch_bn_grad SyncBatchNorm layers, whole batch {args.batch_size} split {sizes}")

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        ddp.train()
        perm = torch.randperm(split, generator=g).to(device)
        total = torch.zeros((), device=device)
        seen = 0
        for i in range(0, split - args.batch_size + 1, args.batch_size):
            idx = perm[i:i + args.batch_size][part]
            # This slice's summed loss times world / batch: DDP averages the gradients over
            # the processes, which gives the gradient of the whole batch's mean loss.
            loss = nn.functional.cross_entropy(ddp(train_x[idx]), train_y[idx], reduction="sum")
            opt.zero_grad(set_to_none=True)
            (loss * world / args.batch_size).backward()
            opt.step()
            total += loss.detach()
            seen += args.batch_size
        dist.all_reduce(total)
        ddp.eval()
        with torch.no_grad():
            acc = (ddp(test_x).argmax(1) == test_y).float().mean().item()
        log(f"epoch {epoch}: train loss {total.item() / seen:.4f}, test accuracy {acc:.3f}")
    log(f"training took {time.perf_counter() - start:.1f} s")

    diff = torch.tensor([whole_batch_check(model, args.batch_size, rank, world)], device=device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    log(f"SyncBatchNorm input gradient vs one BatchNorm on the whole batch (float64): "
        f"max difference {diff.item():.2e}")
    # DDP keeps the replicas identical: compare every rank's parameters with rank 0's.
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    rank0 = mine.clone()
    dist.broadcast(rank0, 0)
    identical = torch.tensor([int(torch.equal(mine, rank0))], device=device)
    dist.all_reduce(identical, op=dist.ReduceOp.MIN)
    log(f"replicas identical after training: {bool(identical.item())}")
    dist.destroy_process_group()
    if diff.item() > 1e-10 or not identical.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
