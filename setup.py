"""Build script for torch_bn_grad.

The extension is built against the torch it runs with: install torch first,
then ``pip install --no-build-isolation -e .`` (README). Under pip's build
isolation torch cannot be imported here, and the build stops at once saying so
(fetching another torch into the isolated environment would build against a
C++ ABI that the installed torch may not have).

The C++ operators are always built for the CPU. The hot CPU kernels in
``csrc/cpu/kernels/`` are compiled once per instruction set and the matching
copy is picked at run time from ``at::get_cpu_capability()``; which copies,
``cpu_build.py`` says (by default the one this CPU runs). Every
compile (per-ISA kernels and the rest) runs from one queue, as many at once
as there are CPUs (``MAX_JOBS``), the longest first; the other sources that
include torch's headers share a precompiled header of them. CUDA kernels are
built where a GPU is visible, for its architecture, or when asked
(``TORCH_BN_GRAD_CUDA=1`` or ``TORCH_CUDA_ARCH_LIST``), see ``cuda_build.py``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import subprocess
import sys
import warnings

try:
    import torch
except ImportError:
    raise SystemExit(
        "torch_bn_grad setup: torch is not importable here. The extension is compiled against the torch it "
        "will run with, so pip's build isolation (a separate environment with another torch) cannot build it. "
        "Install torch first (pip install -r requirements-build.txt), then: "
        "pip install --no-build-isolation -e .") from None
from setuptools import find_packages, setup
from setuptools.warnings import InformationOnly

# setuptools' note on every editable install that a folder named like the
# package may shadow it: here the checkout's torch_bn_grad/ is the package.
warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)

# torch.utils.cpp_extension warns at import, where no GPU is visible, that it
# guessed CUDA_HOME; cuda_build.py finds the toolkit itself and says in one
# line what it decided.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
from torch.utils.cpp_extension import (  # noqa: E402
    BuildExtension,
    CppExtension,
    CUDAExtension,
    get_cxx_compiler,
    include_paths,
)

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
import build_sources  # noqa: E402  (this folder's build helpers, not installed)
import cpu_build  # noqa: E402
import cuda_build  # noqa: E402

# C++20 is named, not left to torch.utils.cpp_extension: torch 2.13 defaults to it,
# but earlier releases (2.11) pass -std=c++17 unless a -std is given.
CXX_STD = "-std=c++20"
# torch's headers as system headers, as the compile check passes them: their
# warnings (unknown pragmas) are not this project's, and -Wall stays on for ours.
TORCH_HEADERS = [flag for folder in include_paths() for flag in ("-isystem", folder)]
CXX_FLAGS = [CXX_STD, "-O3", "-g0", "-fopenmp", "-fvisibility-inlines-hidden", *TORCH_HEADERS]
LINK_FLAGS = ["-fopenmp"]

CPU_ISAS = cpu_build.isas(torch.backends.cpu.get_cpu_capability())
# The compiler flags of each copy of the kernel sources this build makes.
KERNEL_COPY_FLAGS = {isa: cpu_build.flags(isa, CPU_ISAS) for isa in CPU_ISAS}

KERNEL_SOURCES = [os.path.join(ROOT, path) for path in build_sources.kernel_sources()]
# The heavy headers most of the other C++ sources include (Python.h first, as
# Python asks), precompiled once for all of them with GCC: parsing them is
# most of each source's compile (the autograd headers, two thirds of an
# Autograd kernel unit's). TORCH_BN_GRAD_PCH=0 compiles without.
PRECOMPILED = "".join(f"#include <{header}>\n" for header in (
    "Python.h", "ATen/ATen.h", "torch/library.h", "torch/csrc/autograd/function.h",
    "torch/csrc/autograd/functions/utils.h", "torch/csrc/autograd/saved_variable.h",
    "torch/csrc/autograd/variable.h"))
USE_PCH = os.environ.get("TORCH_BN_GRAD_PCH", "1") != "0"
# The other C++ sources compiled a folder at a time (one unit including the
# folder's sources): each unit pays the precompiled header's load, more than
# most sources take to compile. TORCH_BN_GRAD_UNITY=0 compiles each alone.
UNITY = os.environ.get("TORCH_BN_GRAD_UNITY", "1") != "0"


_CUDA_PLAN = None


def _with_cuda() -> bool:
    """Whether to build the CUDA kernels (cuda_build.plan decides and says why)."""
    global _CUDA_PLAN
    if _CUDA_PLAN is None:
        _CUDA_PLAN = cuda_build.plan(torch.version.cuda)
        if _CUDA_PLAN.enabled:
            cuda_build.apply(_CUDA_PLAN)
    return _CUDA_PLAN.enabled


def _jobs() -> int:
    """Compilers run at once: MAX_JOBS, else the CPUs this process may use."""
    if os.environ.get("MAX_JOBS"):
        return max(1, int(os.environ["MAX_JOBS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class BuildInOneQueue(BuildExtension):
    """BuildExtension with every compile in one queue.

    torch's BuildExtension runs one ninja per call, so the per-ISA kernel
    copies (same sources, other flags) need calls of their own. Here each
    source and flag set is one task of a single queue of `_jobs()` workers
    (one ninja each, in its own folder, so that rebuilds stay incremental),
    started longest first, so that both cores of a 2-CPU machine stay busy
    to the end; the generic C++ sources a folder at a time (UNITY). The
    objects are linked generic first, then the ISA copies default first:
    where an inline header function exists in several objects, the linker
    keeps the baseline copy.
    """

    def build_extension(self, ext) -> None:  # noqa: D102 (setuptools hook)
        self._unity_members: dict[str, list[str]] = {}  # unit -> its sources (UNITY)
        cxx = list(ext.extra_compile_args["cxx"])
        nvcc = list(ext.extra_compile_args.get("nvcc", []))
        generic = self._generic_units([os.path.abspath(s) for s in ext.sources])
        tasks = []  # (sources, output folder, cxx flags), longest first
        for isa, flags in KERNEL_COPY_FLAGS.items():
            for source in KERNEL_SOURCES:
                tasks.append(([source], os.path.join("isa", isa.lower()), cxx + flags))
        # nvcc's sources first, then the largest.
        for source in sorted(generic, key=lambda s: (not s.endswith(".cu"), -self._unit_size(s))):
            tasks.append(([source], "generic", cxx))

        with concurrent.futures.ThreadPoolExecutor(max_workers=_jobs()) as pool:
            # The precompiled header is the queue's first task; the generic
            # sources (queued after the kernels) wait for it.
            pch = pool.submit(self._precompiled_header, ext, cxx) if USE_PCH else None

            def compile_task(task):
                sources, folder, flags = task
                if folder == "generic" and pch is not None and pch.result() and self._reads_torch_headers(sources[0]):
                    flags = flags + ["-include", pch.result(), "-Winvalid-pch"]
                name = os.path.splitext(os.path.basename(sources[0]))[0]
                return self.compiler.compile(
                    sources, output_dir=os.path.join(self.build_temp, folder, name),
                    include_dirs=ext.include_dirs, extra_postargs={"cxx": flags, "nvcc": nvcc})

            futures = [pool.submit(compile_task, t) for t in tasks]
            try:
                per_task = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        isa_objects = [o for (_, folder, _), objs in zip(tasks, per_task) if folder != "generic" for o in objs]
        generic_objects = [o for (_, folder, _), objs in zip(tasks, per_task) if folder == "generic" for o in objs]
        by_source = dict(zip([t[0][0] for t in tasks if t[1] == "generic"], generic_objects))
        ordered = [by_source[s] for s in generic] + isa_objects  # generic in source order, then default ISA first

        self._link(ext, ordered)

    def _generic_units(self, sources: list[str]) -> list[str]:
        """The units to compile for the generic sources, in source order: each
        .cu alone; the .cpp of a folder as one unit (UNITY), a file in the
        build folder that includes them, rewritten only when it changes."""
        if not UNITY:
            return sources
        groups: dict[str, list[str]] = {}  # a folder's .cpp, or a .cu alone; in source order
        for source in sources:
            groups.setdefault(os.path.dirname(source) if source.endswith(".cpp") else source, []).append(source)
        units = []
        for key, members in groups.items():
            if len(members) == 1:
                units.append(members[0])
                continue
            name = os.path.relpath(key, os.path.join(ROOT, "csrc")).replace(os.sep, "_")
            unit = os.path.join(os.path.abspath(self.build_temp), "unity", f"{name}.cpp")
            text = "// Generated by setup.py: the folder's sources as one unit.\n" + "".join(
                f'#include "{member}"\n' for member in members)
            os.makedirs(os.path.dirname(unit), exist_ok=True)
            if not (os.path.exists(unit) and open(unit).read() == text):  # else ninja would rebuild it
                with open(unit, "w") as f:
                    f.write(text)
            self._unity_members[unit] = members
            units.append(unit)
        return units

    def _members(self, unit: str) -> list[str]:
        return self._unity_members.get(unit, [unit])

    def _unit_size(self, unit: str) -> int:
        return sum(os.path.getsize(m) for m in self._members(unit))

    def _reads_torch_headers(self, unit: str) -> bool:
        return any(build_sources.reads_torch_headers(os.path.relpath(m, ROOT)) for m in self._members(unit))

    def _link(self, ext, objects: list[str]) -> None:
        """Link the queue's objects into the extension, as setuptools'
        build_extension would after its own (single-ninja) compile."""
        ext_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(os.path.abspath(ext_path)), exist_ok=True)
        self.compiler.link_shared_object(
            objects + list(ext.extra_objects or []), ext_path,
            libraries=self.get_libraries(ext), library_dirs=ext.library_dirs,
            runtime_library_dirs=ext.runtime_library_dirs, extra_postargs=ext.extra_link_args or [],
            export_symbols=self.get_export_symbols(ext), debug=self.debug, build_temp=self.build_temp,
            target_lang="c++")

    def _precompiled_header(self, ext, cxx: list[str]) -> str | None:
        """torch's headers precompiled with the generic sources' flags; the
        header to pass with -include (GCC reads its .gch instead). None where
        the compiler is not GCC."""
        version = subprocess.run([get_cxx_compiler(), "--version"], capture_output=True, text=True).stdout
        if "Free Software Foundation" not in version:
            return None
        folder = os.path.join(os.path.abspath(self.build_temp), "pch")
        os.makedirs(folder, exist_ok=True)
        header = os.path.join(folder, "torch_headers.h")
        includes = [f"-I{d}" for d in list(ext.include_dirs) + list(self.compiler.include_dirs)]
        command = [get_cxx_compiler(), *self.compiler.compiler_so[1:], *includes, "-x", "c++-header", header,
                   "-o", header + ".gch", *cxx]
        # The command and torch's version in the header: any change rebuilds it.
        stamp = hashlib.sha256(" ".join(command + [torch.__version__]).encode()).hexdigest()
        text = f"// Precompiled by setup.py ({stamp}).\n{PRECOMPILED}"
        if not (os.path.exists(header + ".gch") and os.path.exists(header) and open(header).read() == text):
            with open(header, "w") as f:
                f.write(text)
            subprocess.run(command, check=True)
        return header


def _extension():
    sources = build_sources.generic_sources()  # the per-ISA kernels are KERNEL_SOURCES
    print(cpu_build.describe(CPU_ISAS))
    isa_defines = cpu_build.generic_defines(CPU_ISAS)
    kwargs = dict(
        name="torch_bn_grad._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_link_args=LINK_FLAGS,
        py_limited_api=False,
    )
    if _with_cuda():
        sources += build_sources.cuda_sources()
        if _CUDA_PLAN.arch_list:
            os.environ["TORCH_CUDA_ARCH_LIST"] = _CUDA_PLAN.arch_list
        kwargs["library_dirs"] = list(_CUDA_PLAN.library_dirs)
        kwargs["extra_link_args"] = LINK_FLAGS + _CUDA_PLAN.link_args
        ext = CUDAExtension(
            sources=sources,
            extra_compile_args={
                "cxx": CXX_FLAGS + isa_defines + ["-DTORCH_BN_GRAD_WITH_CUDA"],
                # --threads 0: each architecture's device code on its own CPU
                # (a .cu's sm_80 and sm_90 code compile in parallel).
                "nvcc": [CXX_STD, "-O3", "-DTORCH_BN_GRAD_WITH_CUDA", "--threads", "0", *TORCH_HEADERS],
            },
            **kwargs,
        )
        if _CUDA_PLAN.drop_cudart:
            ext.libraries.remove("cudart")
    else:
        ext = CppExtension(sources=sources, extra_compile_args={"cxx": CXX_FLAGS + isa_defines}, **kwargs)
    # Headers and kernel sources too: a change to any of them relinks.
    ext.depends = build_sources.dependencies()
    return ext


setup(
    name="torch_bn_grad",
    version="0.1.0",
    description="Fast, exact, fused batch-norm forward and backward operators for PyTorch",
    packages=find_packages(include=["torch_bn_grad", "torch_bn_grad.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildInOneQueue},
    python_requires=">=3.10",
    install_requires=["torch"],
    extras_require={"test": ["pytest", "hypothesis", "numpy"], "plot": ["matplotlib"]},
)
