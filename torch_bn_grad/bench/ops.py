"""Benchmark: torch_bn_grad against torch's native batch norm, side by side.

    python -m torch_bn_grad.bench [--device cpu|cuda] [--full] [--threads N] [--json FILE] [--plot FILE.png]
                                  [--dtypes float32,bfloat16,float16] [--layouts contiguous,channels_last]
                                  [--directions forward,backward,module,eval] [--min-run-time S]
                                  [--shapes 32x64x56x56 ...] [--processes N]
    python -m torch_bn_grad.bench --model resnet18|resnet50 [--batch-size 16] [--resolution 112]
                                  [--modes train,eval] [--executions eager,compile] [--layouts ...]
                                  [--iters 3] [--rounds 5] [--opaque] [--fuse] [--threads N] [--processes N]
                                  [--json FILE] [--plot FILE.png]

With ``--model`` it times a whole ResNet (train step and eval, eager and
compiled) with this library's BatchNorm against torch's, see
``torch_bn_grad/bench/models.py``.

For each case it prints the median time of torch's native operator and of
ours (torch.utils.benchmark, same process, interleaved), the speedup, the
bandwidth ours achieves and its percentage of the bandwidth bound. The bound
is the operator's minimal memory traffic (forward: read src, write dst;
backward: read src and diff_dst, write diff_src; module forward+backward: both;
eval, the forward with frozen statistics, on request: read src, write dst)
divided by the copy bandwidth measured in the same run on tensors of the same
size, on the same device. ``--processes N`` times the cases in N fresh
processes and prints, per case, the medians over them and the range of the
speedups (``torch_bn_grad/bench/processes.py``: a process's memory placement moves
a case's time on a VM); ``--shapes`` times the given shapes.

The baseline is ``aten.native_batch_norm`` / ``native_batch_norm_backward``
for the operator rows and ``torch.nn.BatchNorm*d`` (which takes cuDNN where
torch picks it) for the module rows. On CUDA, torch.utils.benchmark
synchronizes the device around each timed block; tensors that fit in the L2
cache are timed warm, as is the copy that sets the bound. On CPU, run with
``THP_MEM_ALLOC_ENABLE=1`` to let torch's allocator use huge pages for the
large outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch.utils import benchmark

import torch_bn_grad
from torch_bn_grad import _compat
from torch_bn_grad.bench import models as _model_bench
from torch_bn_grad.bench import processes as _processes
from torch_bn_grad.bench import speedup_plot as _plot

_processes.check_package(torch_bn_grad)

RESNET50_SHAPES = [
    (32, 64, 112, 112), (32, 64, 56, 56), (32, 256, 56, 56), (32, 128, 28, 28), (32, 512, 28, 28),
    (32, 256, 14, 14), (32, 1024, 14, 14), (32, 512, 7, 7), (32, 2048, 7, 7),
]
FULL_SHAPES = RESNET50_SHAPES + [(4096, 1024), (4, 32, 32, 64, 64)]
QUICK_SHAPES = [(32, 64, 56, 56), (32, 256, 14, 14), (32, 2048, 7, 7), (4096, 1024)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYOUTS = ("contiguous", "channels_last")
DIRECTIONS = ("forward", "backward", "module")  # the default set
# eval: the forward with frozen statistics (inference), on request.
ALL_DIRECTIONS = DIRECTIONS + ("eval",)
DEVICES = ("cpu", "cuda")


@dataclass
class Result:
    """One row of the table."""

    shape: tuple
    device: str
    dtype: str
    layout: str
    direction: str
    native_ms: float
    ours_ms: float
    speedup: float
    gbps: float
    bound_pct: float
    # With --processes N: the lowest and highest of the N processes' speedups
    # (`speedup` is their median); None for a single process.
    speedup_min: Optional[float] = None
    speedup_max: Optional[float] = None


def _median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def device_problem(device: str) -> Optional[str]:
    """Why the benchmark cannot run on `device`, or None when it can."""
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is built without CUDA"
        return f"no CUDA device is visible to torch {torch.__version__} (CUDA {torch.version.cuda})"
    # A build without a CUDA toolkit registers CPU kernels only; ask the dispatcher.
    if not _compat.has_kernel("torch_bn_grad::batch_norm_forward", "CUDA"):
        return ("torch_bn_grad was built without its CUDA kernels (no CUDA toolkit at build time?); "
                "rebuild it with `pip install --no-build-isolation -e .`")
    return None


def describe_device(device: str) -> str:
    """The header line: torch's version and what the cases run on."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
                f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB")
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
            f"kernels {torch_bn_grad.cpu_kernel_isa()}, "
            f"{_channel_runs()}, "
            f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}")


def _channel_runs() -> str:
    """From which pass size the CPU kernels run in channel runs (csrc/cpu/cache_geometry.cpp)."""
    sizes = torch_bn_grad._C.cpu_channel_runs_min_pass_bytes()
    return "channel runs from " + " / ".join(
        f"{'never' if size is None else f'{size >> 20} MB'} {direction}" for direction, size in sizes.items())


def _short_device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} threads"


def copy_bandwidth(numel: int, dtype: torch.dtype, min_run_time: float, device: str = "cpu") -> float:
    """Bytes per second of a copy between two tensors of `numel` elements on `device`."""
    src = torch.randn(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), min_run_time)
    return 2 * src.nbytes / (ms * 1e-3)


def in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t` in `layout` ("contiguous" or "channels_last"; tensors under 4-D stay contiguous)."""
    if layout == "contiguous" or t.dim() < 4:
        return t.contiguous()
    return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)


def module_class(dim: int) -> type:
    """torch's BatchNorm class of a `dim`-D input."""
    return {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}[dim]


def make_case(shape: tuple, dtype: torch.dtype, layout: str, direction: str, device: str = "cpu"):
    """(native, ours, traffic in bytes) for one case on `device`: two callables
    and the operator's minimal memory traffic."""
    g = torch.Generator(device=device).manual_seed(0)
    c = shape[1]
    x = in_layout(torch.randn(shape, generator=g, device=device).to(dtype), layout)
    dy = in_layout(torch.randn(shape, generator=g, device=device).to(dtype), layout)
    w = torch.rand(c, generator=g, device=device) + 0.5
    b = torch.randn(c, generator=g, device=device)
    nbytes = x.nbytes
    if direction == "forward":
        native = lambda: torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)  # noqa: E731
        ours = lambda: torch_bn_grad.batch_norm_forward(x, w, b)  # noqa: E731
        return native, ours, 2 * nbytes
    if direction == "eval":
        _, mean, var = torch_bn_grad.batch_norm_forward(x, w, b)
        native = lambda: torch.ops.aten.native_batch_norm(x, w, b, mean, var, False, 0.1, 1e-5)  # noqa: E731
        ours = lambda: torch_bn_grad.batch_norm_forward(x, w, b, mean, var)  # noqa: E731
        return native, ours, 2 * nbytes
    if direction == "backward":
        _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
        mean, var = save_mean, (1.0 / save_invstd.double() ** 2 - 1e-5).float()
        mask = [True, True, True]
        native = lambda: torch.ops.aten.native_batch_norm_backward(  # noqa: E731
            dy, x, w, None, None, save_mean, save_invstd, True, 1e-5, mask)
        ours = lambda: torch_bn_grad.batch_norm_backward(x, dy, mean, var, w)  # noqa: E731
        return native, ours, 3 * nbytes
    ref_module = module_class(len(shape))(c).to(device, dtype)
    our_module = torch_bn_grad.convert_batchnorm(module_class(len(shape))(c).to(device, dtype))
    xg = x.detach().requires_grad_()

    def step(module):
        wrt = [xg, *module.parameters()]
        return lambda: torch.autograd.grad(module(xg), wrt, dy)  # no .grad accumulation

    # forward: read x, write y; backward: read x and dy, write dx
    return step(ref_module), step(our_module), 5 * nbytes


def run(shapes, dtypes, layouts, directions, min_run_time: float, device: str = "cpu", log=print) -> list[Result]:
    """Measure every case on `device`; prints a row as each finishes."""
    results = []
    log(table_header())
    bandwidth: dict = {}
    for shape in shapes:
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            numel = 1
            for s in shape:
                numel *= s
            if (numel, dtype) not in bandwidth:
                bandwidth[(numel, dtype)] = copy_bandwidth(numel, dtype, min_run_time, device)
            bw = bandwidth[(numel, dtype)]
            for layout in layouts:
                if layout == "channels_last" and len(shape) < 4:
                    continue
                for direction in directions:
                    native, ours, traffic = make_case(shape, dtype, layout, direction, device)
                    native(), ours()  # warm-up
                    native_ms = _median_ms(native, min_run_time)
                    ours_ms = _median_ms(ours, min_run_time)
                    native_ms = min(native_ms, _median_ms(native, min_run_time))
                    gbps = traffic / (ours_ms * 1e-3) / 1e9
                    r = Result(tuple(shape), device, dtype_name, layout, direction, round(native_ms, 4),
                               round(ours_ms, 4), round(native_ms / ours_ms, 3), round(gbps, 2),
                               round(100 * gbps * 1e9 / bw, 1))
                    results.append(r)
                    log(table_row(r))
    return results


def table_header(spread: bool = False) -> str:
    """The table's column names; `spread`: with the range of speedups over processes."""
    return (f"{'shape':>22} {'dtype':>8} {'layout':>13} {'direction':>9} {'native ms':>10} {'ours ms':>9} "
            f"{'speedup':>8} {'GB/s':>7} {'% bound':>8}" + (f" {'speedup range':>15}" if spread else ""))


def table_row(r: Result) -> str:
    """One case's row; the range of its speedups where it has one (--processes)."""
    row = (f"{str(r.shape):>22} {r.dtype:>8} {r.layout:>13} {r.direction:>9} {r.native_ms:>10.3f} "
           f"{r.ours_ms:>9.3f} {r.speedup:>7.2f}x {r.gbps:>7.1f} {r.bound_pct:>7.1f}%")
    if r.speedup_min is not None:
        row += f" {r.speedup_min:>6.2f}x-{r.speedup_max:.2f}x"
    return row


def summary(results: list[Result]) -> str:
    """The closing line: case count, median speedup, the cases slower than native and the worst one."""
    if not results:
        return "0 cases"
    speedups = sorted(r.speedup for r in results)
    slower = [r for r in results if r.speedup < 1]
    line = f"{len(results)} cases, median speedup {speedups[len(speedups) // 2]:.2f}x, {len(slower)} slower than native"
    if results[0].speedup_max is not None:
        line += f" ({sum(r.speedup_max < 1 for r in slower)} of them in every process)"
    worst = min(results, key=lambda r: r.speedup)
    return line + f"; worst: {worst.shape} {worst.dtype} {worst.layout} {worst.direction} {worst.speedup:.2f}x"


def parse_shape(text: str) -> tuple:
    """`32x64x56x56` as (32, 64, 56, 56): rank 2 to 5."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not 2 <= len(shape) <= 5 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected a shape like 32x64x56x56 (rank 2 to 5, sizes >= 1), got {text!r}")
    return shape


def _process_argv(args: argparse.Namespace) -> list[str]:
    """The command line of one process of --processes: the cases and their timing, no outputs."""
    argv = ["--device", args.device, "--dtypes", args.dtypes, "--layouts", args.layouts,
            "--directions", args.directions, "--min-run-time", str(args.min_run_time)]
    if args.shapes:
        argv += ["--shapes", *("x".join(map(str, shape)) for shape in args.shapes)]
    elif args.full:
        argv.append("--full")
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return argv


def plot(results: list[Result], path: str, device: str = "cpu") -> None:
    """Speedup per case on a log axis (needs matplotlib): one labelled marker per
    case, colour by direction, shape by dtype, a line at 1.0x; cases slower
    than native have a red outline and a red label so they stand out."""
    points = [_plot.Point(f"{'x'.join(map(str, r.shape))} {r.dtype} {r.layout} {r.direction}", r.speedup,
                          r.direction, r.dtype) for r in results]
    _plot.plot_speedups(points, path, f"torch_bn_grad vs torch {torch.__version__} ({_short_device_name(device)})",
                        colours={"forward": "tab:blue", "backward": "tab:orange", "module": "tab:green",
                                 "eval": "tab:purple"},
                        markers={"float32": "o", "bfloat16": "s", "float16": "D", "float64": "^"})


def main(argv: Optional[list[str]] = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m torch_bn_grad.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where the cases run (default: cpu)")
    parser.add_argument("--full", action="store_true", help="every ResNet-50 shape plus the 1-D and 3-D cases")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--directions", default=",".join(DIRECTIONS),
                        help=f"of {', '.join(ALL_DIRECTIONS)} (eval: frozen statistics); default {','.join(DIRECTIONS)}")
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="NxCx...",
                        help="these shapes instead of the quick (or --full) set, e.g. 32x64x56x56 4096x1024")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="time the cases in N fresh processes, one after the other, and report per case the "
                             "median over them and the range of the speedups (see torch_bn_grad/bench/processes.py); "
                             "with --model, the model table")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot the speedups (needs matplotlib)")
    _model_bench.add_arguments(parser)
    args = parser.parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        parser.error(f"--device {args.device}: {problem}")
    if args.processes < 1:
        parser.error(f"--processes: expected a count >= 1, got {args.processes}")
    unknown = [d for d in args.directions.split(",") if d not in ALL_DIRECTIONS]
    if unknown:
        parser.error(f"--directions: expected names of {', '.join(ALL_DIRECTIONS)}, got {', '.join(map(repr, unknown))}")
    if args.model:
        if args.shapes:
            parser.error("--shapes is an option of the operator table, not of --model")
        if args.threads:
            torch.set_num_threads(args.threads)
        _model_bench.main(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_device(args.device))
    if args.processes > 1:
        tables = _processes.run(_process_argv(args), args.processes)
        results = [Result(**{**row, "shape": tuple(row["shape"])}) for row in _processes.merge(tables, _processes.OPS)]
        print(f"median of {args.processes} processes")
        print(table_header(spread=True))
        for r in results:
            print(table_row(r))
    else:
        shapes = args.shapes or (FULL_SHAPES if args.full else QUICK_SHAPES)
        results = run(shapes, args.dtypes.split(","), args.layouts.split(","), args.directions.split(","),
                      args.min_run_time, args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    if args.plot:
        plot(results, args.plot, args.device)
    print(summary(results))


if __name__ == "__main__":
    main(sys.argv[1:])
