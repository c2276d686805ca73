"""Where a ResNet training step spends device time: torch.profiler's kernel
table (self time, top rows) for the native model, ours (``convert_batchnorm``)
and fused (``convert_batchnorm(fuse=True)``), one after the other in one process.

    python benchmarks/profile_model.py [--model resnet50] [--device cuda] [--layout channels_last]
                                       [--batch-size 64] [--resolution 224] [--steps 3] [--rows 30]
                                       [--by-shape | --breakdown] [--eval] [--compile] [--autocast bfloat16|float16]

The "Self CUDA time total" (or CPU total on the CPU) line of each table is the
sum over ``--steps`` steps; the wall time of a step is the model benchmark's
(``python -m torch_bn_grad.bench --model ...``).

``--by-shape`` prints instead, per input shape, the batch norm operators'
self time per step inside the model, native's against ours (CPU; each
model profiled twice, interleaved, and the two profiles averaged).

``--breakdown`` prints instead each model's self time per step by kind of
operator (convolution, batch norm, activation, addition, other) and Amdahl's
bound on the speedup of ours and fused, from native's shares
(``benchmarks/step_breakdown.py``; CPU, profiles interleaved and averaged as
for ``--by-shape``).

``--compile`` profiles the models compiled with ``torch.compile`` (the
default inductor backend), inductor's CPU kernels named by their fused
operators: a kernel whose name holds ``batch_norm`` counts as batch norm,
whatever activation or addition inductor fused into it.

``--eval`` profiles eval forwards (the models in eval mode, under
``torch.no_grad``) in place of training steps, with every table above: where an
inference spends its time, and what a faster batch norm can gain there.

``--autocast`` runs the forward under ``torch.autocast`` with that dtype
(mixed precision: the batch norms take the convolutions' half-precision
outputs).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import torch_bn_grad

if __package__ in (None, ""):  # run as a script: the source tree's `benchmarks` package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import step_breakdown
from torch_bn_grad import _compat
from torch_bn_grad.bench import resnets
from torch_bn_grad.bench.models import add_input_arguments, raise_recompile_limits, under_autocast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(resnets.MODELS), default="resnet50")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layout", choices=("contiguous", "channels_last"), default="channels_last")
    add_input_arguments(parser, batch_size=64, resolution=224)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--by-shape", action="store_true", help="batch norm time per layer shape, native vs ours")
    parser.add_argument("--breakdown", action="store_true",
                        help="self time per step by kind of operator, and the speedup bound of ours and fused")
    parser.add_argument("--eval", action="store_true", help="eval forwards in place of training steps")
    parser.add_argument("--compile", action="store_true",
                        help="profile the models compiled with torch.compile (inductor), CPU kernels named")
    args = parser.parse_args()
    if args.by_shape and args.breakdown:
        parser.error("--by-shape and --breakdown: choose one")
    if (args.by_shape or args.breakdown or args.compile) and args.device != "cpu":
        parser.error(f"--by-shape, --breakdown and --compile profile the CPU: expected --device cpu, got {args.device}")
    if args.by_shape and args.compile:
        parser.error("--by-shape times this library's and torch's batch norm operators, which a compiled "
                     "model does not call: use --breakdown --compile")
    cuda = args.device == "cuda"
    fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    native = resnets.MODELS[args.model](1000).to(args.device, memory_format=fmt)
    models = {"native": native, "ours": torch_bn_grad.convert_batchnorm(copy.deepcopy(native))}
    if not args.by_shape:
        models["fused"] = torch_bn_grad.convert_batchnorm(copy.deepcopy(native), fuse=True)
    for model in models.values():
        model.train(not args.eval)
    what = "eval forward" if args.eval else "training step"
    runs = models
    if args.compile:
        _compat.inductor_kernel_profile()
        raise_recompile_limits()
        runs = {name: torch.compile(model) for name, model in models.items()}
    runs = {name: under_autocast(run, args.device, args.autocast) for name, run in runs.items()}
    x = torch.randn(args.batch_size, 3, args.resolution, args.resolution).to(args.device, memory_format=fmt)
    target = torch.randint(0, 1000, (args.batch_size,)).to(args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if args.breakdown:
        kinds = _interleaved_per_step(
            models, runs, x, target, args.steps, False, args.eval,
            lambda prof: step_breakdown.by_kind((e.key, e.self_cpu_time_total) for e in prof.key_averages()))
        print(f"{args.model} {args.layout} batch {args.batch_size} {args.resolution}x{args.resolution}"
              f"{', compiled' if args.compile else ''}{_autocast_note(args)}, self time per {what} (CPU, ms), "
              f"by kind of operator")
        print("\n".join(step_breakdown.report(kinds)))
        return
    if args.by_shape:
        shapes = _interleaved_per_step(models, runs, x, target, args.steps, True, args.eval, _batch_norm_by_shape)
        print(f"{args.model} {args.layout} batch {args.batch_size} {args.resolution}x{args.resolution}"
              f"{_autocast_note(args)}, batch norm self time per {what} (CPU, us), by input shape")
        for key in sorted(shapes["native"]):
            n, o = shapes["native"][key], shapes["ours"].get(key, float("nan"))
            print(f"{key[0]:9s} {key[1]:20s} native {n:9.1f}  ours {o:9.1f}  {n / o:5.2f}x")
        print(f"total     native {sum(shapes['native'].values()):9.1f}  ours {sum(shapes['ours'].values()):9.1f}")
        return
    for name, model in models.items():
        prof = _profile(model, runs[name], x, target, args.steps, activities, sync, args.eval)
        print(f"===== {name}: {args.model} {args.layout} batch {args.batch_size} {args.resolution}x{args.resolution}, "
              f"{args.steps} {'compiled ' if args.compile else ''}{what}s on {args.device}")
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=110))


def _autocast_note(args) -> str:
    return f", autocast {args.autocast}" if args.autocast else ""


# The batch norm operators of both implementations, forward and backward.
_FORWARD = ("aten::native_batch_norm", "torch_bn_grad::batch_norm_forward")
_BACKWARD = ("aten::native_batch_norm_backward", "torch_bn_grad::batch_norm_backward")


def _batch_norm_by_shape(prof) -> dict[tuple[str, str], float]:
    """Self CPU microseconds of the batch norm operators, keyed by (direction, input shape)."""
    times: dict[tuple[str, str], float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in _FORWARD + _BACKWARD:
            continue
        # native's backward takes (grad_out, input, ...), ours (input, grad_out, ...): both shapes agree
        key = ("backward" if event.key in _BACKWARD else "forward", "x".join(map(str, event.input_shapes[0])))
        times[key] = times.get(key, 0.0) + event.self_cpu_time_total
    return times


def _interleaved_per_step(models: dict, runs: dict, x, target, steps: int, shapes: bool, eval_mode: bool,
                          times_of) -> dict[str, dict]:
    """Per model, `times_of(profile)` (key -> self CPU us) per step (a training
    step, or with `eval_mode` an eval forward),
    averaged over two CPU profiles of each model taken in turn (all models,
    then all again), so that a drift of the machine falls on every model.
    `runs[name]` is what runs `models[name]` (the model itself, or compiled)."""
    per_step: dict[str, dict] = {name: {} for name in models}
    for name in list(models) * 2:
        prof = _profile(models[name], runs[name], x, target, steps, [ProfilerActivity.CPU], lambda: None,
                        eval_mode, shapes=shapes)
        for key, us in times_of(prof).items():
            per_step[name][key] = per_step[name].get(key, 0.0) + us / (2 * steps)
    return per_step


def _profile(model, run, x, target, steps: int, activities, sync, eval_mode: bool = False, shapes: bool = False):
    """A profile of `steps` training steps of `model` (eval forwards with
    `eval_mode`), run by `run` (the model, or compiled), after as many
    unprofiled ones (the first compiles)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        if eval_mode:
            with torch.no_grad():
                run(x)
            return
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(run(x).float(), target).backward()
        optimizer.step()

    for _ in range(steps):
        step()  # warm-up: allocator, cuDNN's algorithm choice
    sync()
    with profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(steps):
            step()
        sync()
    return prof


if __name__ == "__main__":
    main()
