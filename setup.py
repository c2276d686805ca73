"""Build script for torch_bn_grad.

The C++ operators are always built for the CPU. The hot CPU kernels in
``csrc/cpu/kernels/`` are compiled once per instruction set (default, AVX2,
AVX512) and the matching copy is picked at run time from
``at::get_cpu_capability()``. CUDA sources are added when the installed
torch was built with CUDA and a matching CUDA toolkit is found
(``cuda_build.py``); ``TORCH_BN_GRAD_CUDA=0`` builds for the CPU only,
``TORCH_BN_GRAD_CUDA=1`` requires CUDA, unset builds CUDA when possible.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import platform
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import (
    BuildExtension,
    CppExtension,
    CUDAExtension,
    include_paths,
)

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
import cuda_build  # noqa: E402  (this folder's build helper, not installed)

# C++20 is named, not left to torch.utils.cpp_extension: torch 2.13 defaults to it,
# but earlier releases (2.11 on the H200 machine) pass -std=c++17 unless a -std is given.
CXX_STD = "-std=c++20"
# torch's headers as system headers, as the compile check passes them: their
# warnings (unknown pragmas) are not this project's, and -Wall stays on for ours.
TORCH_HEADERS = [flag for folder in include_paths() for flag in ("-isystem", folder)]
CXX_FLAGS = [CXX_STD, "-O3", "-g0", "-fopenmp", "-fvisibility-inlines-hidden", *TORCH_HEADERS]
LINK_FLAGS = ["-fopenmp"]

# Flags per CPU capability, named as at::CPUCapability names them. Each copy of
# the kernels lives in its own namespace (CPU_CAPABILITY), like ATen's own.
ISA_FLAGS: dict[str, list[str]] = {}
if platform.machine() in ("x86_64", "AMD64"):
    ISA_FLAGS = {
        # -Wno-psabi: GCC notes that passing the portable 32-byte
        # Vectorized<double> by value changed ABI in GCC 4.6; these calls are
        # inlined within one file, so no ABI is crossed.
        "DEFAULT": ["-Wno-psabi"],
        "AVX2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt"],
        # -Wno-uninitialized: GCC 12's own avx512fintrin.h initializes its
        # "undefined" vectors from themselves (__Y = __Y, GCC bug 105593), which
        # printed 9,000 warnings a build. The same sources compile with the
        # warning on for the other two ISAs.
        "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                   "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-Wno-uninitialized"],
    }
else:
    ISA_FLAGS = {"DEFAULT": []}

ISA_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "kernels", "*.cpp")))


_CUDA_PLAN = None


def _with_cuda() -> bool:
    """Whether to build the CUDA kernels (TORCH_BN_GRAD_CUDA: 0 = no, 1 = required, unset = if possible)."""
    global _CUDA_PLAN
    if _CUDA_PLAN is None:
        _CUDA_PLAN = cuda_build.plan(torch.version.cuda)
        if _CUDA_PLAN.enabled:
            cuda_build.apply(_CUDA_PLAN)
    return _CUDA_PLAN.enabled


class BuildWithIsaKernels(BuildExtension):
    """BuildExtension that also compiles the CPU kernels once per ISA.

    The per-ISA objects are linked after the generic ones (default ISA first),
    so that where an inline header function exists in several objects the
    linker keeps the baseline copy.
    """

    def build_extension(self, ext) -> None:  # noqa: D102 (setuptools hook)
        cxx = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) \
            else list(ext.extra_compile_args)

        def compile_isa(isa: str) -> list[str]:
            defines = [f"-DCPU_CAPABILITY={isa}"]
            if isa != "DEFAULT":
                defines.append(f"-DCPU_CAPABILITY_{isa}")
            return self.compiler.compile(
                ISA_SOURCES,
                output_dir=os.path.join(self.build_temp, "isa", isa.lower()),
                include_dirs=ext.include_dirs,
                extra_postargs={"cxx": cxx + ISA_FLAGS[isa] + defines, "nvcc": []},
            )

        # The ISAs' compiles run side by side (one ninja each, in its own
        # folder): one after the other, each waited for its slowest source
        # with the other cores idle (CPU build on 2 cores: 882 s -> 541 s).
        # MAX_JOBS, a cap on compilers at once, keeps them one after the other.
        workers = 1 if os.environ.get("MAX_JOBS") else len(ISA_FLAGS)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            per_isa = list(pool.map(compile_isa, ISA_FLAGS))
        ext.extra_objects = list(ext.extra_objects or []) + [o for objects in per_isa for o in objects]
        super().build_extension(ext)


def _extension():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    kwargs = dict(
        name="torch_bn_grad._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_link_args=LINK_FLAGS,
        py_limited_api=False,
    )
    if _with_cuda():
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not arch:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        kwargs["library_dirs"] = list(_CUDA_PLAN.library_dirs)
        kwargs["extra_link_args"] = LINK_FLAGS + _CUDA_PLAN.link_args
        ext = CUDAExtension(
            sources=sources,
            extra_compile_args={
                "cxx": CXX_FLAGS + ["-DTORCH_BN_GRAD_WITH_CUDA"],
                # --threads 0: each architecture's device code on its own CPU
                # (one .cu for sm_80 and sm_90: 115 s instead of 185 s on 2 cores).
                "nvcc": [CXX_STD, "-O3", "-DTORCH_BN_GRAD_WITH_CUDA", "--threads", "0", *TORCH_HEADERS],
            },
            **kwargs,
        )
        if _CUDA_PLAN.drop_cudart:
            ext.libraries.remove("cudart")
        return ext
    return CppExtension(sources=sources, extra_compile_args={"cxx": CXX_FLAGS}, **kwargs)


setup(
    name="torch_bn_grad",
    version="0.1.0",
    description="Fast, exact, fused batch-norm forward and backward operators for PyTorch",
    packages=find_packages(include=["torch_bn_grad", "torch_bn_grad.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildWithIsaKernels},
    python_requires=">=3.9",
    install_requires=["torch"],
    extras_require={"test": ["pytest", "hypothesis", "numpy"], "plot": ["matplotlib"]},
)
