"""setup.py builds what lies under csrc/, found by build_sources.py: a new file
or folder is compiled without being listed anywhere, the per-ISA kernels once
per instruction set and nothing twice."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import build_sources  # noqa: E402  (the build's own source list)


def _touch(root, *paths: str) -> None:
    for path in paths:
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        open(os.path.join(root, path), "w").close()


def test_a_new_folder_is_built(tmp_path):
    _touch(tmp_path, "csrc/library/schemas.cpp", "csrc/new_feature/thing.cpp", "csrc/new_feature/deeper/more.cpp",
           "csrc/cpu/kernels/k.cpp", "csrc/cpu/kernels/k.h", "csrc/cuda/c.cu", "csrc/cuda/new/d.cu", "csrc/a.h")
    assert build_sources.generic_sources(str(tmp_path)) == [
        "csrc/library/schemas.cpp", "csrc/new_feature/deeper/more.cpp", "csrc/new_feature/thing.cpp"]
    assert build_sources.kernel_sources(str(tmp_path)) == ["csrc/cpu/kernels/k.cpp"]
    assert build_sources.cuda_sources(str(tmp_path)) == ["csrc/cuda/c.cu", "csrc/cuda/new/d.cu"]
    assert "csrc/a.h" in build_sources.dependencies(str(tmp_path))


def test_every_source_of_the_checkout_is_built_once():
    generic, kernels, cuda = (build_sources.generic_sources(), build_sources.kernel_sources(),
                              build_sources.cuda_sources())
    on_disk = sorted(os.path.relpath(os.path.join(folder, name), ROOT)
                     for folder, _, names in os.walk(os.path.join(ROOT, "csrc"))
                     for name in names if name.endswith((".cpp", ".cu")))
    assert sorted(generic + kernels + cuda) == on_disk
    assert not set(generic) & set(kernels)
    assert "csrc/library/schemas.cpp" in generic and kernels and cuda


def _write(root, path: str, text: str) -> None:
    os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
    with open(os.path.join(root, path), "w") as f:
        f.write(text)


def test_torch_headers_are_found_through_the_projects_headers(tmp_path):
    """A source reaching ATen or torch through its own headers (named from
    csrc/ or beside it) takes the precompiled header; one that reaches c10
    alone does not."""
    _write(tmp_path, "csrc/a/uses.h", '#pragma once\n#include "a/deeper.h"\n')
    _write(tmp_path, "csrc/a/deeper.h", "#pragma once\n#include <ATen/core/Tensor.h>\n")
    _write(tmp_path, "csrc/a/beside.h", '#pragma once\n#include "deeper.h"\n')
    _write(tmp_path, "csrc/a/light.h", "#pragma once\n#include <c10/util/Exception.h>\n#include <vector>\n")
    _write(tmp_path, "csrc/a/x.cpp", '#include "a/uses.h"\n')
    _write(tmp_path, "csrc/a/y.cpp", '#include "beside.h"\n')
    _write(tmp_path, "csrc/a/z.cpp", '#include "a/light.h"\n  #  include <torch_like/none.h>\n')
    found = {s: build_sources.reads_torch_headers(s, str(tmp_path)) for s in ("csrc/a/x.cpp", "csrc/a/y.cpp",
                                                                              "csrc/a/z.cpp")}
    assert found == {"csrc/a/x.cpp": True, "csrc/a/y.cpp": True, "csrc/a/z.cpp": False}
    assert not build_sources.reads_torch_headers("csrc/cpu/environment.cpp")
    assert build_sources.reads_torch_headers("csrc/library/schemas.cpp")
