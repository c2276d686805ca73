"""Operator level: y = act(batch_norm(x) + residual) (and y = act(batch_norm(x))),
training forward + backward, three ways interleaved in one process:

* torch:  torch's ``F.batch_norm``, then ``y += residual`` and ``relu_`` in place
  (what torchvision's blocks do);
* ours:   ``torch_bn_grad.functional.batch_norm``, then the same add and relu;
* fused:  ``torch_bn_grad.functional.batch_norm_act`` (one call).

Each round times ``--iters`` steps of every variant in turn (the first variant
changes every round); it prints the medians and the ratios torch/fused and
ours/fused (above 1: fused is faster).

    python benchmarks/fused.py [--full] [--dtype float32|bfloat16] [--layouts contiguous,channels_last]
                               [--patterns residual,plain] [--rounds 7] [--iters 3] [--threads N]
                               [--device cpu|cuda] [--json FILE]

On CUDA every timed step ends with a synchronize, so the times are the GPU's
(plus the host's launch time where the host is the slower of the two).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import torch_bn_grad
from torch_bn_grad import functional as ours

QUICK_SHAPES = [(16, 64, 56, 56), (16, 256, 28, 28), (16, 1024, 14, 14), (16, 2048, 7, 7)]
FULL_SHAPES = [(32, 64, 112, 112), (32, 64, 56, 56), (32, 256, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14),
               (32, 2048, 7, 7)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_steps(shape: tuple, dtype: torch.dtype, layout: str, residual: bool,
               device: str = "cpu") -> dict[str, Callable[[], object]]:
    """One forward + backward per call, for each variant (gradients of x, residual, weight, bias)."""
    g = torch.Generator().manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    make = lambda: torch.randn(shape, generator=g).to(device, dtype).contiguous(memory_format=fmt)  # noqa: E731
    x, r, dy = make().requires_grad_(), make().requires_grad_(), make()
    c = shape[1]
    w = (torch.rand(c, generator=g) + 0.5).to(device).requires_grad_()
    b = torch.randn(c, generator=g).to(device).requires_grad_()
    stats = {name: (torch.zeros(c, device=device), torch.ones(c, device=device)) for name in ("torch", "ours", "fused")}
    wrt = [x, w, b] + ([r] if residual else [])

    def separate(batch_norm: Callable, name: str) -> Callable[[], object]:
        def step() -> object:
            y = batch_norm(x, *stats[name], w, b, True, 0.1, 1e-5)
            if residual:
                y += r
            return torch.autograd.grad(F.relu_(y), wrt, dy)
        return step

    def fused() -> object:
        y = ours.batch_norm_act(x, *stats["fused"], w, b, True, 0.1, 1e-5, residual=r if residual else None,
                                activation="relu")
        return torch.autograd.grad(y, wrt, dy)

    return {"torch": separate(F.batch_norm, "torch"), "ours": separate(ours.batch_norm, "ours"), "fused": fused}


def time_interleaved(steps: dict[str, Callable[[], object]], rounds: int, iters: int,
                     sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median milliseconds per step of each variant, rounds alternating the variants."""
    for step in steps.values():
        step()  # warm-up
    sync()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for rnd in range(rounds):
        for name in order[rnd % len(order):] + order[:rnd % len(order)]:
            for _ in range(iters):
                start = time.perf_counter()
                steps[name]()
                sync()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="ResNet-50 shapes at batch 32")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--layouts", default="contiguous,channels_last")
    parser.add_argument("--patterns", default="residual,plain", help="residual: bn + add + relu; plain: bn + relu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"{torch.get_num_threads()} threads, kernels {torch_bn_grad.cpu_kernel_isa()}")
    print(f"torch {torch.__version__}, {where}, "
          f"{args.dtype}, training forward + backward, median of {args.rounds} rounds x {args.iters}")
    print(f"{'shape':>20} {'layout':>13} {'pattern':>8} {'torch ms':>9} {'ours ms':>8} {'fused ms':>9} "
          f"{'torch/fused':>11} {'ours/fused':>10}")
    rows = []
    for shape in FULL_SHAPES if args.full else QUICK_SHAPES:
        for layout in args.layouts.split(","):
            for pattern in args.patterns.split(","):
                steps = make_steps(shape, DTYPES[args.dtype], layout, pattern == "residual", args.device)
                ms = time_interleaved(steps, args.rounds, args.iters, sync)
                row = {"shape": list(shape), "layout": layout, "pattern": pattern, "dtype": args.dtype,
                       "device": args.device,
                       **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                       "torch_over_fused": round(ms["torch"] / ms["fused"], 3),
                       "ours_over_fused": round(ms["ours"] / ms["fused"], 3)}
                rows.append(row)
                print(f"{'x'.join(map(str, shape)):>20} {layout:>13} {pattern:>8} {ms['torch']:>9.2f} "
                      f"{ms['ours']:>8.2f} {ms['fused']:>9.2f} {row['torch_over_fused']:>10.2f}x "
                      f"{row['ours_over_fused']:>9.2f}x")
    ratios = sorted(r["torch_over_fused"] for r in rows)
    print(f"{len(rows)} cases, median torch/fused {ratios[len(ratios) // 2]:.2f}x "
          f"(range {ratios[0]:.2f}x to {ratios[-1]:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
