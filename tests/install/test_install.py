"""The build's CUDA decision (``cuda_build.py``, used by setup.py) with the
machine's real tools, and the installed extension.

* ``TORCH_BN_GRAD_CUDA``: ``0`` builds for the CPU, ``1`` requires CUDA and
  fails saying why when impossible, anything else is refused; unset, CUDA is
  built only where a GPU is visible or ``TORCH_CUDA_ARCH_LIST`` asks for it.
  Checked by running ``python setup.py --name`` (which makes the decision and
  builds nothing).
* Without torch importable (pip's build isolation) setup.py stops at once with
  the command to use.
* The toolkit is found through an ``nvcc`` wrapper outside the toolkit, with
  its libraries in ``lib/`` only, and without any ``libcudart.so`` (then
  torch's wheel's CUDA runtime is linked).
* The installed extension has CUDA kernels exactly when the build could make
  them, and imports and runs on a machine without a GPU.

The toolkit tests need a CUDA build of torch and an nvcc of the same major
version; elsewhere they are skipped with the reason printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import cuda_build  # noqa: E402

OPS = ["batch_norm_forward", "batch_norm_backward", "batch_norm_local_stats", "batch_norm_grad_sums",
       "batch_norm_grad_input", "batch_norm_stats_affine"]


def _toolkit() -> tuple[str, str, str] | None:
    if torch.version.cuda is None:
        return None
    try:
        return cuda_build.find_toolkit(torch.version.cuda)
    except cuda_build.CudaUnavailable:
        return None


TOOLKIT = _toolkit()
TOOLKIT_SKIP = ("the installed torch is a CPU build" if torch.version.cuda is None
                else f"no CUDA {torch.version.cuda.split('.')[0]}.x toolkit found")
needs_toolkit = pytest.mark.skipif(TOOLKIT is None, reason=TOOLKIT_SKIP)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_HOME", "CUDA_PATH", cuda_build.ENV, cuda_build.ARCH_ENV)}
    env.update(extra)
    return env


def _setup_name(env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python setup.py --name``: runs setup.py's decisions, builds nothing."""
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _has_cuda_kernels() -> list[bool]:
    import torch_bn_grad  # noqa: F401

    return [torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_bn_grad::{op}", "CUDA") for op in OPS]


# ------------------------------------------------------------------ the switch
def test_cuda_0_builds_for_the_cpu_only():
    result = _setup_name(_clean_env(TORCH_BN_GRAD_CUDA="0"))
    assert result.returncode == 0, result.stderr
    assert "TORCH_BN_GRAD_CUDA=0: building the CPU operators only" in result.stderr
    assert result.stdout.strip().endswith("torch_bn_grad")


def test_unknown_value_is_refused():
    result = _setup_name(_clean_env(TORCH_BN_GRAD_CUDA="maybe"))
    assert result.returncode != 0
    assert "TORCH_BN_GRAD_CUDA='maybe' is not understood" in result.stderr


def test_cuda_1_fails_clearly_when_impossible():
    # A CUDA_HOME without nvcc: nothing to build CUDA with, whatever torch is.
    env = _clean_env(TORCH_BN_GRAD_CUDA="1", CUDA_HOME=os.path.join(ROOT, "no-such-toolkit"))
    result = _setup_name(env)
    assert result.returncode != 0
    assert "TORCH_BN_GRAD_CUDA=1 but the CUDA kernels cannot be built" in result.stderr
    reason = "CPU build" if torch.version.cuda is None else "has no bin/nvcc"
    assert reason in result.stderr, result.stderr


def _setup_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("torch_bn_grad setup:")]


def test_auto_falls_back_to_the_cpu_with_one_message():
    result = _setup_name(_clean_env(CUDA_HOME=os.path.join(ROOT, "no-such-toolkit")))
    assert result.returncode == 0, result.stderr
    lines = _setup_lines(result)
    assert len(lines) == 1 and "CPU operators only, without CUDA kernels" in lines[0], result.stderr


@pytest.mark.skipif(torch.version.cuda is None, reason="the installed torch is a CPU build")
def test_auto_without_a_visible_gpu_builds_for_the_cpu_and_says_how_to_get_cuda():
    result = _setup_name(_clean_env(CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stderr
    lines = _setup_lines(result)
    assert len(lines) == 1 and "no GPU is visible" in lines[0], result.stderr
    assert "TORCH_BN_GRAD_CUDA=1" in lines[0] and "TORCH_CUDA_ARCH_LIST" in lines[0]
    assert not result.stderr.replace(lines[0], "").strip(), result.stderr  # nothing else: no warnings


def test_without_torch_stops_at_once_with_the_command_to_use():
    # As under pip's build isolation: torch is not importable.
    code = "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; exec(open('setup.py').read())"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    assert "pip install --no-build-isolation -e ." in result.stderr, result.stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="the installed torch is a CUDA build")
def test_cpu_torch_needs_no_toolkit():
    result = _setup_name(_clean_env())
    assert result.returncode == 0 and "torch is a CPU build" in result.stderr, result.stderr


# ------------------------------------------------------------------ finding the toolkit
def _wrapper_dir(tmp_path, real_nvcc: str) -> str:
    """A folder outside the toolkit holding an ``nvcc`` shell wrapper (as /usr/local/bin/nvcc may be)."""
    bin_dir = tmp_path / "wrapper-bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec "{real_nvcc}" "$@"\n')
    wrapper.chmod(0o755)
    return str(bin_dir)


@needs_toolkit
def test_arch_list_asks_for_cuda_without_a_gpu():
    result = _setup_name(_clean_env(CUDA_VISIBLE_DEVICES="", TORCH_CUDA_ARCH_LIST="8.0"))
    assert result.returncode == 0, result.stderr
    lines = _setup_lines(result)
    assert len(lines) == 1 and "building the CUDA kernels" in lines[0], result.stderr


@needs_toolkit
def test_cuda_1_builds_for_the_visible_gpu_else_the_default_architectures():
    plan = _plan_with(TORCH_BN_GRAD_CUDA="1")
    assert plan.enabled and plan.arch_list == (None if torch.cuda.is_available() else cuda_build.DEFAULT_ARCHS)


@needs_toolkit
def test_toolkit_found_through_a_wrapper_outside_it(tmp_path):
    root, nvcc, _ = TOOLKIT
    path = _wrapper_dir(tmp_path, nvcc) + os.pathsep + os.environ.get("PATH", "")
    result = _setup_name(_clean_env(TORCH_BN_GRAD_CUDA="1", PATH=path))
    assert result.returncode == 0, result.stderr
    assert f"toolkit at {os.path.realpath(root)}" in result.stderr, result.stderr


def _fake_toolkit(tmp_path, with_lib: bool) -> str:
    """A toolkit tree with bin/nvcc (a wrapper of the real one), include/, and
    libcudart.so in lib/ only (or nowhere)."""
    root, nvcc, _ = TOOLKIT
    home = tmp_path / "toolkit"
    (home / "bin").mkdir(parents=True)
    shutil.copy(os.path.join(_wrapper_dir(tmp_path, nvcc), "nvcc"), home / "bin" / "nvcc")
    (home / "include").symlink_to(os.path.join(root, "include"))
    if with_lib:
        (home / "lib").mkdir()
        real = next(os.path.join(root, d, "libcudart.so") for d in ("lib64", "lib", "targets/x86_64-linux/lib")
                    if os.path.exists(os.path.join(root, d, "libcudart.so")))
        (home / "lib" / "libcudart.so").symlink_to(real)
    return str(home)


@needs_toolkit
def test_libraries_in_lib_not_lib64(tmp_path):
    home = _fake_toolkit(tmp_path, with_lib=True)
    plan = _plan_with(CUDA_HOME=home, TORCH_BN_GRAD_CUDA="1")
    assert plan.enabled and plan.library_dirs == [os.path.join(home, "lib")] and not plan.drop_cudart


@needs_toolkit
def test_no_libcudart_in_the_toolkit_links_the_wheel_runtime(tmp_path):
    wheel = cuda_build.wheel_cudart(torch.version.cuda)
    if wheel is None:
        pytest.skip("torch's CUDA runtime wheel (nvidia/.../libcudart.so.N) is not installed here")
    plan = _plan_with(CUDA_HOME=_fake_toolkit(tmp_path, with_lib=False), TORCH_BN_GRAD_CUDA="1")
    assert plan.enabled and plan.drop_cudart
    assert plan.library_dirs == [os.path.dirname(wheel)] and plan.link_args == [f"-l:{os.path.basename(wheel)}"]


def _plan_with(**env: str) -> cuda_build.CudaPlan:
    saved = {k: os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH", cuda_build.ENV, cuda_build.ARCH_ENV)}
    try:
        os.environ.pop("CUDA_PATH", None)
        os.environ.pop(cuda_build.ARCH_ENV, None)
        os.environ.update(env)
        return cuda_build.plan(torch.version.cuda)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------ the installed extension
def test_installed_extension_has_cuda_kernels_when_buildable():
    kernels = _has_cuda_kernels()
    if torch.version.cuda is None:
        assert not any(kernels)
    elif os.environ.get(cuda_build.ENV) == "0" or TOOLKIT is None or not torch.cuda.is_available():
        print(f"CUDA kernels built: {kernels} ({cuda_build.ENV}=0, no toolkit or no GPU: not required)")
    else:
        assert all(kernels), (
            f"torch {torch.__version__} and the CUDA toolkit {TOOLKIT[0]} are here, yet the installed "
            f"extension has no CUDA kernels for {[op for op, k in zip(OPS, kernels) if not k]}")


def test_import_and_cpu_ops_without_a_visible_gpu():
    code = ("import torch, torch_bn_grad; x = torch.randn(4, 3, 5, requires_grad=True); "
            "y = torch_bn_grad.nn.BatchNorm1d(3)(x); y.sum().backward(); "
            "print('ok', torch.cuda.is_available(), x.grad.shape)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok False torch.Size([4, 3, 5])")
