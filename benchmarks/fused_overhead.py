"""Fused module overhead: a training step (forward + backward) of
``BatchNormAct2d(64)`` (relu, with and without a residual) against torch's
BatchNorm2d + add + ReLU, on a small (8x64x8x8) and a larger (32x64x28x28)
input. Calls alternate between the two in one process, so that a noisy
machine slows both alike; medians in microseconds.

    python benchmarks/fused_overhead.py [--rounds 3] [--iters 300] [--device cuda]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import torch_bn_grad

if __package__ in (None, ""):  # run as a script: the source tree's `benchmarks` package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._per_call import alternating_medians_us, parse_args


class _Native(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(channels)

    def forward(self, x, residual=None):
        y = self.bn(x)
        return torch.relu(y + residual if residual is not None else y)


def main() -> None:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    modules = {"native": _Native(64).to(args.device), "ours": torch_bn_grad.nn.BatchNormAct2d(64).to(args.device)}
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    for shape in ((8, 64, 8, 8), (32, 64, 28, 28)):
        x = torch.randn(shape, device=args.device, requires_grad=True)
        iters = args.iters if shape[0] == 8 else max(args.iters // 10, 20)
        for residual in (None, torch.randn(shape, device=args.device, requires_grad=True)):
            def step(m):
                m(x, residual).sum().backward()

            steps = {name: (lambda m=m: step(m)) for name, m in modules.items()}
            for r in range(args.rounds):
                t = alternating_medians_us(steps, iters)
                print(f"{'x'.join(map(str, shape)):>12s} residual={residual is not None!s:5s} round {r}: "
                      f"native {t['native']:8.1f} us  ours {t['ours']:8.1f} us  "
                      f"speedup {t['native'] / t['ours']:.2f}x")


if __name__ == "__main__":
    main()
