"""Peak memory of training steps: torch's BatchNorm against ours, with and
without the CPU output cache (torch_bn_grad.memory).

Each variant runs in its own process: the example model (examples/train.py)
takes a few full training steps, and the script prints how far the process's
peak resident memory rose above what it held before the first step.

    python examples/peak_memory.py [--batch-size 64] [--image-size 48] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

VARIANTS = {
    "torch BatchNorm": {},
    "torch_bn_grad": {},
    "torch_bn_grad, cache off": {"TORCH_BN_GRAD_OUTPUT_CACHE_MB": "0"},
}


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(variant: str, batch: int, size: int, steps: int) -> None:
    """Runs in the child: prints the peak RSS rise of `steps` training steps, in bytes."""
    import torch
    from torch import nn

    import torch_bn_grad
    from train import make_model

    torch.manual_seed(0)
    model = make_model(8).to(memory_format=torch.channels_last)
    if variant != "torch BatchNorm":
        model = torch_bn_grad.convert_batchnorm(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, size, size).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 8, (batch,))
    before = current_rss_bytes()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(peak - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=48)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        measure(args.child, args.batch_size, args.image_size, args.steps)
        return
    print(f"peak resident memory rise over {args.steps} training steps, "
          f"batch {args.batch_size}, {args.image_size}x{args.image_size}, channels_last:")
    here = os.path.dirname(os.path.abspath(__file__))
    for variant, env in VARIANTS.items():
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", variant, "--batch-size", str(args.batch_size),
             "--image-size", str(args.image_size), "--steps", str(args.steps)],
            env={**os.environ, **env, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")},
            capture_output=True, text=True, check=True)
        print(f"  {variant:26s} {int(done.stdout.split()[-1]) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
