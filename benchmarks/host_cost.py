"""Host cost per call on the GPU: microseconds of host time, kernel launches and
kernels' GPU time per call, torch's native batch norm against ours, for the
small layers where the host, not the GPU, bounds a call.

    python benchmarks/host_cost.py [--calls 100] [--json FILE] [--trace DIR]
                                   [--shapes 32x512x7x7 ...] [--dtypes float32,bfloat16]

The cases are the op benchmark's (``torch_bn_grad/bench/ops.py``: forward, backward,
module forward+backward). Host time is the wall time of ``--calls`` calls in a
row with no synchronization, divided by the count: the launches of so few calls
never fill the device's queue, so the loop runs at the host's pace. Launches,
kernels and GPU time are read from ``torch.profiler`` over ten calls.
``--trace DIR`` also writes a Chrome trace of each implementation's module step
on every shape, dtype and layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_bn_grad.bench.ops import DTYPES, LAYOUTS, make_case, parse_shape  # noqa: E402

SHAPES = [(8, 64, 8, 8), (32, 512, 7, 7), (32, 256, 14, 14), (256, 512)]
DIRECTIONS = ("forward", "backward", "module")
# Host-side calls that start work on the device.
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel")
PROFILED_CALLS = 10


def host_us(fn, calls: int, repeats: int = 3) -> float:
    """Median over `repeats` of the host time per call of `calls` unsynchronized calls."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def profiled(fn, trace: str = "") -> dict:
    """Launches, kernels, allocations and GPU microseconds per call, from torch.profiler."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    launches = kernels = gpu_us = 0.0
    other_runtime: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            gpu_us += e.device_time
        elif e.name in LAUNCHES:
            launches += 1
        elif e.name.startswith("cu"):  # other runtime and driver calls: allocations, copies, queries
            other_runtime[e.name] = other_runtime.get(e.name, 0) + 1
    n = PROFILED_CALLS
    return {"launches": launches / n, "kernels": kernels / n, "gpu_us": gpu_us / n,
            "other_runtime_calls": {k: v / n for k, v in sorted(other_runtime.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--shapes", nargs="*", type=parse_shape, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--directions", default=",".join(DIRECTIONS))
    parser.add_argument("--json", default="")
    parser.add_argument("--trace", default="", help="folder for Chrome traces of the module steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_cost.py measures CUDA calls: no CUDA device")
    shapes = args.shapes or SHAPES
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; per call: host us, launches, GPU us")
    print(f"{'case':44s} {'native host':>11s} {'ours host':>9s} {'ratio':>6s} {'launch n/o':>10s} "
          f"{'gpu us n/o':>13s}")
    rows = []
    for shape in shapes:
        for dtype_name in args.dtypes.split(","):
            for layout in args.layouts.split(","):
                if layout == "channels_last" and len(shape) not in (4, 5):
                    continue
                for direction in args.directions.split(","):
                    native, ours, _ = make_case(shape, DTYPES[dtype_name], layout, direction, "cuda")
                    for fn in (native, ours):  # warm-up: allocator, lazy initializations
                        for _ in range(20):
                            fn()
                    # Alternate the two, so that drifts of the host touch both.
                    host = {"native": [], "ours": []}
                    for _ in range(3):
                        host["native"].append(host_us(native, args.calls))
                        host["ours"].append(host_us(ours, args.calls))
                    name = f"{'x'.join(map(str, shape))} {dtype_name} {layout} {direction}"
                    traces = {}
                    if args.trace and direction == "module":
                        Path(args.trace).mkdir(parents=True, exist_ok=True)
                        traces = {k: str(Path(args.trace) / f"{k}_{name.replace(' ', '_')}.json")
                                  for k in ("native", "ours")}
                    row = {"case": name, "shape": list(shape), "dtype": dtype_name, "layout": layout,
                           "direction": direction}
                    for key, fn in (("native", native), ("ours", ours)):
                        row[key] = {"host_us": statistics.median(host[key]), **profiled(fn, traces.get(key, ""))}
                    rows.append(row)
                    if args.json:  # after every row: a time limit keeps what was measured
                        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "calls": args.calls}
                        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
                    n, o = row["native"], row["ours"]
                    print(f"{name:44s} {n['host_us']:11.1f} {o['host_us']:9.1f} {n['host_us'] / o['host_us']:5.2f}x "
                          f"{n['launches']:4.1f}/{o['launches']:<4.1f} {n['gpu_us']:6.1f}/{o['gpu_us']:<6.1f}",
                          flush=True)
    ratios = [r["native"]["host_us"] / r["ours"]["host_us"] for r in rows]
    print(f"host time native/ours: median {statistics.median(ratios):.2f}x, worst {min(ratios):.2f}x "
          f"({rows[ratios.index(min(ratios))]['case']}), {sum(r < 1 for r in ratios)} of {len(rows)} slower")


if __name__ == "__main__":
    main()
