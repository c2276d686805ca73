"""Which copies of the per-ISA CPU kernels setup.py compiles, and with what
flags (imported by setup.py and tests/install/test_cpu_isa_build.py; not installed).

The kernels in ``csrc/cpu/kernels/*.cpp`` are compiled once per instruction
set, each copy in its own namespace (``CPU_CAPABILITY``, as ATen's own), and
``csrc/cpu/kernel_table.cpp`` picks the copy ``at::get_cpu_capability()``
names at run time. ``TORCH_BN_GRAD_CPU_ISA`` chooses the copies: ``all``, or
names (``AVX2,AVX512``); the portable DEFAULT copy is always built. Unset:
DEFAULT and the set the building CPU runs, as the CUDA kernels are built for
the visible GPU: each copy is a sixth of the build's compile time, and a
middle copy (AVX2 on an AVX512 CPU) runs there only under
``ATEN_CPU_CAPABILITY=avx2``, which then takes DEFAULT.
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
    """The instruction sets to compile the kernels for, DEFAULT first, given
    `running`, the capability this CPU runs (torch.backends.cpu.get_cpu_capability(),
    which honours ATEN_CPU_CAPABILITY)."""
    known = list(ISA_FLAGS)
    value = os.environ.get(ENV, "").strip().upper()
    if value == "ALL":
        return known
    if value:
        asked = [name.strip() for name in value.replace(";", ",").split(",") if name.strip()]
        unknown = [name for name in asked if name not in known]
        if unknown:
            raise SystemExit(f"{_PREFIX} {ENV}={os.environ[ENV]!r} names {', '.join(unknown)}; "
                             f"expected 'all' or names among {', '.join(known)}")
        return [name for name in known if name == "DEFAULT" or name in asked]
    running = running.upper()
    return ["DEFAULT"] + ([running] if running in known and running != "DEFAULT" else [])


def flags(isa: str, compiled: list[str]) -> list[str]:
    """Compiler flags of `isa`'s copy, its CPU_CAPABILITY defines included,
    when the copies `compiled` are built."""
    own = list(ISA_FLAGS[isa]) + [f"-DCPU_CAPABILITY={isa}"]
    if isa != "DEFAULT":
        return own + [f"-DCPU_CAPABILITY_{isa}"]
    return own + ([DEFAULT_BESIDE_OTHERS_OPT] if len(compiled) > 1 else [])


def generic_defines(compiled: list[str]) -> list[str]:
    """Defines that tell the generic sources which copies exist (cpu/kernel_table.cpp)."""
    return [f"-DTORCH_BN_GRAD_CPU_{isa}" for isa in compiled if isa != "DEFAULT"]


def describe(compiled: list[str]) -> str:
    """The build's one line about the CPU kernels."""
    line = f"{_PREFIX} CPU kernels for {', '.join(compiled)}"
    if len(compiled) < len(ISA_FLAGS):
        line += f" (this CPU's; {ENV}=all builds every copy)"
    return line
