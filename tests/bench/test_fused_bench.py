"""Smoke tests of the fused benchmarks, tiny sizes: ``benchmarks/fused.py`` (its
three variants compute the same gradients) and ``--model ... --fuse``; the
LeakyReLU ResNet that ``examples/peak_memory.py`` fuses with memory_saving;
``benchmarks/profile_model.py``'s three tables and its ``--breakdown`` by kind
of operator (``benchmarks/step_breakdown.py``)."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

import torch_bn_grad
from torch_bn_grad.bench import models as _model_bench
from torch_bn_grad.bench import resnets as _models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _checkout_benchmark(name: str):
    """The checkout's ``benchmarks/<name>.py`` (not part of the installed package)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("residual", [False, True])
def test_op_bench_variants_agree(layout, residual):
    bench = _checkout_benchmark("fused")
    steps = bench.make_steps((4, 3, 5, 5), torch.float32, layout, residual)
    results = {name: step() for name, step in steps.items()}
    for name in ("ours", "fused"):
        for got, want in zip(results[name], results["torch"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    ms = bench.time_interleaved(steps, rounds=2, iters=1)
    assert set(ms) == {"torch", "ours", "fused"} and all(v > 0 for v in ms.values())


def test_model_bench_fuse_variant():
    (row,) = _model_bench.run("resnet18", ["train"], ["contiguous"], ["eager"], batch=2, resolution=32, iters=1,
                              rounds=1, warmup=1, opaque=False, num_classes=10, log=lambda *_: None, fuse=True)
    assert row.fused_ms > 0 and row.fused_speedup == pytest.approx(row.native_ms / row.fused_ms, rel=1e-2)


def test_leaky_resnet_fuses_with_memory_saving():
    model = _models.resnet18(10, negative_slope=0.01).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every site fuses: no warning
        fused = torch_bn_grad.convert_batchnorm(model, fuse=True, memory_saving=True)
    modules = [m for m in fused.modules() if isinstance(m, torch_bn_grad.nn.BatchNormActBase)]
    assert len(modules) == 17 and all(m.activation == "leaky_relu" and m.memory_saving for m in modules)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(fused.eval()(x), model.eval()(x))


def _profile_model(*args: str, check: bool = True):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "profile_model.py"), "--device", "cpu", "--model", "resnet18",
         "--batch-size", "2", "--resolution", "32", "--steps", "1", *args],
        capture_output=True, text=True, check=check, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
    )


def test_profile_model_tables_the_three_models():
    """``benchmarks/profile_model.py`` profiles native, ours and fused, one table each."""
    out = _profile_model("--rows", "3").stdout
    headers = [line.split(":")[0] for line in out.splitlines() if line.startswith("=====")]
    assert headers == ["===== native", "===== ours", "===== fused"]
    assert out.count("Self CPU time total") == 3


def test_profile_model_by_shape_pairs_every_layer_shape():
    """``--by-shape``: one row per (direction, input shape) of the model's batch
    norm layers, native's time against ours, and the totals."""
    out = _profile_model("--by-shape").stdout
    rows = [line.split() for line in out.splitlines() if line.startswith(("forward", "backward"))]
    # ResNet-18 at 32x32, batch 2: batch norm inputs of 64 channels at 8x8 down to 512 at 1x1.
    shapes = {(r[0], r[1]) for r in rows}
    assert ("forward", "2x64x8x8") in shapes and ("backward", "2x512x1x1") in shapes
    assert all(r[2] == "native" and r[4] == "ours" and float(r[3]) > 0 and float(r[5]) > 0 for r in rows)
    assert sum(r[0] == "forward" for r in rows) == sum(r[0] == "backward" for r in rows)
    assert out.splitlines()[-1].startswith("total")


def test_step_breakdown_kinds_and_bound():
    """``benchmarks/step_breakdown.py``: each profiler event gets its kind, and
    Amdahl's bound is the step over what is left without the replaced kinds."""
    sb = _checkout_benchmark("step_breakdown")

    assert sb.kind_of("aten::native_batch_norm_backward") == "batch norm"
    assert sb.kind_of("torch_bn_grad::batch_norm_act_forward_sign_bits") == "batch norm"
    assert sb.kind_of("autograd::engine::evaluate_function: NativeBatchNormBackward0") == "batch norm"
    assert sb.kind_of("aten::convolution_backward") == sb.kind_of("aten::mkldnn_convolution") == "convolution"
    assert sb.kind_of("aten::threshold_backward") == sb.kind_of("aten::clamp_min_") == "activation"
    assert sb.kind_of("aten::add_") == "addition" and sb.kind_of("aten::addmm") == "other"
    # inductor's kernels (compiled steps), by the operators they fused
    assert sb.kind_of("graph_0_cpp_fused_add_convolution_backward_native_batch_norm_backward_threshold_b_3") \
        == "batch norm"
    assert sb.kind_of("graph_1_cpp_fused_add_batch_norm_forward_copy__lerp_mul_relu_7") == "batch norm"
    assert sb.kind_of("graph_1_cpp_fused_add_threshold_backward_7") == "activation"
    assert sb.kind_of("graph_0_cpp_fused_convolution_backward_sum_2") == "other"
    assert sb.kind_of("graph_0_cpp_fused_add_copy__0") == "other"
    times = sb.by_kind([("aten::mkldnn_convolution", 80.0), ("aten::native_batch_norm", 10.0),
                        ("aten::relu_", 4.0), ("aten::add_", 1.0), ("aten::mm", 5.0)])
    assert times == {"convolution": 80.0, "batch norm": 10.0, "activation": 4.0, "addition": 1.0, "other": 5.0}
    assert sb.bound(times, ("batch norm",)) == pytest.approx(100 / 90)
    assert sb.bound(times, sb.REPLACED["fused"]) == pytest.approx(100 / 85)
    lines = sb.report({"native": times, "ours": dict(times, **{"batch norm": 5.0})})
    assert lines[-2].startswith("ours: replaces batch norm: 10.0% of native's step, so its step is at most 1.111x")
    assert lines[-2].endswith("(profiled: 1.053x)") and "profiled" not in lines[-1]


def _breakdown_rows(out: list[str]) -> dict[str, list[float]]:
    """--breakdown's table: kind -> times of native, ours, fused (the total row last)."""
    header = out.index(next(line for line in out if line.split() == ["native", "ours", "fused"]))
    return {line[:12].strip(): [float(v) for v in line[12:].split()] for line in out[header + 1:header + 7]}


def test_profile_model_breakdown_tables_the_kinds():
    """``--breakdown``: a row per kind of operator, a column per model, and the bounds."""
    out = _profile_model("--breakdown").stdout.splitlines()
    rows = _breakdown_rows(out)
    assert list(rows) == ["convolution", "batch norm", "activation", "addition", "other", "total"]
    assert rows["activation"][2] == 0.0 and rows["convolution"][0] > 0
    assert all(abs(sum(rows[k][i] for k in list(rows)[:5]) - rows["total"][i]) < 0.2 for i in range(3))
    assert out[-2].startswith("ours: replaces batch norm:") and out[-1].startswith("fused: replaces batch norm,")


def test_profile_model_eval_profiles_forwards():
    """``--eval``: the eval forwards' batch norm per shape (no backward rows) and their breakdown."""
    out = _profile_model("--eval", "--by-shape").stdout
    assert "per eval forward" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("forward", "backward"))]
    assert rows and all(r[0] == "forward" and float(r[3]) > 0 and float(r[5]) > 0 for r in rows)
    out = _profile_model("--eval", "--breakdown").stdout.splitlines()
    rows = _breakdown_rows(out)
    assert rows["batch norm"][0] > 0 and rows["activation"][2] == 0.0 and rows["addition"][2] == 0.0
    assert out[-2].startswith("ours: replaces batch norm:")


def test_profile_model_compile_refuses_by_shape():
    """``--compile --by-shape``: a compiled model calls neither batch norm operator; said before compiling."""
    done = _profile_model("--by-shape", "--compile", check=False)
    assert done.returncode == 2 and "use --breakdown --compile" in done.stderr


@pytest.mark.slow  # compiles three ResNet-18s
def test_profile_model_breakdown_of_compiled_models():
    """``--breakdown --compile``: inductor's kernels are named, so native's fused
    batch norm kernels count as batch norm, not as other."""
    out = _profile_model("--breakdown", "--compile").stdout.splitlines()
    assert any(line.endswith("compiled, self time per training step (CPU, ms), by kind of operator") for line in out)
    rows = _breakdown_rows(out)
    assert rows["batch norm"][0] > 0 and rows["batch norm"][1] > 0 and rows["convolution"][0] > 0
