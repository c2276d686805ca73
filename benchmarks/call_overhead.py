"""Per-call overhead: a tiny BatchNorm2d (8x16x8x8) training step (forward +
backward) and eval forward, contiguous and channels_last, torch's module
against ours, calls alternating in one process; medians in microseconds.

    python benchmarks/call_overhead.py [--rounds 3] [--iters 300] [--device cuda]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import torch_bn_grad

if __package__ in (None, ""):  # run as a script: the source tree's `benchmarks` package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._per_call import alternating_medians_us, parse_args


def main() -> None:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    modules = {"native": torch.nn.BatchNorm2d(16).to(args.device),
               "ours": torch_bn_grad.nn.BatchNorm2d(16).to(args.device)}
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, input (8, 16, 8, 8)")
    for layout, memory_format in (("contiguous", torch.contiguous_format), ("channels_last", torch.channels_last)):
        x = torch.randn(8, 16, 8, 8, device=args.device).contiguous(memory_format=memory_format)
        x.requires_grad_()
        for mode in ("train", "eval"):
            for m in modules.values():
                m.train(mode == "train")

            def step(m):
                if mode == "train":
                    m(x).sum().backward()
                else:
                    with torch.no_grad():
                        m(x)

            steps = {name: (lambda m=m: step(m)) for name, m in modules.items()}
            for r in range(args.rounds):
                t = alternating_medians_us(steps, args.iters)
                print(f"{layout:13s} {mode:5s} round {r}: native {t['native']:7.1f} us  ours {t['ours']:7.1f} us  "
                      f"speedup {t['native'] / t['ours']:.2f}x")


if __name__ == "__main__":
    main()
