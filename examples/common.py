"""What the examples share (not an example itself): the small ResNet-style
model, its synthetic data (no download), the common options, the training
loop, and the timing of training steps.

The data: each class is a fixed random pattern, and an image is its class's
pattern, randomly shifted, under Gaussian noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

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


@dataclass
class Setup:
    """What an example starts from: options, generator, data split, a torch model."""

    args: argparse.Namespace
    generator: torch.Generator
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    reference: nn.Module


def options(description: str, default_epochs: Optional[int]) -> argparse.ArgumentParser:
    """The options every single-process example takes (``--epochs`` where it trains)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if default_epochs is not None:
        parser.add_argument("--epochs", type=int, default=default_epochs)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--image-size", type=int, default=24)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def setup(args: argparse.Namespace) -> Setup:
    """Seeds, prints the header, builds the data and the torch model."""
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


def train_step(run: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
    """Forward (``run``: the model or its compiled form), backward and an optimizer step; the loss."""
    loss = nn.functional.cross_entropy(run(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def fit(model: nn.Module, s: Setup, run: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
    """Trains ``model`` for ``s.args.epochs`` epochs (SGD with momentum), calling ``run``
    (default: the model) for its forward; prints the loss and test accuracy per epoch."""
    run = model if run is None else run
    batch, split = s.args.batch_size, len(s.train_x)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    start = time.perf_counter()
    for epoch in range(1, s.args.epochs + 1):
        model.train()
        perm = torch.randperm(split, generator=s.generator)
        losses = [train_step(run, opt, s.train_x[idx], s.train_y[idx])
                  for idx in perm[: split - split % batch].view(-1, batch)]
        model.eval()
        with torch.no_grad():
            acc = (run(s.test_x).argmax(1) == s.test_y).float().mean().item()
        print(f"epoch {epoch}: train loss {torch.stack(losses).mean().item():.4f}, test accuracy {acc:.3f}")
    print(f"training took {time.perf_counter() - start:.1f} s")


def step_times(run: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, images: torch.Tensor,
               labels: torch.Tensor, batch: int, steps: int) -> list[float]:
    """Wall time of ``steps`` full training steps (forward, backward, SGD), after two warm-up steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        train_step(run, opt, images[:batch], labels[:batch])
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def median_step_times(models: dict[str, tuple[Callable, nn.Module]], s: Setup, steps: int) -> dict[str, float]:
    """Median training-step seconds of each ``name: (run, model)``, their steps interleaved in rounds."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(3):
        for name, (run, model) in models.items():
            times[name] += step_times(run, model, s.train_x, s.train_y, s.args.batch_size, max(steps // 3, 1))
    return {name: statistics.median(t) for name, t in times.items()}
