"""Per-call overhead: a tiny BatchNorm2d (8x16x8x8) training step (forward +
backward) and eval forward, torch's module against ours, interleaved in one
process; medians in microseconds.

    python benchmarks/call_overhead.py [--rounds 3] [--iters 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_bn_grad


def _median_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(8, 16, 8, 8, requires_grad=True)
    modules = {"native": torch.nn.BatchNorm2d(16), "ours": torch_bn_grad.nn.BatchNorm2d(16)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, input {tuple(x.shape)}")
    for mode in ("train", "eval"):
        for m in modules.values():
            m.train(mode == "train")

        def step(m):
            if mode == "train":
                m(x).sum().backward()
            else:
                with torch.no_grad():
                    m(x)

        for r in range(args.rounds):
            t = {name: _median_us(lambda: step(m), args.iters) for name, m in modules.items()}
            print(f"{mode:5s} round {r}: native {t['native']:7.1f} us  ours {t['ours']:7.1f} us  "
                  f"speedup {t['native'] / t['ours']:.2f}x")


if __name__ == "__main__":
    main()
