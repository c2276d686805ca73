"""The sources setup.py compiles, found under ``csrc/`` (imported by setup.py
and the build tests; not installed), so that a new file or folder is built
without being listed anywhere.

* every ``.cpp`` under ``csrc/`` is compiled once, except the per-ISA kernels
  in ``csrc/cpu/kernels/``, which setup.py compiles once per instruction set
  (cpu_build.py says which);
* every ``.cu`` under ``csrc/`` is compiled where CUDA kernels are built;
* every file under ``csrc/`` is a dependency: a change to any of them relinks;
* a source that reaches no ATen or torch header (``reads_torch_headers``)
  is compiled without the precompiled header, which costs more to load than
  such a source takes to compile.

Paths are relative to the repository root, in sorted order, so that the link
order (and with it the binary) depends on the tree alone.
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.abspath(__file__))
KERNEL_DIR = os.path.join("csrc", "cpu", "kernels")


def _under_csrc(pattern: str, root: str) -> list[str]:
    found = glob.glob(os.path.join("csrc", "**", pattern), root_dir=root, recursive=True)
    return sorted(path for path in found if os.path.isfile(os.path.join(root, path)))


def kernel_sources(root: str = ROOT) -> list[str]:
    """The per-ISA kernel sources (compiled once per instruction set)."""
    return [path for path in _under_csrc("*.cpp", root) if os.path.dirname(path) == KERNEL_DIR]


def generic_sources(root: str = ROOT) -> list[str]:
    """The C++ sources compiled once: every ``.cpp`` under csrc/ but the kernels."""
    return [path for path in _under_csrc("*.cpp", root) if os.path.dirname(path) != KERNEL_DIR]


def cuda_sources(root: str = ROOT) -> list[str]:
    """The CUDA sources."""
    return _under_csrc("*.cu", root)


def dependencies(root: str = ROOT) -> list[str]:
    """Every file under csrc/ (headers included)."""
    return _under_csrc("*.*", root)


_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
_TORCH_HEADERS = ("ATen/", "torch/")


def reads_torch_headers(source: str, root: str = ROOT) -> bool:
    """Whether `source` (a path under root) includes, directly or through
    this project's headers (named from csrc/ or beside the including file),
    an ATen or torch header."""
    seen: set[str] = set()
    pending = [os.path.join(root, source)]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for _, name in _INCLUDE.findall(text):
            if name.startswith(_TORCH_HEADERS):
                return True
            for folder in (os.path.join(root, "csrc"), os.path.dirname(path)):
                candidate = os.path.join(folder, name)
                if os.path.isfile(candidate):
                    pending.append(os.path.normpath(candidate))
                    break
    return False
