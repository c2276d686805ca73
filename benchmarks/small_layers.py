"""Small layers of many channels and few rows: a BatchNorm1d on (rows,
channels) inputs (an MLP's or a classifier head's) and a channels_last
BatchNorm2d on a 4x4 map, training step (forward + backward, running
statistics included; a dense upstream gradient, as in a network) and eval
forward, torch's module against ours, calls alternating in one process;
medians in microseconds.

    python benchmarks/small_layers.py [--rounds 3] [--iters 300] [--device cuda]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import torch_bn_grad

if __package__ in (None, ""):  # run as a script: the source tree's `benchmarks` package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._per_call import alternating_medians_us, parse_args

SHAPES = [(2, 4096), (16, 4096), (64, 1024), (256, 512), (4, 512, 4, 4)]


def _modules(shape: tuple, device: str) -> dict[str, torch.nn.Module]:
    cls = torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d
    ours = torch_bn_grad.nn.BatchNorm1d if len(shape) == 2 else torch_bn_grad.nn.BatchNorm2d
    return {"native": cls(shape[1]).to(device), "ours": ours(shape[1]).to(device)}


def main() -> None:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, float32")
    for shape in SHAPES:
        modules = _modules(shape, args.device)
        x = torch.randn(shape, device=args.device)
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        grad = torch.randn_like(x)
        for mode in ("train", "eval"):
            for m in modules.values():
                m.train(mode == "train")

            def step(m):
                if mode == "train":
                    m(x).backward(grad)
                else:
                    with torch.no_grad():
                        m(x)

            steps = {name: (lambda m=m: step(m)) for name, m in modules.items()}
            name = "x".join(map(str, shape)) + (" channels_last" if x.dim() == 4 else "")
            for r in range(args.rounds):
                t = alternating_medians_us(steps, args.iters)
                print(f"{name:24s} {mode:5s} round {r}: native {t['native']:7.1f} us  ours {t['ours']:7.1f} us  "
                      f"speedup {t['native'] / t['ours']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
