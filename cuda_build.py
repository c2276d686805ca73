"""Whether and how setup.py builds the CUDA kernels (imported by setup.py only).

``TORCH_BN_GRAD_CUDA`` picks the mode: ``0`` builds for the CPU only, ``1``
requires the CUDA kernels (the build fails, saying why, when they cannot be
built), unset (or ``auto``) builds them where a GPU is visible or
``TORCH_CUDA_ARCH_LIST`` names architectures, and otherwise builds for the CPU
with one message that says why and how to get the CUDA kernels.

The architectures: ``TORCH_CUDA_ARCH_LIST`` when set, else those of the
visible GPUs (torch.utils.cpp_extension's own default), else (``1`` without a
GPU) ``DEFAULT_ARCHS``.

torch's own guess of the toolkit (``CUDA_HOME``, else the folder above the
``nvcc`` found in ``PATH``) breaks when ``nvcc`` in ``PATH`` is a wrapper or a
link outside the toolkit (``/usr/local/bin/nvcc``): it then looks for
``libcudart`` in ``/usr/local/lib64``. So the toolkit is found here instead,
asking ``nvcc`` itself where it lives (``nvcc --dryrun`` prints its ``TOP``),
and its libraries are looked for in ``lib64``, ``lib`` and
``targets/<arch>-linux/lib``. When the toolkit has no ``libcudart.so`` to link
with, the CUDA runtime that torch's wheels ship (``nvidia/.../libcudart.so.N``)
is linked instead; torch has already loaded that very library when the
extension is imported.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional

ENV = "TORCH_BN_GRAD_CUDA"
ARCH_ENV = "TORCH_CUDA_ARCH_LIST"
DEFAULT_ARCHS = "8.0;9.0"  # A100, H100/H200
_PREFIX = "torch_bn_grad setup:"


class CudaUnavailable(Exception):
    """The CUDA kernels cannot be built; the message says why."""


@dataclass
class CudaPlan:
    """What setup.py does about CUDA."""

    enabled: bool
    reason: str  # one line: why CUDA is or is not built
    home: Optional[str] = None  # the toolkit's root (CUDA_HOME)
    library_dirs: list[str] = field(default_factory=list)  # where libcudart is linked from
    link_args: list[str] = field(default_factory=list)  # extra linker arguments
    drop_cudart: bool = False  # link the wheel's versioned libcudart instead of -lcudart
    arch_list: Optional[str] = None  # TORCH_CUDA_ARCH_LIST to set; None: leave it to torch (visible GPUs)


def mode() -> str:
    """``"off"``, ``"on"`` or ``"auto"`` from ``TORCH_BN_GRAD_CUDA``."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    raise SystemExit(f"{_PREFIX} {ENV}={os.environ[ENV]!r} is not understood: use 0 (CPU only), 1 (require CUDA) "
                     "or leave it unset (CUDA when possible)")


def gpu_visible() -> bool:
    """Whether torch sees a CUDA GPU here."""
    import torch

    return torch.cuda.is_available()


def plan(torch_cuda_version: Optional[str]) -> CudaPlan:
    """Decide, from the mode and the machine, whether to build the CUDA kernels.

    Prints one line saying what was decided and why. In mode ``on``, a reason
    not to build CUDA ends the build (SystemExit) with that reason.
    """
    chosen = mode()
    asked_archs = os.environ.get(ARCH_ENV, "").strip()
    if chosen == "off":
        result = CudaPlan(False, f"{ENV}=0: building the CPU operators only")
    elif chosen == "auto" and torch_cuda_version and not asked_archs and not gpu_visible():
        result = CudaPlan(False, f"building the CPU operators only, without CUDA kernels: no GPU is visible "
                                 f"(set {ENV}=1 or {ARCH_ENV}, e.g. \"{DEFAULT_ARCHS}\", to build them for "
                                 f"a GPU elsewhere; {ENV}=0 silences this)")
    else:
        try:
            result = _cuda_plan(torch_cuda_version)
        except CudaUnavailable as exc:
            if chosen == "on":
                raise SystemExit(f"{_PREFIX} {ENV}=1 but the CUDA kernels cannot be built: {exc}") from None
            result = CudaPlan(False, f"building the CPU operators only, without CUDA kernels: {exc} "
                                     f"(set {ENV}=0 to silence this, {ENV}=1 to require CUDA)")
        if result.enabled and not asked_archs and not gpu_visible():
            result.arch_list = DEFAULT_ARCHS
            result.reason += f", for {ARCH_ENV}={DEFAULT_ARCHS} (no GPU visible)"
    print(f"{_PREFIX} {result.reason}", file=sys.stderr, flush=True)
    return result


def _cuda_plan(torch_cuda_version: Optional[str]) -> CudaPlan:
    if not torch_cuda_version:
        raise CudaUnavailable("the installed torch is a CPU build (torch.version.cuda is None)")
    home, nvcc, version = find_toolkit(torch_cuda_version)
    library_dirs, link_args, drop = _cudart_link(home, torch_cuda_version)
    _probe_compile(nvcc)
    where = library_dirs[0] if library_dirs else home
    return CudaPlan(True, f"building the CUDA kernels with the CUDA {version} toolkit at {home} "
                          f"(nvcc {nvcc}, CUDA runtime from {where}) for torch's CUDA {torch_cuda_version}",
                    home, library_dirs, link_args, drop)


def _major(version: str) -> str:
    return version.split(".")[0]


def _nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise CudaUnavailable(f"{nvcc} --version failed: {exc}") from None
    found = re.search(r"release (\d+\.\d+)", out)
    if not found:
        raise CudaUnavailable(f"{nvcc} --version printed no release number")
    return found.group(1)


def _nvcc_top(nvcc: str) -> Optional[str]:
    """The toolkit root that ``nvcc`` itself reports (``TOP`` of ``--dryrun``),
    which sees through wrapper scripts and links."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        found = re.match(r"#\$ TOP=(.*)$", line.strip())
        if found:
            return os.path.realpath(found.group(1).strip())
    return None


def _candidate_homes(torch_cuda_version: str) -> list[tuple[str, str]]:
    """(root, where it came from), most specific first."""
    explicit = [(os.environ[v], f"${v}") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    if explicit:
        return explicit[:1]  # a user's explicit choice is the only candidate
    found: list[tuple[str, str]] = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        top = _nvcc_top(nvcc)
        if top:
            found.append((top, f"nvcc in PATH ({nvcc})"))
        found.append((os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), f"nvcc in PATH ({nvcc})"))
    major_minor = ".".join(torch_cuda_version.split(".")[:2])
    found.append((f"/usr/local/cuda-{major_minor}", "the default location"))
    found += [(p, "the default location")
              for p in sorted(glob.glob(f"/usr/local/cuda-{_major(torch_cuda_version)}.*"), reverse=True)]
    found += [("/usr/local/cuda", "the default location"), ("/opt/cuda", "the default location")]
    return found


def find_toolkit(torch_cuda_version: str) -> tuple[str, str, str]:
    """``(root, nvcc, version)`` of a CUDA toolkit whose major version is torch's."""
    problems: list[str] = []
    seen: set[str] = set()
    for root, origin in _candidate_homes(torch_cuda_version):
        root = os.path.realpath(root)
        if root in seen:
            continue
        seen.add(root)
        nvcc = os.path.join(root, "bin", "nvcc")
        if not os.access(nvcc, os.X_OK):
            if origin.startswith("$"):
                problems.append(f"{origin}={root} has no bin/nvcc")
            continue
        if not _has_runtime_header(root):
            problems.append(f"{root} (from {origin}) has no cuda_runtime.h")
            continue
        version = _nvcc_version(nvcc)
        if _major(version) != _major(torch_cuda_version):
            problems.append(f"{root} (from {origin}) is CUDA {version}, torch was built with CUDA "
                            f"{torch_cuda_version}: the major versions differ")
            continue
        return root, nvcc, version
    if not problems:
        problems.append("no nvcc in PATH, $CUDA_HOME or /usr/local/cuda*")
    raise CudaUnavailable("no usable CUDA toolkit: " + "; ".join(problems))


def _target_dir() -> str:
    return f"{platform.machine()}-linux"


def _has_runtime_header(root: str) -> bool:
    return any(os.path.exists(os.path.join(root, d, "cuda_runtime.h"))
               for d in ("include", os.path.join("targets", _target_dir(), "include")))


def _cudart_link(root: str, torch_cuda_version: str) -> tuple[list[str], list[str], bool]:
    """Where to link the CUDA runtime from: (library dirs, extra link args, drop -lcudart)."""
    for sub in ("lib64", "lib", os.path.join("targets", _target_dir(), "lib")):
        lib = os.path.join(root, sub)
        if os.path.exists(os.path.join(lib, "libcudart.so")):
            return [lib], [], False
    wheel = wheel_cudart(torch_cuda_version)
    if wheel is not None:
        # The wheel ships libcudart.so.N only (no unversioned name for -lcudart).
        return [os.path.dirname(wheel)], [f"-l:{os.path.basename(wheel)}"], True
    raise CudaUnavailable(f"no libcudart.so in {root}'s lib64, lib or targets/{_target_dir()}/lib, "
                          "nor a CUDA runtime in torch's nvidia wheels")


def wheel_cudart(torch_cuda_version: str) -> Optional[str]:
    """The ``libcudart.so.<major>`` that torch's CUDA wheels install (``nvidia-cuda-runtime``)."""
    import site

    name = f"libcudart.so.{_major(torch_cuda_version)}"
    roots = list(dict.fromkeys(site.getsitepackages() + [site.getusersitepackages()] + sys.path))
    for root in roots:
        for pattern in ("nvidia/cu*/lib", "nvidia/cuda_runtime/lib"):
            for lib in sorted(glob.glob(os.path.join(root, pattern, name))):
                return lib
    return None


def _probe_compile(nvcc: str) -> None:
    """nvcc compiles a one-line kernel with the host compiler it finds (nvcc
    refuses host compilers newer than it supports)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.cu")
        with open(source, "w") as f:
            f.write("#include <cuda_runtime.h>\n__global__ void probe(float* x) { x[threadIdx.x] = 1.0f; }\n")
        cmd = [nvcc, "-c", source, "-o", os.path.join(tmp, "probe.o")]
        if os.environ.get("CXX"):
            cmd += ["-ccbin", os.environ["CXX"]]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CudaUnavailable(f"nvcc could not compile a test kernel: {exc}") from None
        if result.returncode != 0:
            last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise CudaUnavailable(f"nvcc could not compile a test kernel: {last[0]}")


def apply(result: CudaPlan) -> None:
    """Point torch.utils.cpp_extension at the toolkit found (before CUDAExtension is built)."""
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = result.home
    os.environ["CUDA_HOME"] = result.home or ""
