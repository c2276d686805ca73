"""Masked batch norm on padded batches: one module training step (forward and
backward) of the masked BatchNorm1d, against this library's unmasked
BatchNorm1d on the same tensor, against the gather -> torch BatchNorm1d ->
scatter workaround and against ``torch_ops``: a masked BatchNorm1d written
from torch operations as PyTorch code usually writes one (masked sums,
E[x^2] - E[x]^2, ``benchmarks/masked_torch_ops.py``).

With ``--activation``, the fused BatchNormAct1d with a residual instead (the
workaround adds the residual and applies the activation after the scatter),
and a fourth variant, ``composed``: the masked BatchNorm1d, then the residual
and the activation as torch operations (what the fused module runs on CUDA).

    python benchmarks/masked.py [--device cpu|cuda] [--threads 2] [--processes 3] [--iters 20]
                                [--activation relu|leaky_relu|silu|identity] [--json FILE]

Lengths are drawn between L/3 and L. The variants run interleaved, in a fresh
random order each turn; each process reports the median time of each variant,
and the table shows, per case, the median over the processes (fresh
processes: where a process's memory lands moves a case's time on a shared
VM more than repeated timings within one process do). On CUDA each step
waits for its kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks._per_call import alternating_medians_us  # noqa: E402
from benchmarks.masked_torch_ops import TorchOpsMaskedBatchNorm1d  # noqa: E402
CASES = [((32, 256, 400), torch.float32), ((16, 144, 1000), torch.float32), ((32, 256, 400), torch.bfloat16)]


def variants(activation: Optional[str]) -> tuple[str, ...]:
    return ("masked", "unmasked", "workaround", "torch_ops") + (("composed",) if activation else ())


def make_steps(shape: tuple, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
               activation: Optional[str] = None) -> dict[str, Callable[[], object]]:
    import torch_bn_grad
    from torch_bn_grad._rules import activation as _activation
    from torch_bn_grad._forward.masked import masked_add_activate

    n, c, length = shape
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 3, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(device)
    x = torch.randn(shape, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device, dtype)
    torch_bn = torch.nn.BatchNorm1d(c).to(device, dtype)
    torch_ops_bn = TorchOpsMaskedBatchNorm1d(c).to(device, dtype)
    finish = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if activation is None:
        ours = torch_bn_grad.nn.BatchNorm1d(c).to(device, dtype)
        residual_args: tuple = ()

        def epilogue(y: torch.Tensor) -> torch.Tensor:
            return y
    else:
        ours = torch_bn_grad.nn.BatchNormAct1d(c, activation=activation).to(device, dtype)
        plain = torch_bn_grad.nn.BatchNorm1d(c).to(device, dtype)
        residual = torch.randn(shape, generator=g).to(device, dtype).requires_grad_()
        residual_args = (residual,)

        def epilogue(y: torch.Tensor) -> torch.Tensor:
            return _activation.activate(y + residual, activation, ours.negative_slope)

    def masked() -> object:
        ours(x, *residual_args, mask=mask).backward(dy)
        finish()

    def unmasked() -> object:
        ours(x, *residual_args).backward(dy)
        finish()

    def workaround() -> object:
        valid = torch_bn(x.transpose(1, 2)[mask])  # (valid positions, C)
        out = x.new_zeros(n, length, c).index_put((mask,), valid).transpose(1, 2)
        out = torch.where(mask.unsqueeze(1), epilogue(out), 0) if activation else out
        out.backward(dy)
        finish()

    def torch_ops() -> object:
        out = torch_ops_bn(x, mask)
        out = torch.where(mask.unsqueeze(1), epilogue(out), 0) if activation else out
        out.backward(dy)
        finish()

    steps = {"masked": masked, "unmasked": unmasked, "workaround": workaround, "torch_ops": torch_ops}
    if activation is not None:
        def composed() -> object:
            masked_add_activate(plain(x, mask), mask, residual, activation, ours.negative_slope).backward(dy)
            finish()

        steps["composed"] = composed
    return steps


def time_case(shape: tuple, dtype: torch.dtype, iters: int, device: str = "cpu",
              activation: Optional[str] = None) -> dict[str, float]:
    """Median milliseconds per step of each variant, interleaved."""
    steps = make_steps(shape, dtype, device, activation=activation)
    for step in steps.values():  # warm-up: allocator, caches, OpenMP pool
        step()
    return {name: us / 1e3 for name, us in alternating_medians_us(steps, iters).items()}


def one_process(iters: int, device: str = "cpu", activation: Optional[str] = None) -> list[dict]:
    rows = []
    for shape, dtype in CASES:
        ms = time_case(shape, dtype, iters, device, activation)
        rows.append({"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), **ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--activation", choices=("relu", "leaky_relu", "silu", "identity"),
                        help="time the fused BatchNormAct1d with a residual")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # one process's rows as JSON
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.single:
        print(json.dumps(one_process(args.iters, args.device, args.activation)))
        return
    runs = []
    for _ in range(args.processes):
        command = [sys.executable, __file__, "--single", "--device", args.device, "--threads", str(args.threads),
                   "--iters", str(args.iters)] + (["--activation", args.activation] if args.activation else [])
        out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for i, row in enumerate(runs[0]):
        merged = {"shape": row["shape"], "dtype": row["dtype"]}
        for name in variants(args.activation):
            merged[name] = statistics.median(run[i][name] for run in runs)
        ratios = [run[i]["masked"] / run[i]["unmasked"] for run in runs]
        speedups = [run[i]["workaround"] / run[i]["masked"] for run in runs]
        merged["masked_over_unmasked"] = statistics.median(ratios)
        merged["masked_over_unmasked_range"] = [min(ratios), max(ratios)]
        merged["speedup_over_workaround"] = statistics.median(speedups)
        merged["speedup_over_workaround_range"] = [min(speedups), max(speedups)]
        over_ops = [run[i]["torch_ops"] / run[i]["masked"] for run in runs]
        merged["speedup_over_torch_ops"] = statistics.median(over_ops)
        merged["speedup_over_torch_ops_range"] = [min(over_ops), max(over_ops)]
        if args.activation:
            fusion = [run[i]["composed"] / run[i]["masked"] for run in runs]
            merged["speedup_over_composed"] = statistics.median(fusion)
            merged["speedup_over_composed_range"] = [min(fusion), max(fusion)]
        rows.append(merged)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.threads} threads"
    module = f"BatchNormAct1d ({args.activation}, residual)" if args.activation else "BatchNorm1d"
    print(f"{module} training step (forward + backward), {where}, median of {args.processes} processes "
          f"x {args.iters} steps, ms")
    composed = f" {'composed':>9} {'composed/masked':>16}" if args.activation else ""
    print(f"{'shape':>16} {'dtype':>9} {'masked':>8} {'unmasked':>9} {'workaround':>11} {'masked/unmasked':>16} "
          f"{'workaround/masked':>18} {'torch_ops':>9} {'torch_ops/masked':>17}{composed}")
    for r in rows:
        lo, hi = r["masked_over_unmasked_range"]
        slo, shi = r["speedup_over_workaround_range"]
        olo, ohi = r["speedup_over_torch_ops_range"]
        line = (f"{str(tuple(r['shape'])):>16} {r['dtype']:>9} {r['masked']:8.2f} {r['unmasked']:9.2f} "
                f"{r['workaround']:11.2f} {r['masked_over_unmasked']:6.2f} ({lo:.2f}-{hi:.2f}) "
                f"{r['speedup_over_workaround']:7.2f} ({slo:.2f}-{shi:.2f}) {r['torch_ops']:9.2f} "
                f"{r['speedup_over_torch_ops']:6.2f} ({olo:.2f}-{ohi:.2f})")
        if args.activation:
            clo, chi = r["speedup_over_composed_range"]
            line += f" {r['composed']:9.2f} {r['speedup_over_composed']:6.2f} ({clo:.2f}-{chi:.2f})"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "threads": args.threads, "processes": args.processes,
                                               "iters": args.iters, "activation": args.activation, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
