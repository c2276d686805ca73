"""Which copies of the per-ISA CPU kernels setup.py compiles, and with what
flags (imported by setup.py and tests/install/test_cpu_isa_build.py; not installed).

The kernels in ``csrc/cpu/kernels/*.cpp`` are compiled once per instruction
set, each copy in its own namespace (``CPU_CAPABILITY``, as ATen's own), and
``csrc/cpu/kernel_table.cpp`` picks the copy ``at::get_cpu_capability()``
names at run time. ``TORCH_BN_GRAD_CPU_ISA`` chooses the copies: ``all``, or
names among DEFAULT, AVX2, AVX512 and ``native`` (the building CPU's:
``DEFAULT,native``). Unset: ``native``, the one copy the building CPU runs,
as the CUDA kernels are built for the visible GPU: each copy is a third of
the build's compile time. A copy the running CPU lacks is replaced at run
time by the nearest compiled one it can run (``csrc/cpu/kernel_table.cpp``).
``tests/install/test_cpu_isa_build.py`` compiles the copies a build leaves out.
"""

from __future__ import annotations

import os
import platform

ENV = "TORCH_BN_GRAD_CPU_ISA"
_PREFIX = "torch_bn_grad setup:"

# Flags per CPU capability, named as at::CPUCapability names them, lowest first.
if platform.machine() in ("x86_64", "AMD64"):
    ISA_FLAGS: dict[str, list[str]] = {
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

# Where another copy is built, DEFAULT runs only on CPUs without it (or under
# ATEN_CPU_CAPABILITY=default), so it is compiled at -O1: its units then
# take about half the compile time of -O3.
DEFAULT_BESIDE_OTHERS_OPT = "-O1"


def isas(running: str) -> list[str]:
    """The instruction sets to compile the kernels for, lowest first, given
    `running`, the capability this CPU runs (torch.backends.cpu.get_cpu_capability(),
    which honours ATEN_CPU_CAPABILITY)."""
    known = list(ISA_FLAGS)
    running = running.upper()
    native = running if running in known else "DEFAULT"
    value = os.environ.get(ENV, "").strip().upper()
    if value == "ALL":
        return known
    if not value:
        return [native]
    asked = {native if name == "NATIVE" else name
             for name in (part.strip() for part in value.replace(";", ",").split(",")) if name}
    unknown = sorted(name for name in asked if name not in known)
    if unknown or not asked:
        raise SystemExit(f"{_PREFIX} {ENV}={os.environ[ENV]!r} names {', '.join(unknown) or 'nothing'}; "
                         f"expected 'all' or names among {', '.join(known)} and native")
    return [name for name in known if name in asked]


def flags(isa: str, compiled: list[str]) -> list[str]:
    """Compiler flags of `isa`'s copy, its CPU_CAPABILITY defines included,
    when the copies `compiled` are built."""
    own = list(ISA_FLAGS[isa]) + [f"-DCPU_CAPABILITY={isa}"]
    if isa != "DEFAULT":
        return own + [f"-DCPU_CAPABILITY_{isa}"]
    return own + ([DEFAULT_BESIDE_OTHERS_OPT] if len(compiled) > 1 else [])


def generic_defines(compiled: list[str]) -> list[str]:
    """Defines that tell the generic sources which copies exist (cpu/kernel_table.cpp)."""
    return [f"-DTORCH_BN_GRAD_CPU_{isa}" for isa in compiled]


def describe(compiled: list[str]) -> str:
    """The build's one line about the CPU kernels."""
    line = f"{_PREFIX} CPU kernels for {', '.join(compiled)}"
    if len(compiled) < len(ISA_FLAGS):
        line += f" ({ENV}=all builds every copy)"
    return line
