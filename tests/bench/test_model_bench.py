"""Smoke tests of the benchmarks (``torch_bn_grad/bench/``, run by ``python -m torch_bn_grad.bench``): the model
benchmark (``--model``), the op bench's plot and ``--processes``, tiny sizes; the checkout's allocator benchmark."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from torch_bn_grad.bench import models as _model_bench
from torch_bn_grad.bench import ops as bench
from torch_bn_grad.bench import processes
from torch_bn_grad.bench import resnets as _models

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(_models.MODELS))
def test_models_shapes_and_batchnorms(name):
    model = _models.MODELS[name](num_classes=7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    expected = {"resnet18": 20, "resnet50": 53}[name]
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == expected


def test_model_bench_eager_table_and_json(tmp_path, capsys):
    path = tmp_path / "model.json"
    bench.main(["--model", "resnet18", "--batch-size", "2", "--resolution", "32", "--iters", "1", "--rounds", "2",
                "--warmup", "1", "--executions", "eager", "--num-classes", "10", "--json", str(path)])
    out = capsys.readouterr().out
    assert "native/ours" in out
    rows = json.loads(path.read_text())
    assert {(r["mode"], r["layout"], r["execution"]) for r in rows} == {
        (m, lay, "eager") for m in ("train", "eval") for lay in ("contiguous", "channels_last")}
    for r in rows:
        assert r["native_ms"] > 0 and r["ours_ms"] > 0
        assert r["speedup"] == pytest.approx(r["native_ms"] / r["ours_ms"], rel=1e-2)


def test_model_bench_compiled_with_opaque_variant():
    torch._dynamo.reset()
    rows = _model_bench.run("resnet18", ["eval"], ["channels_last"], ["compile"], batch=2, resolution=32, iters=1,
                            rounds=1, warmup=1, opaque=True, num_classes=10, log=lambda *_: None)
    torch._dynamo.reset()
    (row,) = rows
    assert row.opaque_ms is not None and row.opaque_ms > 0 and row.ours_ms > 0


def test_op_bench_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    results = [
        bench.Result((8, 4, 5, 5), "cpu", "float32", "contiguous", "forward", 1.0, 0.5, 2.0, 1.0, 50.0),
        bench.Result((8, 4, 5, 5), "cpu", "bfloat16", "channels_last", "backward", 1.0, 2.0, 0.5, 1.0, 50.0),
    ]
    path = tmp_path / "plot.png"
    bench.plot(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_bench_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_model_bench.ModelResult("resnet18", "train", "channels_last", "eager", 2, 32, 1.0, 0.8, 1.25,
                                     fused_ms=1.25, fused_speedup=0.8),
            _model_bench.ModelResult("resnet18", "eval", "contiguous", "compile", 2, 32, 1.0, 1.0, 1.0,
                                     opaque_ms=1.1, opaque_speedup=0.91)]
    path = tmp_path / "models.png"
    _model_bench.plot(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_allocator_bench_environment_and_parse(monkeypatch):
    # The checkout's benchmarks/allocators.py (it runs examples/speed.py: not part of the package).
    spec = importlib.util.spec_from_file_location("benchmark_allocators", ROOT / "benchmarks" / "allocators.py")
    allocators = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, allocators)  # its dataclasses look their module up
    spec.loader.exec_module(allocators)
    monkeypatch.setenv("LD_PRELOAD", "/somewhere/libother.so")
    monkeypatch.setenv("TORCH_BN_GRAD_OUTPUT_CACHE_MB", "64")
    env = allocators.environment("jemalloc", "off")
    assert env["LD_PRELOAD"].endswith("libjemalloc.so.2") and env["TORCH_BN_GRAD_OUTPUT_CACHE_MB"] == "0"
    env = allocators.environment("thp", "on")
    assert env["THP_MEM_ALLOC_ENABLE"] == "1" and "LD_PRELOAD" not in env and "TORCH_BN_GRAD_OUTPUT_CACHE_MB" not in env
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")
    env = allocators.environment("glibc", "on")
    assert not any(name in env for name in allocators.GLIBC_KEEPS_MEMORY)  # the caller's do not leak in
    env = allocators.environment("glibc-kept", "off")
    assert env["MALLOC_MMAP_THRESHOLD_"] == "4000000000" and env["MALLOC_TOP_PAD_"] == "536870912"
    line = ("median training step (batch 128, 48x48, channels_last): torch BatchNorm 63.57 ms, "
            "torch_bn_grad 63.35 ms, speedup 1.00x")
    assert allocators.parse(f"epoch 1: ...\n{line}\n") == (63.57, 63.35)
    notes = []
    monkeypatch.setitem(allocators.ALLOCATORS, "jemalloc", ({}, allocators.ROOT / "no-such-lib.so"))
    assert allocators.available(["glibc", "jemalloc"], log=notes.append) == ["glibc"]
    assert "skipping jemalloc" in notes[0]


def _row(shape, dtype, speedup, native_ms=1.0):
    return {"shape": list(shape), "device": "cpu", "dtype": dtype, "layout": "contiguous", "direction": "forward",
            "native_ms": native_ms, "ours_ms": native_ms / speedup, "speedup": speedup, "gbps": 10.0,
            "bound_pct": 50.0, "speedup_min": None, "speedup_max": None}


def test_processes_merge_takes_medians_and_ranges():
    tables = [[_row((8, 4), "float32", 0.8), _row((8, 4), "float16", 2.0)],
              [_row((8, 4), "float16", 1.0), _row((8, 4), "float32", 1.2, native_ms=3.0)],
              [_row((8, 4), "float32", 1.1), _row((8, 4), "float16", 3.0)]]
    first, second = processes.merge(tables, processes.OPS)
    assert (first["dtype"], second["dtype"]) == ("float32", "float16")  # the first table's order
    assert first["speedup"] == 1.1 and (first["speedup_min"], first["speedup_max"]) == (0.8, 1.2)
    assert first["native_ms"] == 1.0 and second["speedup"] == 2.0
    with pytest.raises(ValueError, match="different cases"):
        processes.merge([tables[0], tables[1][:1]], processes.OPS)
    with pytest.raises(ValueError, match="no tables"):
        processes.merge([], processes.OPS)


def _model_row(mode, speedup, fused=None):
    row = asdict(_model_bench.ModelResult("resnet18", mode, "channels_last", "eager", 2, 32, 10.0, 10.0 / speedup,
                                          speedup))
    if fused is not None:
        row.update(fused_ms=10.0 / fused, fused_speedup=fused)
    return row


def test_processes_merge_model_rows_keeps_untimed_variants_none():
    tables = [[_model_row("train", 0.9, 1.2), _model_row("eval", 1.0)],
              [_model_row("eval", 1.4), _model_row("train", 1.1, 1.0)],
              [_model_row("train", 1.0, 1.1), _model_row("eval", 1.2)]]
    train, evaluation = processes.merge(tables, processes.MODELS)
    assert (train["mode"], train["speedup"], train["speedup_min"], train["speedup_max"]) == ("train", 1.0, 0.9, 1.1)
    assert (train["fused_speedup"], train["fused_speedup_min"], train["fused_speedup_max"]) == (1.1, 1.0, 1.2)
    assert train["opaque_speedup"] is None and train["opaque_speedup_min"] is None
    assert evaluation["fused_ms"] is None and evaluation["speedup"] == 1.2
    line = _model_bench.summary([_model_bench.ModelResult(**row) for row in (train, evaluation)])
    assert line == ("2 cases, native / variant; ours: median 1.100x, worst train channels_last eager 1.000x; "
                    "fused: median 1.100x, worst train channels_last eager 1.100x")


def test_model_bench_in_processes_prints_ranges(tmp_path, capsys):
    path = tmp_path / "models.json"
    bench.main(["--model", "resnet18", "--batch-size", "2", "--resolution", "32", "--rounds", "1", "--iters", "1",
                "--warmup", "1", "--executions", "eager", "--modes", "eval", "--layouts", "contiguous", "--fuse",
                "--processes", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert "median of 2 processes" in out and "process 2/2 done" in out and "fused: median" in out
    (row,) = json.loads(path.read_text())
    assert (row["model"], row["mode"], row["layout"], row["execution"]) == ("resnet18", "eval", "contiguous", "eager")
    for ratio in ("speedup", "fused_speedup"):
        assert row[f"{ratio}_min"] <= row[ratio] <= row[f"{ratio}_max"]


def test_op_bench_summary_names_the_worst_case():
    def result(speedup, lo=None, hi=None, dtype="float32"):
        return bench.Result((8, 4), "cpu", dtype, "contiguous", "forward", 1.0, 1.0 / speedup, speedup, 1.0, 1.0,
                            lo, hi)
    line = bench.summary([result(1.5), result(0.9, dtype="float16"), result(2.0)])
    assert line.startswith("3 cases, median speedup 1.50x, 1 slower than native")
    assert "worst: (8, 4) float16 contiguous forward 0.90x" in line
    line = bench.summary([result(0.9, 0.8, 1.1), result(0.95, 0.9, 0.97), result(1.2, 1.1, 1.3)])
    assert "2 slower than native (1 of them in every process)" in line


def test_op_bench_shapes_in_processes_table_and_json(tmp_path, capsys):
    path = tmp_path / "ops.json"
    bench.main(["--shapes", "6x3x4x4", "--dtypes", "float32", "--directions", "forward,backward",
                "--min-run-time", "0.01", "--processes", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert "median of 2 processes" in out and "speedup range" in out and "worst: (6, 3, 4, 4)" in out
    rows = json.loads(path.read_text())
    assert {(tuple(r["shape"]), r["layout"], r["direction"]) for r in rows} == {
        ((6, 3, 4, 4), layout, direction) for layout in ("contiguous", "channels_last")
        for direction in ("forward", "backward")}
    for r in rows:
        assert r["native_ms"] > 0 and r["ours_ms"] > 0 and r["speedup_min"] <= r["speedup"] <= r["speedup_max"]


def test_op_bench_eval_times_frozen_statistics(capsys):
    native, ours, traffic = bench.make_case((4, 3, 5, 5), torch.float32, "channels_last", "eval")
    expected, _, _ = torch.ops.aten.native_batch_norm(*_eval_inputs(), False, 0.1, 1e-5)
    out, _, _ = ours()
    assert torch.allclose(out, native()[0], atol=1e-5) and torch.allclose(out, expected, atol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last) and traffic == 2 * out.nbytes
    bench.main(["--shapes", "6x3x4x4", "--dtypes", "bfloat16", "--layouts", "channels_last", "--directions", "eval",
                "--min-run-time", "0.01"])
    assert "channels_last      eval" in capsys.readouterr().out


def _eval_inputs():
    """make_case's tensors for (4, 3, 5, 5) float32 channels_last, and the batch statistics."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((4, 3, 5, 5), generator=g).contiguous(memory_format=torch.channels_last)
    torch.randn((4, 3, 5, 5), generator=g)  # dy
    w, b = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    return x, w, b, x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "32xfoo"], "expected a shape like 32x64x56x56"),
    (["--shapes", "7"], "expected a shape like 32x64x56x56"),
    (["--processes", "0"], "--processes: expected a count >= 1, got 0"),
    (["--model", "resnet18", "--shapes", "8x4"], "not of --model"),
    (["--directions", "forward,inference"], "--directions: expected names of forward, backward, module, eval, "
                                             "got 'inference'"),
])
def test_op_bench_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_model_bench_times_a_timm_model_with_its_fused_variant():
    pytest.importorskip("timm")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # every BatchNormAct2d converted and fused
        (row,) = _model_bench.run("efficientnet_b0", ["train"], ["channels_last"], ["eager"], batch=2, resolution=32,
                                  iters=1, rounds=1, warmup=1, opaque=False, num_classes=10,
                                  log=lambda *_: None, fuse=True)
    assert row.model == "efficientnet_b0" and row.native_ms > 0 and row.ours_ms > 0 and row.fused_ms > 0


def test_processes_check_they_import_the_parents_package(monkeypatch, tmp_path):
    import torch_bn_grad

    monkeypatch.setenv(processes.PACKAGE_ROOT_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="imported torch_bn_grad from"):
        processes.check_package(torch_bn_grad)
    monkeypatch.setenv(processes.PACKAGE_ROOT_ENV, str(processes.package_root(torch_bn_grad)))
    processes.check_package(torch_bn_grad)


def test_processes_of_a_package_outside_the_source_tree_time_that_package(tmp_path):
    # The A/B set-up: a copy of the package (an old build), imported through PYTHONPATH from a folder that
    # is not the source tree. Each process puts its parent's package first on sys.path and checks that it
    # imported the copy (processes.check_package) or fails.
    import torch_bn_grad

    package = Path(torch_bn_grad.__file__).resolve().parent
    shutil.copytree(package, tmp_path / "torch_bn_grad", ignore=shutil.ignore_patterns("__pycache__"))
    mark = tmp_path / "imports.txt"  # a line per process that imported the copy
    with open(tmp_path / "torch_bn_grad" / "__init__.py", "a") as f:
        f.write(f"\nopen({str(mark)!r}, 'a').write('imported\\n')\n")
    code = ("import torch_bn_grad, sys; assert torch_bn_grad.__file__.startswith(sys.argv[1]); "
            "from torch_bn_grad import bench; bench.main(['--shapes', '4x8x3x3', '--dtypes', 'float32', "
            "'--layouts', 'contiguous', '--directions', 'forward', '--min-run-time', '0.01', '--processes', '2'])")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "process 2/2 done" in done.stdout
    assert mark.read_text().count("imported") == 3  # the parent and both processes


def test_model_bench_autocast_runs_the_forward_in_that_dtype(tmp_path):
    # The step's convolutions (and so the BatchNorms' inputs) are bfloat16 under --autocast.
    model = _models.MODELS["resnet18"](num_classes=10)
    seen = []
    first_bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    first_bn.register_forward_hook(lambda m, inputs, output: seen.append(inputs[0].dtype))
    x, target = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    _model_bench._step_fn(model, model, "train", x, target, "bfloat16")()
    _model_bench._step_fn(model, model, "eval", x, target)()
    assert seen == [torch.bfloat16, torch.float32]
    assert all(p.grad is None for p in model.parameters())  # the optimizer's step zeroed them
    path = tmp_path / "amp.json"
    bench.main(["--model", "resnet18", "--batch-size", "2", "--resolution", "32", "--iters", "1", "--rounds", "1",
                "--warmup", "1", "--executions", "eager", "--modes", "train", "--layouts", "channels_last",
                "--num-classes", "10", "--autocast", "bfloat16", "--json", str(path)])
    (row,) = json.loads(path.read_text())
    assert row["autocast"] == "bfloat16" and row["ours_ms"] > 0
    args = SimpleNamespace(model="resnet18", device="cpu", batch_size=2, resolution=32, iters=1, rounds=1, warmup=1,
                           modes="train", executions="eager", layouts="contiguous", num_classes=10, opaque=False,
                           fuse=False, threads=None, autocast="float16")
    assert _model_bench.process_argv(args)[-2:] == ["--autocast", "float16"]


def test_eval_processes_bench_times_each_variant_alone():
    # The checkout's benchmarks/eval_processes.py: one variant in this process, then the
    # whole command (a fresh process a variant), tiny sizes.
    spec = importlib.util.spec_from_file_location("benchmark_eval_processes", ROOT / "benchmarks" / "eval_processes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = module.time_one("fused", "resnet18", 1, 16, "channels_last", 2)
    assert row["ms"] > 0 and row["faults"] >= 0
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eval_processes.py"), "--model", "resnet18",
                           "--batch-size", "1", "--resolution", "16", "--processes", "1", "--steps", "1",
                           "--keep-memory"], capture_output=True, text=True, check=True)
    lines = done.stdout.strip().splitlines()
    assert "glibc keeping its memory" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == list(module.VARIANTS)
