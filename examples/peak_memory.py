"""Peak memory of training steps: torch's BatchNorm against ours, with and
without the CPU output cache (torch_bn_grad.memory), and fused.

Each variant runs in its own process: the model takes a few full training
steps, and the script prints how far the process's peak resident memory rose
above what it held before the first step.

* ``--model example`` (default): the example model (examples/common.py); torch's
  BatchNorm, ours, ours with the output cache off.
* ``--model resnet18|resnet50``: the project's ResNet (torch_bn_grad/bench/resnets.py)
  with LeakyReLU(0.01) activations, so that the memory-saving mode applies;
  torch's BatchNorm, ours, ours fused (``convert_batchnorm(fuse=True)``) and
  ours fused with ``memory_saving=True`` (the fused modules keep their output
  instead of their input for the backward, where the activation is invertible).

    python examples/peak_memory.py [--model example|resnet18|resnet50] [--batch-size 64] [--image-size 48]
                                   [--steps 6]
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
# The ResNet variants: the environment, and convert_batchnorm's keywords (None: torch's BatchNorm).
RESNET_VARIANTS = {
    "torch BatchNorm": ({}, None),
    "torch_bn_grad": ({}, {}),
    "torch_bn_grad fused": ({}, {"fuse": True}),
    "torch_bn_grad fused, memory_saving": ({}, {"fuse": True, "memory_saving": True}),
}
NEGATIVE_SLOPE = 0.01


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model_name: str, variant: str, batch: int, size: int, steps: int) -> None:
    """Runs in the child: prints the peak RSS rise of `steps` training steps, in bytes."""
    import torch
    from torch import nn

    import torch_bn_grad

    torch.manual_seed(0)
    if model_name == "example":
        from common import make_model

        model = make_model(8).to(memory_format=torch.channels_last)
        if variant != "torch BatchNorm":
            model = torch_bn_grad.convert_batchnorm(model)
    else:
        from torch_bn_grad.bench import resnets as _models

        model = _models.MODELS[model_name](8, negative_slope=NEGATIVE_SLOPE).to(memory_format=torch.channels_last)
        options = RESNET_VARIANTS[variant][1]
        if options is not None:
            model = torch_bn_grad.convert_batchnorm(model, **options)
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
    parser.add_argument("--model", choices=("example", "resnet18", "resnet50"), default="example")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=48)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        measure(args.model, args.child, args.batch_size, args.image_size, args.steps)
        return
    what = "the example model" if args.model == "example" else f"{args.model}, LeakyReLU({NEGATIVE_SLOPE})"
    print(f"peak resident memory rise over {args.steps} training steps, {what}, "
          f"batch {args.batch_size}, {args.image_size}x{args.image_size}, channels_last:")
    here = os.path.dirname(os.path.abspath(__file__))
    variants = VARIANTS if args.model == "example" else {name: env for name, (env, _) in RESNET_VARIANTS.items()}
    for variant, env in variants.items():
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", variant, "--model", args.model,
             "--batch-size", str(args.batch_size), "--image-size", str(args.image_size), "--steps", str(args.steps)],
            env={**os.environ, **env, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")},
            capture_output=True, text=True, check=True)
        print(f"  {variant:36s} {int(done.stdout.split()[-1]) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
