"""A ResNet's eval forward with each model alone in its process: native
(torch's BatchNorm2d), ours (``convert_batchnorm``) and fused
(``convert_batchnorm(fuse=True)``), each in fresh processes that alternate
(native, ours, fused, native, ...), so that no model shares its heap with
another. Per variant: the median step time over its processes and the
median minor page faults a step (``getrusage``), which on CPU move an eval
step more than batch norm does (docs/performance.md, "ResNet-50").

    python benchmarks/eval_processes.py [--model resnet50] [--batch-size 8] [--resolution 112]
                                        [--layout contiguous|channels_last] [--processes 3] [--steps 30]
                                        [--keep-memory]

``--keep-memory`` runs every process with glibc told to keep what it maps
(no fresh mapping for a large block, none returned), which takes the faults
out of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("native", "ours", "fused")
KEEP_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TOP_PAD_": "536870912"}


def time_one(variant: str, model: str, batch: int, resolution: int, layout: str, steps: int) -> dict:
    """In this process: `steps` eval forwards of one variant, after three
    warm-up steps; the median milliseconds and minor faults a step."""
    import torch

    import torch_bn_grad
    from torch_bn_grad.bench.resnets import MODELS

    torch.manual_seed(0)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    net = MODELS[model]().to(memory_format=memory_format).eval()
    if variant != "native":
        net = torch_bn_grad.convert_batchnorm(net, fuse=variant == "fused")
    x = torch.randn(batch, 3, resolution, resolution).to(memory_format=memory_format)

    def step() -> None:
        with torch.no_grad():
            net(x)

    for _ in range(3):
        step()
    times, faults = [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"ms": statistics.median(times) * 1e3, "faults": statistics.median(faults)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=112)
    parser.add_argument("--layout", choices=("contiguous", "channels_last"), default="contiguous")
    parser.add_argument("--processes", type=int, default=3, help="processes per variant")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--keep-memory", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: the variant it times
    args = parser.parse_args()
    case = (args.model, args.batch_size, args.resolution, args.layout, args.steps)
    if args.one:
        print(json.dumps(time_one(args.one, *case)))
        return
    env = dict(os.environ, **(KEEP_MEMORY if args.keep_memory else {}))
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.processes):
        for variant in VARIANTS:
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", variant],
                                  capture_output=True, text=True, env=env, check=True)
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.model}, batch {args.batch_size}, {args.resolution}x{args.resolution}, {args.layout}, eval, "
          f"{args.processes} processes a variant{', glibc keeping its memory' if args.keep_memory else ''}")
    native = statistics.median(r["ms"] for r in results["native"])
    for variant, rows in results.items():
        ms = [r["ms"] for r in rows]
        print(f"{variant:7s} {statistics.median(ms):8.2f} ms ({min(ms):.2f}-{max(ms):.2f}), "
              f"native/{variant} {native / statistics.median(ms):.3f}x, "
              f"faults a step {statistics.median(r['faults'] for r in rows):.0f}")


if __name__ == "__main__":
    main()
