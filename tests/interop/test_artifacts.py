"""Saved programs (torch.export) and AOTInductor packages that call our
operators, loaded in a fresh process: torch's error without the library
names it and says to import it (export) or names the missing operator
(AOTInductor); ``torch_bn_grad.artifacts.load``/``load_package`` load them,
with the same results as the module; an operator this installation lacks is
named in the error."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
import torch

import torch_bn_grad
from torch_bn_grad import artifacts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    model(torch.randn(4, 3, 8, 8))  # running statistics that are not the defaults
    return torch_bn_grad.convert_batchnorm(model).eval()


def _fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new Python process (nothing imported but what it imports)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("artifacts")
    model = _model()
    x = torch.randn(2, 3, 8, 8)
    ep = torch.export.export(model, (x,))
    torch.export.save(ep, folder / "program.pt2")
    torch.save({"x": x, "y": model(x)}, folder / "io.pt")
    return folder, ep


def test_required_operators(saved):
    folder, _ = saved
    assert artifacts.required_operators(folder / "program.pt2") == {"torch_bn_grad::batch_norm_forward"}


def test_export_load_without_the_library_says_to_import_it(saved):
    folder, _ = saved
    result = _fresh(f"import torch; torch.export.load({str(folder / 'program.pt2')!r})")
    assert result.returncode != 0
    assert "torch.ops.torch_bn_grad.batch_norm_forward" in result.stderr
    assert "import the custom op" in result.stderr  # torch's hint, printed with the failure


def test_export_load_in_a_fresh_process(saved):
    folder, _ = saved
    code = ("import torch; from torch_bn_grad import artifacts; "
            f"ep = artifacts.load({str(folder / 'program.pt2')!r}); "
            f"io = torch.load({str(folder / 'io.pt')!r}); "
            "torch.testing.assert_close(ep.module()(io['x']), io['y']); print('same')")
    result = _fresh(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "same"


def test_missing_operator_is_named(saved, tmp_path):
    folder, _ = saved
    forged = tmp_path / "forged.pt2"
    with zipfile.ZipFile(folder / "program.pt2") as src, zipfile.ZipFile(forged, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".json"):
                data = data.replace(b"batch_norm_forward", b"batch_norm_fictional")
            dst.writestr(info, data)
    with pytest.raises(RuntimeError, match="torch_bn_grad::batch_norm_fictional, which this torch_bn_grad"):
        artifacts.load(forged)


def _aoti_package(ep, path, lowering: bool) -> str:
    previous = torch_bn_grad.config.compile_lowering
    torch_bn_grad.config.compile_lowering = lowering
    try:
        return torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    except Exception as exc:  # noqa: BLE001 (no working C++ toolchain for Inductor here)
        pytest.skip(f"AOTInductor cannot compile here (no working C++ toolchain): {type(exc).__name__}: {exc}")
    finally:
        torch_bn_grad.config.compile_lowering = previous


def test_aoti_package_in_a_fresh_process(saved):
    """With the operators kept opaque (config.compile_lowering False) the package calls them."""
    folder, ep = saved
    path = _aoti_package(ep, folder / "package.pt2", lowering=False)
    assert artifacts.required_operators(path) == {"torch_bn_grad::batch_norm_forward"}
    plain = _fresh(f"import torch; torch._inductor.aoti_load_package({path!r})")
    assert plain.returncode != 0 and "torch_bn_grad::batch_norm_forward" in plain.stderr
    code = ("import torch; from torch_bn_grad import artifacts; "
            f"run = artifacts.load_package({path!r}); io = torch.load({str(folder / 'io.pt')!r}); "
            "torch.testing.assert_close(run(io['x']), io['y']); print('same')")
    result = _fresh(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "same"


def test_lowered_aoti_package_needs_no_import(saved):
    """With the lowering (the default) inductor compiles the operators in: no torch_bn_grad needed."""
    folder, ep = saved
    path = _aoti_package(ep, folder / "lowered.pt2", lowering=True)
    assert artifacts.required_operators(path) == set()
    code = (f"import torch; run = torch._inductor.aoti_load_package({path!r}); "
            f"io = torch.load({str(folder / 'io.pt')!r}); "
            "torch.testing.assert_close(run(io['x']), io['y']); print('same')")
    result = _fresh(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "same"
