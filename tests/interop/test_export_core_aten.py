"""Eval-mode programs in core ATen: ``torch.export.export`` keeps this library's
eval forward (the ``.frozen_composite`` overloads, our kernels when run with
the library loaded) and ``run_decompositions()`` with the default table turns
it into torch's ``_native_batch_norm_legit_no_training`` and torch operators,
so the program runs, saved and loaded, in a process without this library, and
AOTInductor packages it without our operators. Training programs keep them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import artifacts, functional
from torch_bn_grad import nn as bnn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FROZEN = torch.ops.torch_bn_grad.batch_norm_forward.frozen_composite
ACT_FROZEN = torch.ops.torch_bn_grad.batch_norm_act_forward.frozen_composite
NATIVE = torch.ops.aten._native_batch_norm_legit_no_training.default


def _ours(program: torch.export.ExportedProgram) -> list:
    return [n.target for n in program.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "torch_bn_grad"]


def _targets(program: torch.export.ExportedProgram) -> list:
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


class WithResidual(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x, x * 0.5 - 1)


class WithMask(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module, residual: bool = False):
        super().__init__()
        self.norm, self.residual = norm, residual

    def forward(self, x, mask):
        if self.residual:
            return self.norm(x, x.flip(0), mask=mask)
        return self.norm(x, mask=mask)


class Functional(torch.nn.Module):
    """The frozen-statistics functional forms, with and without affine parameters."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.register_buffer("mean", torch.randn(channels))
        self.register_buffer("var", torch.rand(channels) + 0.5)
        self.weight = torch.nn.Parameter(torch.rand(channels) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(channels))

    def forward(self, x, r):
        y = functional.batch_norm(x, self.mean, self.var, eps=1e-3)
        return y + functional.batch_norm_act(x, self.mean, self.var, self.weight, self.bias, residual=r,
                                             activation="silu")


def _conv_bn_relu() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    return torch_bn_grad.convert_batchnorm(model)


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Running statistics and affine parameters that are not the defaults, eval mode."""
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                if m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-1, 1)
    return model.eval()


def _mask(n: int, length: int) -> torch.Tensor:
    return torch.arange(length) < torch.tensor([length, 2, 0][:n]).unsqueeze(1)


CASES = {
    "BatchNorm1d-rank2": (lambda: bnn.BatchNorm1d(4), lambda: (torch.randn(5, 4),), FROZEN),
    "BatchNorm1d": (lambda: bnn.BatchNorm1d(4), lambda: (torch.randn(3, 4, 6),), FROZEN),
    "BatchNorm2d": (lambda: bnn.BatchNorm2d(4), lambda: (torch.randn(2, 4, 5, 5),), FROZEN),
    "BatchNorm2d-channels_last": (lambda: bnn.BatchNorm2d(4),
                                  lambda: (torch.randn(2, 4, 5, 5).to(memory_format=torch.channels_last),), FROZEN),
    "BatchNorm3d": (lambda: bnn.BatchNorm3d(4), lambda: (torch.randn(2, 4, 3, 3, 3),), FROZEN),
    "BatchNorm2d-no-affine": (lambda: bnn.BatchNorm2d(4, affine=False), lambda: (torch.randn(2, 4, 3, 3),), FROZEN),
    "BatchNorm2d-bfloat16": (lambda: bnn.BatchNorm2d(4), lambda: (torch.randn(2, 4, 5, 5).bfloat16(),), FROZEN),
    "SyncBatchNorm": (lambda: bnn.SyncBatchNorm(4), lambda: (torch.randn(2, 4, 3, 3),), FROZEN),
    "conv-BatchNorm2d-relu": (_conv_bn_relu, lambda: (torch.randn(2, 3, 8, 8),), FROZEN),
    "BatchNormAct2d-relu": (lambda: bnn.BatchNormAct2d(4), lambda: (torch.randn(2, 4, 3, 3),), ACT_FROZEN),
    "BatchNormAct1d-leaky_relu": (lambda: bnn.BatchNormAct1d(4, activation="leaky_relu", negative_slope=0.2),
                                  lambda: (torch.randn(3, 4, 5),), ACT_FROZEN),
    "BatchNormAct3d-identity": (lambda: bnn.BatchNormAct3d(4, activation="identity"),
                                lambda: (torch.randn(2, 4, 2, 3, 3),), ACT_FROZEN),
    "BatchNormAct2d-silu-residual": (lambda: WithResidual(bnn.BatchNormAct2d(4, activation="silu")),
                                     lambda: (torch.randn(2, 4, 3, 3),), ACT_FROZEN),
    "BatchNormAct2d-memory_saving-residual": (
        lambda: WithResidual(bnn.BatchNormAct2d(4, activation="leaky_relu", memory_saving=True)),
        lambda: (torch.randn(2, 4, 3, 3),), ACT_FROZEN),
    "SyncBatchNormAct-relu-residual": (lambda: WithResidual(bnn.SyncBatchNormAct(4)),
                                       lambda: (torch.randn(2, 4, 3, 3),), ACT_FROZEN),
    "functional": (Functional, lambda: (torch.randn(2, 4, 3), torch.randn(2, 4, 3)), None),
    "masked-BatchNorm1d": (lambda: WithMask(bnn.BatchNorm1d(4)), lambda: (torch.randn(3, 4, 6), _mask(3, 6)),
                           FROZEN),
    "masked-BatchNormAct1d-residual": (lambda: WithMask(bnn.BatchNormAct1d(4, activation="silu"), residual=True),
                                       lambda: (torch.randn(3, 4, 6), _mask(3, 6)), ACT_FROZEN),
}


@pytest.mark.parametrize("name", list(CASES))
def test_eval_program_decomposes_to_core_aten(name):
    make, inputs, recorded = CASES[name]
    model = _randomized(make())
    args = inputs()
    expected = model(*args)
    program = torch.export.export(model, args)
    kept = _ours(program)
    # Plain export keeps this library's eval forward, which runs our kernels ...
    assert kept and set(kept) <= {FROZEN, ACT_FROZEN}, kept
    if recorded is not None:
        assert recorded in kept
    torch.testing.assert_close(program.module()(*args), expected, rtol=0, atol=0)
    # ... and the default decompositions make it core ATen.
    decomposed = program.run_decompositions()
    assert _ours(decomposed) == [], _ours(decomposed)
    assert NATIVE in _targets(decomposed)
    got = decomposed.module()(*args)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected)


def test_masked_padding_is_zero_in_the_decomposed_program():
    model = _randomized(WithMask(bnn.BatchNorm1d(4)))
    x, mask = torch.randn(3, 4, 6), _mask(3, 6)
    x[~mask.unsqueeze(1).expand_as(x)] = float("nan")  # padding may hold anything
    decomposed = torch.export.export(model, (x, mask)).run_decompositions()
    y = decomposed.module()(x, mask)
    assert torch.equal(y[~mask.unsqueeze(1).expand_as(y)], torch.zeros(int((~mask).sum()) * 4))
    torch.testing.assert_close(y, model(x, mask))


def test_strict_export_of_a_fused_model_decomposes_too():
    model = _randomized(torch_bn_grad.convert_batchnorm(
        torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()), fuse=True))
    x = torch.randn(2, 3, 8, 8)
    program = torch.export.export(model, (x,), strict=True)
    assert _ours(program) == [ACT_FROZEN]
    decomposed = program.run_decompositions()
    assert _ours(decomposed) == [] and NATIVE in _targets(decomposed)
    torch.testing.assert_close(decomposed.module()(x), model(x))


def test_the_overload_can_be_kept():
    """As for any CompositeImplicitAutograd operator, deleting it from the table keeps it."""
    program = torch.export.export(_randomized(_conv_bn_relu()), (torch.randn(2, 3, 8, 8),))
    table = torch.export.default_decompositions()
    assert FROZEN in table and ACT_FROZEN in table
    del table[FROZEN]
    assert _ours(program.run_decompositions(table)) == [FROZEN]


def test_training_program_keeps_the_operators():
    model = _conv_bn_relu().train()
    program = torch.export.export(model, (torch.randn(4, 3, 8, 8),)).run_decompositions()
    assert torch.ops.torch_bn_grad.batch_norm_forward.default in _ours(program)
    assert NATIVE not in _targets(program)


def _fresh(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a new Python process that never imports torch_bn_grad (it asserts so)."""
    code += "\nimport sys; assert 'torch_bn_grad' not in sys.modules; print('same')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd="/", env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("core_aten")
    model = _randomized(WithResidual(bnn.BatchNormAct2d(4, activation="leaky_relu")))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), model)
    x = torch.randn(2, 3, 8, 8)
    decomposed = torch.export.export(model, (x,)).run_decompositions()
    torch.export.save(decomposed, folder / "program.pt2")
    torch.save({"x": x, "y": model(x).detach()}, folder / "io.pt")
    return folder, decomposed


def test_decomposed_program_loads_without_the_library(saved):
    folder, _ = saved
    assert artifacts.required_operators(folder / "program.pt2") == set()
    code = ("import sys, torch\n"
            "ep = torch.export.load(sys.argv[1]); io = torch.load(sys.argv[2])\n"
            "torch.testing.assert_close(ep.module()(io['x']), io['y'])")
    result = _fresh(code, str(folder / "program.pt2"), str(folder / "io.pt"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "same"


@pytest.mark.slow  # about a minute of C++ compilation on a 2-core CPU
def test_aoti_package_of_the_decomposed_program_needs_no_library(saved):
    """Even with the lowering off (which keeps our operators in compiled models),
    a decomposed program holds none, so the package holds none."""
    folder, decomposed = saved
    previous = torch_bn_grad.config.compile_lowering
    torch_bn_grad.config.compile_lowering = False
    try:
        path = torch._inductor.aoti_compile_and_package(decomposed, package_path=str(folder / "package.pt2"))
    except Exception as exc:  # noqa: BLE001 (no working C++ toolchain for Inductor here)
        pytest.skip(f"AOTInductor cannot compile here (no working C++ toolchain): {type(exc).__name__}: {exc}")
    finally:
        torch_bn_grad.config.compile_lowering = previous
    assert artifacts.required_operators(path) == set()
    code = ("import sys, torch\n"
            "run = torch._inductor.aoti_load_package(sys.argv[1]); io = torch.load(sys.argv[2])\n"
            "torch.testing.assert_close(run(io['x']), io['y'])")
    result = _fresh(code, path, str(folder / "io.pt"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "same"
