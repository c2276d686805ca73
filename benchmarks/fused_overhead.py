"""Fused module overhead: a training step (forward + backward) of
``BatchNormAct2d(64)`` (relu, with and without a residual) against torch's
BatchNorm2d + add + ReLU, on a small (8x64x8x8) and a larger (32x64x28x28)
input. Calls alternate between the two in one process, so that a noisy
machine slows both alike; medians in microseconds.

    python benchmarks/fused_overhead.py [--rounds 3] [--iters 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_bn_grad


class _Native(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(channels)

    def forward(self, x, residual=None):
        y = self.bn(x)
        return torch.relu(y + residual if residual is not None else y)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    modules = {"native": _Native(64), "ours": torch_bn_grad.nn.BatchNormAct2d(64)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for shape in ((8, 64, 8, 8), (32, 64, 28, 28)):
        x = torch.randn(shape, requires_grad=True)
        iters = args.iters if shape[0] == 8 else max(args.iters // 10, 20)
        for residual in (None, torch.randn(shape, requires_grad=True)):
            def step(m):
                m(x, residual).sum().backward()

            for r in range(args.rounds):
                times = {name: [] for name in modules}
                for _ in range(iters):
                    for name, m in modules.items():
                        times[name].append(_timed(lambda: step(m)))
                t = {name: statistics.median(v) * 1e6 for name, v in times.items()}
                print(f"{'x'.join(map(str, shape)):>12s} residual={residual is not None!s:5s} round {r}: "
                      f"native {t['native']:8.1f} us  ours {t['ours']:8.1f} us  "
                      f"speedup {t['native'] / t['ours']:.2f}x")


if __name__ == "__main__":
    main()
