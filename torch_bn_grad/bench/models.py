"""Model benchmark: a whole model with this library's BatchNorm against the same
model with torch's, side by side (``python -m torch_bn_grad.bench --model resnet18``):
the project's ResNet-18 and ResNet-50 (``resnets.py``), or timm's EfficientNet-B0 and
MobileNetV3 (``timm_models.py``).

For each mode (train step: forward, cross-entropy, backward, SGD step; eval:
forward under ``no_grad``), memory format and execution (eager, or
``torch.compile`` with the default inductor backend) it builds the model
once, converts a deep copy with :func:`torch_bn_grad.convert_batchnorm`
(same weights), warms both up (compiling them), then times single iterations
in rounds that alternate between the variants (each round starting with the
next variant), and reports the median
iteration time of each and the ratio native / ours (above 1: ours is faster).
With ``--opaque``, compiled cases also time ours with
``torch_bn_grad.config.compile_lowering`` off (the operators opaque to
inductor), as a third variant in the same rounds. With ``--fuse``, every case
also times ours converted with ``convert_batchnorm(fuse=True)`` (BatchNorm +
activation, and + residual add, fused) as a further variant in the same rounds.
With ``--processes N`` the cases run in N fresh processes, one after the
other, and each row gives the medians over them and the range of each ratio
(``processes.py``).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

import torch_bn_grad
from torch_bn_grad import _compat, config
from torch_bn_grad.bench import processes as _processes
from torch_bn_grad.bench import resnets as _resnets
from torch_bn_grad.bench import speedup_plot as _plot
from torch_bn_grad.bench import timm_models as _timm_models

# The models --model takes: the project's ResNets, and timm's (built only when named).
MODELS = {**_resnets.MODELS, **_timm_models.MODELS}
_MODEL_WIDTH = max(len(name) for name in MODELS)
MODES = ("train", "eval")
LAYOUTS = ("contiguous", "channels_last")
EXECUTIONS = ("eager", "compile")
# CUDA only: the eager step captured whole with torch.cuda.graph and replayed,
# and torch.compile(mode="reduce-overhead") (inductor's CUDA graph trees).
CUDA_GRAPH_EXECUTIONS = ("cuda-graph", "reduce-overhead")


@dataclass
class ModelResult:
    """One row: median milliseconds per iteration and the ratios native / ours."""

    model: str
    mode: str
    layout: str
    execution: str
    batch: int
    resolution: int
    native_ms: float
    ours_ms: float
    speedup: float
    opaque_ms: Optional[float] = None
    opaque_speedup: Optional[float] = None
    fused_ms: Optional[float] = None
    fused_speedup: Optional[float] = None
    device: str = "cpu"
    # With --processes N: each ratio's lowest and highest over the processes.
    speedup_min: Optional[float] = None
    speedup_max: Optional[float] = None
    opaque_speedup_min: Optional[float] = None
    opaque_speedup_max: Optional[float] = None
    fused_speedup_min: Optional[float] = None
    fused_speedup_max: Optional[float] = None
    # With --autocast: the dtype the steps ran under torch.autocast with.
    autocast: Optional[str] = None


def _opaque_inductor(gm, example_inputs):
    """The default inductor backend, compiling with ``compile_lowering`` off.

    A backend of its own also keeps dynamo from reusing a graph compiled for
    another variant of the same model class."""
    compile_fx = _compat.inductor_compile_fx()
    previous = config.compile_lowering
    config.compile_lowering = False
    try:
        return compile_fx(gm, example_inputs)
    finally:
        config.compile_lowering = previous


def raise_recompile_limits() -> None:
    """Every variant recompiles the same model code; keep dynamo from giving up on it."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def under_autocast(run: Callable, device_type: str, autocast: Optional[str]) -> Callable:
    """`run` with its forward under torch.autocast(device_type) with `autocast`
    (a dtype's name), or `run` itself when `autocast` is None."""
    if autocast is None:
        return run
    dtype = getattr(torch, autocast)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype):
            return run(x)

    return forward


def _step_body(model: torch.nn.Module, run: Callable, mode: str, x: torch.Tensor, target: torch.Tensor,
               autocast: Optional[str] = None, static_grads: bool = False) -> Callable:
    """One iteration, not waited for; with `autocast` (a dtype's name) the
    forward runs under torch.autocast, as mixed-precision training runs it.
    `static_grads` (a step captured by torch.cuda.graph): the gradients are
    zeroed in place, never freed, so that each replay writes where the capture did."""
    forward = under_autocast(run, x.device.type, autocast)
    if mode == "eval":
        def evaluate() -> None:
            with torch.no_grad():
                forward(x)
        return evaluate
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def train() -> None:
        if static_grads:
            optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(forward(x).float(), target)
        loss.backward()
        optimizer.step()
        if not static_grads:
            optimizer.zero_grad(set_to_none=True)

    return train


def _step_fn(model: torch.nn.Module, run: Callable, mode: str, x: torch.Tensor, target: torch.Tensor,
             autocast: Optional[str] = None, graphed: bool = False) -> Callable:
    """One iteration (_step_body), finished on the device (a CUDA step waits
    for its kernels). `graphed`: the iteration is captured once with
    torch.cuda.graph, after warm-up steps on a side stream (torch's
    whole-network recipe), and each step replays it."""
    body = _step_body(model, run, mode, x, target, autocast, static_grads=graphed)
    if not x.is_cuda:
        return body
    if not graphed:
        def step() -> None:
            body()
            torch.cuda.synchronize()
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # A capture stream of its own: graphs captured on one stream share its cached
    # cuBLAS workspace, which a later capture can free under an earlier graph
    # (pytorch/pytorch#193402: illegal address on replay).
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        body()

    def replay() -> None:
        graph.replay()
        torch.cuda.synchronize()

    return replay


def run_case(model_name: str, mode: str, layout: str, execution: str, batch: int, resolution: int,
             iters: int, rounds: int, warmup: int, opaque: bool, num_classes: int = 1000,
             fuse: bool = False, device: str = "cpu", autocast: Optional[str] = None) -> ModelResult:
    """Time one case; every variant's iterations alternate, round by round."""
    torch.manual_seed(0)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    native = MODELS[model_name](num_classes).to(device, memory_format=memory_format).train(mode == "train")

    def converted(**kwargs) -> torch.nn.Module:
        # The default converts timm's BatchNormAct2d too.
        return torch_bn_grad.convert_batchnorm(copy.deepcopy(native), **kwargs)

    if execution in CUDA_GRAPH_EXECUTIONS and device != "cuda":
        raise SystemExit(f"--executions {execution} needs --device cuda")
    variants = {"native": native, "ours": converted()}
    compiled = execution in ("compile", "reduce-overhead")
    if compiled and opaque:
        variants["opaque"] = converted()
    if fuse:
        variants["fused"] = converted(fuse=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, resolution, resolution, generator=g).to(device, memory_format=memory_format)
    target = torch.randint(0, num_classes, (batch,), generator=g).to(device)
    steps = {}
    for name, model in variants.items():
        if not compiled:
            run = model
        elif name == "opaque":
            run = torch.compile(model, backend=_opaque_inductor)
        else:  # the default backend, inductor
            run = torch.compile(model, mode="reduce-overhead" if execution == "reduce-overhead" else None)
        steps[name] = _step_fn(model, run, mode, x, target, autocast, graphed=execution == "cuda-graph")
        for _ in range(warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(rounds):
        # Each round starts with another variant, so that none always runs first.
        for name in order[r % len(order):] + order[:r % len(order)]:
            step = steps[name]
            for _ in range(iters):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    result = ModelResult(model_name, mode, layout, execution, batch, resolution, round(ms["native"], 3),
                         round(ms["ours"], 3), round(ms["native"] / ms["ours"], 3), device=device, autocast=autocast)
    if "opaque" in ms:
        result.opaque_ms = round(ms["opaque"], 3)
        result.opaque_speedup = round(ms["native"] / ms["opaque"], 3)
    if "fused" in ms:
        result.fused_ms = round(ms["fused"], 3)
        result.fused_speedup = round(ms["native"] / ms["fused"], 3)
    return result


def run(model_name: str, modes, layouts, executions, batch: int, resolution: int, iters: int, rounds: int,
        warmup: int, opaque: bool, num_classes: int = 1000, log=print, fuse: bool = False,
        device: str = "cpu", autocast: Optional[str] = None) -> list[ModelResult]:
    """Every case; prints a row as each finishes."""
    raise_recompile_limits()
    log(table_header(opaque, fuse))
    results = []
    for execution in executions:
        for mode in modes:
            for layout in layouts:
                r = run_case(model_name, mode, layout, execution, batch, resolution, iters, rounds, warmup,
                             opaque, num_classes, fuse, device, autocast)
                results.append(r)
                log(table_row(r))
    return results


# Widths of the ratio columns (ours, opaque, fused); with --processes each
# column widens by _RANGE_WIDTH for the range, " (0.971-1.253)".
_RATIO_WIDTHS = (11, 13, 12)
_RANGE_WIDTH = 14


def table_header(opaque: bool, fuse: bool, spread: bool = False) -> str:
    """The table's column names; `spread`: each ratio with its range over processes."""
    ours, opaque_w, fused = (w + (_RANGE_WIDTH if spread else 0) for w in _RATIO_WIDTHS)
    header = (f"{'model':>{_MODEL_WIDTH}} {'mode':>5} {'layout':>13} {'execution':>9} {'native ms':>10} {'ours ms':>9} "
              f"{'native/ours':>{ours}}")
    if opaque:
        header += f" {'opaque ms':>10} {'native/opaque':>{opaque_w}}"
    if fuse:
        header += f" {'fused ms':>9} {'native/fused':>{fused}}"
    return header


def table_row(r: ModelResult) -> str:
    """One case's row; each ratio's range where it has one (--processes)."""
    def ratio(value: float, low: Optional[float], high: Optional[float], width: int) -> str:
        if low is None:
            return f"{value:>{width - 1}.3f}x"
        return f"{f'{value:.3f}x ({low:.3f}-{high:.3f})':>{width + _RANGE_WIDTH}}"

    ours, opaque, fused = _RATIO_WIDTHS
    line = (f"{r.model:>{_MODEL_WIDTH}} {r.mode:>5} {r.layout:>13} {r.execution:>9} {r.native_ms:>10.2f} "
            f"{r.ours_ms:>9.2f} {ratio(r.speedup, r.speedup_min, r.speedup_max, ours)}")
    if r.opaque_ms is not None:
        line += f" {r.opaque_ms:>10.2f} {ratio(r.opaque_speedup, r.opaque_speedup_min, r.opaque_speedup_max, opaque)}"
    if r.fused_ms is not None:
        line += f" {r.fused_ms:>9.2f} {ratio(r.fused_speedup, r.fused_speedup_min, r.fused_speedup_max, fused)}"
    return line


def plot(results: list[ModelResult], path: str) -> None:
    """Speedup of every variant in every case on a log axis (needs matplotlib):
    one labelled marker each, colour by variant (ours, fused, opaque), shape
    by execution, a line at 1.0x, the slower ones in red."""
    points = []
    for r in results:
        case = f"{r.model} {r.mode} {r.layout} {r.execution}"
        for variant, speedup in (("ours", r.speedup), ("fused", r.fused_speedup), ("opaque", r.opaque_speedup)):
            if speedup is not None:
                points.append(_plot.Point(f"{case} {variant}", speedup, variant, r.execution))
    title = (f"{results[0].model} batch {results[0].batch}, {results[0].resolution}x{results[0].resolution}: "
             f"torch_bn_grad vs torch {torch.__version__}") if results else "no cases"
    _plot.plot_speedups(points, path, title, colours={"ours": "tab:blue", "fused": "tab:green", "opaque": "tab:purple"},
                        markers={"eager": "o", "compile": "s", "cuda-graph": "^", "reduce-overhead": "D"})


def add_arguments(parser) -> None:
    """The ``--model`` options of ``python -m torch_bn_grad.bench``."""
    group = parser.add_argument_group("model benchmark (--model)")
    group.add_argument("--model", choices=sorted(MODELS),
                       help="time a whole model instead of the operators (the timm ones need timm)")
    add_input_arguments(group, batch_size=16, resolution=112)
    group.add_argument("--iters", type=int, default=3, help="iterations per variant per round")
    group.add_argument("--rounds", type=int, default=5, help="rounds alternating the variants")
    group.add_argument("--warmup", type=int, default=2, help="untimed iterations (compilation included)")
    group.add_argument("--modes", default=",".join(MODES))
    group.add_argument("--executions", default=",".join(EXECUTIONS), help="eager, compile (torch.compile, inductor); on CUDA also cuda-graph (the eager "
                       "step captured with torch.cuda.graph) and reduce-overhead (torch.compile's CUDA graphs)")
    group.add_argument("--num-classes", type=int, default=1000)
    group.add_argument("--opaque", action="store_true",
                       help="compiled cases also time ours with torch_bn_grad.config.compile_lowering off")
    group.add_argument("--fuse", action="store_true",
                       help="also time ours converted with convert_batchnorm(fuse=True) (BatchNorm+act(+add) fused)")


def add_input_arguments(parser, batch_size: int, resolution: int) -> None:
    """The model tools' input options: batch size, input size and mixed precision."""
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--resolution", type=int, default=resolution, help="input height and width")
    parser.add_argument("--autocast", choices=("bfloat16", "float16"),
                        help="run the forward under torch.autocast with this dtype (mixed precision)")


def summary(results: list[ModelResult]) -> str:
    """One line: per variant, the median ratio over the cases and the worst case."""
    parts = []
    for variant, field in (("ours", "speedup"), ("fused", "fused_speedup"), ("opaque", "opaque_speedup")):
        rated = [(getattr(r, field), r) for r in results if getattr(r, field) is not None]
        if not rated:
            continue
        worst, case = min(rated, key=lambda pair: pair[0])
        parts.append(f"{variant}: median {statistics.median(v for v, _ in rated):.3f}x, worst {case.mode} "
                     f"{case.layout} {case.execution} {worst:.3f}x")
    return f"{len(results)} cases, native / variant; " + "; ".join(parts)


def process_argv(args) -> list[str]:
    """The command line of one process of --processes: the cases and their timing, no outputs."""
    argv = ["--model", args.model, "--device", args.device, "--batch-size", str(args.batch_size),
            "--resolution", str(args.resolution), "--iters", str(args.iters), "--rounds", str(args.rounds),
            "--warmup", str(args.warmup), "--modes", args.modes, "--executions", args.executions,
            "--layouts", args.layouts, "--num-classes", str(args.num_classes)]
    argv += ["--opaque"] * args.opaque + ["--fuse"] * args.fuse
    if args.autocast:
        argv += ["--autocast", args.autocast]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return argv


def main(args) -> None:
    """Run the model benchmark for parsed ``args`` (see :func:`add_arguments`)."""
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    processes = f", median of {args.processes} processes" if args.processes > 1 else ""
    print(f"torch {torch.__version__}, {where}, {args.model}, batch {args.batch_size}, "
          f"{args.resolution}x{args.resolution}, median of {args.rounds} rounds x {args.iters} iterations"
          f"{processes}, compile_lowering={config.compile_lowering}"
          f"{f', autocast {args.autocast}' if args.autocast else ''}")
    if args.processes > 1:
        tables = _processes.run(process_argv(args), args.processes)
        results = [ModelResult(**row) for row in _processes.merge(tables, _processes.MODELS)]
        print(table_header(args.opaque, args.fuse, spread=True))
        for r in results:
            print(table_row(r))
    else:
        results = run(args.model, args.modes.split(","), args.layouts.split(","), args.executions.split(","),
                      args.batch_size, args.resolution, args.iters, args.rounds, args.warmup, args.opaque,
                      args.num_classes, fuse=args.fuse, device=args.device, autocast=args.autocast)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    if args.plot:
        plot(results, args.plot)
    print(summary(results))
