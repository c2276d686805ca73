"""The main job: train a small ResNet-style CNN with torch_bn_grad's BatchNorm.

Built-in synthetic data (no download): each class is a fixed random pattern,
and an image is its class's pattern, randomly shifted, under Gaussian noise.
Prints the loss and accuracy per epoch, a gradcheck verdict for our BatchNorm,
and the median training-step time against the same model with torch's BatchNorm,
ours as a drop-in and ours fused with the activations (convert_batchnorm(fuse=True)).

    python examples/train.py [--epochs 4] [--batch-size 64] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

import torch_bn_grad


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


def make_model(classes: int) -> nn.Module:
    """A small ResNet with torch's BatchNorm layers (convert them to ours)."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        ResidualBlock(32),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        ResidualBlock(64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 64, bias=False), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Linear(64, classes),
    )


def synthetic_data(n: int, classes: int, size: int, generator: torch.Generator):
    """Images of class patterns, randomly shifted, under Gaussian noise."""
    patterns = torch.randn(classes, 3, size, size, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    images = patterns[labels]
    shifts = torch.randint(-2, 3, (n, 2), generator=generator)
    for i in range(n):
        images[i] = torch.roll(images[i], shifts=tuple(shifts[i].tolist()), dims=(1, 2))
    images = images + torch.randn(images.shape, generator=generator)
    return images.contiguous(memory_format=torch.channels_last), labels


def gradcheck_verdict() -> bool:
    """gradcheck and gradgradcheck (float64) of our BatchNorm2d in training and eval."""
    g = torch.Generator().manual_seed(0)
    ok = True
    for training in (True, False):
        bn = torch_bn_grad.nn.BatchNorm2d(3).double().train(training)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5, generator=g)
            bn.bias.normal_(generator=g)
            bn.running_var.uniform_(0.5, 1.5, generator=g)
        x = torch.randn(2, 3, 3, 2, dtype=torch.float64, generator=g, requires_grad=True)
        w = torch.randn(2, 3, 3, 2, dtype=torch.float64, generator=g)
        # Weighted output: a uniform upstream gradient would hide most of the gradient.
        fn = lambda x, weight, bias: torch.func.functional_call(  # noqa: E731
            bn, {"weight": weight, "bias": bias}, (x,)) * w
        args = (x, bn.weight, bn.bias)
        ok &= torch.autograd.gradcheck(fn, args) and torch.autograd.gradgradcheck(fn, args)
    return ok


def step_times(model: nn.Module, images, labels, batch: int, steps: int) -> list[float]:
    """Wall time of `steps` full training steps (forward, backward, SGD)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(steps + 2):
        x, y = images[:batch], labels[:batch]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - t0)
    return times


@dataclass
class Setup:
    """What every example starts from: options, generator, data split, a torch model."""

    args: argparse.Namespace
    generator: torch.Generator
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    reference: nn.Module


def setup(description: str, default_epochs: int) -> Setup:
    """Parses the examples' common options, seeds, prints the header, builds the data and model."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=default_epochs)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--image-size", type=int, default=24)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--timing-steps", type=int, default=45)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"torch_bn_grad CPU kernels: {torch_bn_grad.cpu_kernel_isa()}")
    images, labels = synthetic_data(args.samples, args.classes, args.image_size, g)
    split = args.samples * 3 // 4
    reference = make_model(args.classes).to(memory_format=torch.channels_last)
    return Setup(args, g, images[:split], labels[:split], images[split:], labels[split:], reference)


def median_step_times(first: nn.Module, second: nn.Module, s: Setup) -> tuple[float, float]:
    """Median training-step seconds of two models, their steps interleaved in rounds."""
    a, b = [], []
    for _ in range(3):
        a += step_times(first, s.train_x, s.train_y, s.args.batch_size, s.args.timing_steps // 3)
        b += step_times(second, s.train_x, s.train_y, s.args.batch_size, s.args.timing_steps // 3)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    s = setup(__doc__, default_epochs=4)
    args, g, reference = s.args, s.generator, s.reference
    train_x, train_y, test_x, test_y = s.train_x, s.train_y, s.test_x, s.test_y
    split = len(train_x)

    model = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    n_bn = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    print(f"model: {sum(p.numel() for p in model.parameters())} parameters, {n_bn} torch_bn_grad BatchNorm layers")

    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        perm = torch.randperm(split, generator=g)
        total, seen = 0.0, 0
        for i in range(0, split - args.batch_size + 1, args.batch_size):
            idx = perm[i:i + args.batch_size]
            loss = nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            seen += len(idx)
        model.eval()
        with torch.no_grad():
            acc = (model(test_x).argmax(1) == test_y).float().mean().item()
        print(f"epoch {epoch}: train loss {total / seen:.4f}, test accuracy {acc:.3f}")
    print(f"training took {time.perf_counter() - start:.1f} s")

    verdict = gradcheck_verdict()
    print(f"gradcheck + gradgradcheck of torch_bn_grad BatchNorm2d (float64, train and eval): "
          f"{'PASSED' if verdict else 'FAILED'}")

    # Same architecture and weights, torch's BatchNorm vs ours, steps interleaved.
    ours_model = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference))
    med_torch, med_ours = median_step_times(reference, ours_model, s)
    print(f"median training step (batch {args.batch_size}, {args.image_size}x{args.image_size}, channels_last): "
          f"torch BatchNorm {med_torch * 1e3:.2f} ms, torch_bn_grad {med_ours * 1e3:.2f} ms, "
          f"speedup {med_torch / med_ours:.2f}x")
    # BatchNorm -> ReLU and BatchNorm -> add -> ReLU fused into one operator each.
    fused_model = torch_bn_grad.convert_batchnorm(copy.deepcopy(reference), fuse=True)
    med_torch, med_fused = median_step_times(reference, fused_model, s)
    print(f"median training step, fused (convert_batchnorm(fuse=True)): torch BatchNorm {med_torch * 1e3:.2f} ms, "
          f"torch_bn_grad fused {med_fused * 1e3:.2f} ms, speedup {med_torch / med_fused:.2f}x")
    if not verdict:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
