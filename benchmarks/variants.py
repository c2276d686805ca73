"""Every CUDA variant (``torch_bn_grad.config.cuda_variants``) timed against the
default path in one process, interleaved: the module's training forward and its
forward + backward step (running statistics updated, as in training) on the op
bench's ResNet-50 shapes at batch 32 and 64 and 4096x1024, float32, bfloat16 and
float16, both layouts; then the ResNet-50 training step (batch 64, 224x224,
channels_last, float32, eager). One JSON for ``scripts/choose_variants.py``.

    python benchmarks/variants.py [--variants fused_update,...] [--rounds 5] [--min-run-time 0.02]
                                  [--dtypes float32,bfloat16,float16] [--no-model] [--json FILE]

Each round times the default and every variant once (torch.utils.benchmark,
which waits for the GPU around each timed block; which goes first rotates),
on the same tensors and module; a variant's speedup in a case is the median
over rounds of default / variant, each round's against its own default. The
JSON is written after every case, so a time limit keeps what was timed. The results are
bitwise equal (tests/cuda/test_cuda_variants.py): only the time differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.utils.benchmark as benchmark

import torch_bn_grad
from torch_bn_grad import config

if __package__ in (None, ""):  # run as a script: the source tree's `benchmarks` package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_bn_grad.bench import ops, resnets  # noqa: E402

SHAPES = ops.RESNET50_SHAPES + [(64,) + s[1:] for s in ops.RESNET50_SHAPES] + [(4096, 1024)]
DIRECTIONS = ("forward", "module")


def _median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _case(shape: tuple, dtype: torch.dtype, layout: str, direction: str) -> Callable[[], object]:
    """The training forward (``forward``) or forward + backward (``module``) of
    one of this library's modules on `shape`, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = ops.in_layout(torch.randn(shape, generator=g, device="cuda").to(dtype), layout)
    module = torch_bn_grad.convert_batchnorm(ops.module_class(len(shape))(shape[1])).to("cuda", dtype)
    if direction == "forward":
        return lambda: module(x)
    dy = ops.in_layout(torch.randn(shape, generator=g, device="cuda").to(dtype), layout)
    xg = x.detach().requires_grad_()
    wrt = [xg, *module.parameters()]
    return lambda: torch.autograd.grad(module(xg), wrt, dy)


def _order(variants: list[str], round_: int) -> list[tuple[str, frozenset]]:
    """The paths of a round: the default and each variant, rotated round by round (a warm-up or
    drift does not fall on one of them)."""
    paths = [("default", frozenset())] + [(v, frozenset({v})) for v in variants]
    shift = round_ % len(paths)
    return paths[shift:] + paths[:shift]


def _speedups(times: dict[str, list[float]], variants: list[str], digits: int) -> dict[str, dict]:
    """Per variant: the medians (ms) and the median, least and greatest of its rounds' speedups
    over the default of the same round."""
    out = {}
    for v in variants:
        speedups = [d / t for d, t in zip(times["default"], times[v])]
        out[v] = {"default_ms": round(statistics.median(times["default"]), digits),
                  "variant_ms": round(statistics.median(times[v]), digits),
                  "speedup": round(statistics.median(speedups), 4),
                  "speedup_min": round(min(speedups), 4), "speedup_max": round(max(speedups), 4)}
    return out


def _interleaved(fn: Callable[[], object], variants: list[str], rounds: int, min_run_time: float) -> dict:
    """Every path timed once a round, the default's times shared by the variants' speedups."""
    times = {name: [] for name in ["default", *variants]}
    for r in range(rounds):
        for name, on in _order(variants, r):
            config.cuda_variants = on
            fn()  # the plan and the allocator for this path
            times[name].append(_median_ms(fn, min_run_time))
    config.cuda_variants = frozenset()
    return _speedups(times, variants, 5)


def _model_step(variants: list[str], rounds: int, steps: int) -> dict:
    """The ResNet-50 training step (batch 64, 224x224, channels_last, float32), every path a round."""
    torch.manual_seed(0)
    model = torch_bn_grad.convert_batchnorm(resnets.MODELS["resnet50"](1000)).to("cuda", memory_format=torch.channels_last)
    x = torch.randn(64, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (64,), device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    times = {name: [] for name in ["default", *variants]}
    for r in range(rounds):
        for name, on in _order(variants, r):
            config.cuda_variants = on
            step()
            per_step = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                per_step.append(time.perf_counter() - start)
            times[name].append(statistics.median(per_step) * 1e3)
    config.cuda_variants = frozenset()
    about = {"model": "resnet50", "batch": 64, "resolution": 224, "layout": "channels_last", "dtype": "float32"}
    return {v: {**about, **r} for v, r in _speedups(times, variants, 3).items()}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(config.cuda_variant_names()))
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.02)
    parser.add_argument("--model-steps", type=int, default=5)
    parser.add_argument("--no-model", action="store_true", help="skip the ResNet-50 step")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/variants.py times CUDA variants: no CUDA device is available")
    variants = [v for v in args.variants.split(",") if v]
    config.cuda_variants = frozenset(variants)  # checks the names
    config.cuda_variants = frozenset()
    report = {"device": ops.describe_device("cuda"), "torch": torch.__version__, "commit": _commit(),
              "date": datetime.date.today().isoformat(), "variants": {}}
    print(report["device"])
    for variant in variants:
        report["variants"][variant] = {"cases": []}

    def write() -> None:  # after every case: a time limit that stops the run keeps what was timed
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    for shape in SHAPES:
        for dtype_name in args.dtypes.split(","):
            for layout in ops.LAYOUTS:
                if layout == "channels_last" and len(shape) < 4:
                    continue
                for direction in DIRECTIONS:
                    fn = _case(shape, ops.DTYPES[dtype_name], layout, direction)
                    for variant, r in _interleaved(fn, variants, args.rounds, args.min_run_time).items():
                        r = {"shape": list(shape), "dtype": dtype_name, "layout": layout, "direction": direction, **r}
                        report["variants"][variant]["cases"].append(r)
                        print(f"{variant:24s} {'x'.join(map(str, shape)):>16s} {dtype_name:9s} {layout:13s} "
                              f"{direction:8s} default {r['default_ms']:8.4f} ms  variant {r['variant_ms']:8.4f} ms"
                              f"  {r['speedup']:.3f}x ({r['speedup_min']:.3f}-{r['speedup_max']:.3f})", flush=True)
                    write()
    if not args.no_model:
        for variant, m in _model_step(variants, args.rounds, args.model_steps).items():
            report["variants"][variant]["model"] = m
            print(f"{variant:24s} resnet50 b64 step default {m['default_ms']:.2f} ms  variant {m['variant_ms']:.2f} ms"
                  f"  {m['speedup']:.3f}x ({m['speedup_min']:.3f}-{m['speedup_max']:.3f})", flush=True)
        write()


if __name__ == "__main__":
    main()
