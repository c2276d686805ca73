"""Every repository path that a comment, a docstring or a document names exists;
and code comments hold no timings and no machine names (figures belong in
docs/performance.md, with the machine they were measured on).

Read: the comments and docstrings of the Python sources, the comments of the
C++/CUDA sources and shell scripts, and the whole of every Markdown file, all
as git tracks them. A path is a token with a slash whose first folder is one of
the repository's top-level folders (``csrc/...``, ``tests/...``, ...) or that
ends in a source or document suffix (``cpu/kernels/partition.h``), including
``../`` links, globs (``tests/masked/test_*.py``) and the pair form
(``cpu/environment.h/.cpp``); or a bare file name with such a suffix
(``schemas.cpp``). A path resolves against the repository root, the naming file's
folder, ``csrc/`` (the folder C++ includes start from) or ``torch_bn_grad/``
(the package's modules name each other from there: ``_forward/plain.py``); a
bare name resolves when some tracked file has it.
What lies outside the repository is listed in ``OUTSIDE`` with the reason.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import posixpath
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("csrc", "tests", "torch_bn_grad", "benchmarks", "docs", "examples", "scripts")
SUFFIXES = ("cpp", "h", "cuh", "cu", "py", "md", "sh")
# Paths and names that comments rightly give but that are no file of this repository.
OUTSIDE = {
    "Python.h": "CPython's C API header",
    "avx512fintrin.h": "GCC's AVX-512 intrinsics header",
    "torch_bn_grad/_C*.so": "the compiled extension: a build output, not tracked",
}
# Folders of PyTorch's own source tree: a path under one names a file of torch's.
TORCH_FOLDERS = ("ATen", "aten", "c10", "torch")

_SUFFIX = "|".join(SUFFIXES)
_TOKEN = re.compile(
    r"(?<![\w./:$<*{-])"  # not inside a URL, an absolute path, $VAR/..., <...> or {...}
    rf"((?:\.\./|\./)*(?:[\w.*-]+/)+[\w.*-]*(?:/\.[a-z]+)*"  # a path, maybe with /.cpp pairs
    rf"|[\w-]+\.(?:{_SUFFIX})(?:/\.[a-z]+)*)"  # a bare file name
    r"(?![\w/]|\.\w)")  # not the head of a longer name (config.cpp.enable_kernel_profile)
_HAS_SUFFIX = re.compile(rf"\.(?:{_SUFFIX})$")
_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [name for name in out.split("\0") if name and (ROOT / name).is_file()]


FILES = _tracked()
FOLDERS = {str(parent) for name in FILES for parent in Path(name).parents if str(parent) != "."}
NAMES = {Path(name).name for name in FILES}


def _python_text(source: str) -> list[tuple[int, str]]:
    """The comments and docstrings of a Python source, each with its first line number."""
    pieces = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
                    body[0].value.value, str):
                pieces.append((body[0].lineno, body[0].value.value))
    return pieces


def commented_text(name: str, source: str) -> list[tuple[int, str]]:
    """What of `name` is prose: comments and docstrings, or the whole document."""
    if name.endswith(".py"):
        return _python_text(source)
    if name.endswith(".md"):
        return [(1, source)]
    if name.endswith(".sh") or name == ".ci/run":
        return [(i, line[line.index("#"):]) for i, line in enumerate(source.splitlines(), 1) if "#" in line]
    return [(source.count("\n", 0, m.start()) + 1, m.group()) for m in _C_COMMENT.finditer(source)]


def _exists(path: str) -> bool:
    path = posixpath.normpath(path)
    if path.startswith(".."):
        return False
    if any(c in path for c in "*?["):
        return any(fnmatch.fnmatch(f, path) for f in FILES) or any(fnmatch.fnmatch(d, path) for d in FOLDERS)
    return path in FOLDERS or path in FILES


def _spellings(token: str) -> list[str]:
    """``cpu/environment.h/.cpp`` as ``cpu/environment.h`` and ``.cpp``; any other token as itself."""
    pair = re.fullmatch(r"(.*?)((?:/\.[a-z]+)+)", token)
    if not pair:
        return [token]
    stem = pair.group(1).rsplit(".", 1)[0]
    return [pair.group(1)] + [stem + suffix for suffix in pair.group(2).split("/") if suffix]


def _is_path(token: str) -> bool:
    first = token.lstrip("./").split("/")[0]
    if "/" not in token.rstrip("/"):
        return bool(_HAS_SUFFIX.search(token)) or (token.endswith("/") and first in TOP_FOLDERS)
    if first in TORCH_FOLDERS:
        return False
    return first in TOP_FOLDERS or token.startswith("..") or bool(_HAS_SUFFIX.search(_spellings(token)[0]))


def _resolves(path: str, folder: str) -> bool:
    if path in OUTSIDE:
        return True
    if "/" not in path.rstrip("/"):
        return path in NAMES or _exists(posixpath.join(folder, path)) or _exists(path)
    return any(_exists(posixpath.join(base, path)) for base in ("", folder, "csrc", "torch_bn_grad"))


def missing_paths() -> list[str]:
    """``file:line: path`` for every named path that does not resolve."""
    missing = []
    for name in FILES:
        if not (name.endswith(tuple(f".{s}" for s in SUFFIXES)) or name == ".ci/run"):
            continue
        folder = posixpath.dirname(name)
        for first_line, text in commented_text(name, (ROOT / name).read_text(encoding="utf-8")):
            for offset, line in enumerate(text.splitlines()):
                if line.lstrip().startswith("#include <"):
                    continue
                for match in _TOKEN.finditer(line):
                    token = match.group(1).rstrip(".,:;")
                    if not _is_path(token):
                        continue
                    missing += [f"{name}:{first_line + offset}: {path}" for path in _spellings(token)
                                if not _resolves(path, folder)]
    return missing


def test_every_named_path_exists():
    missing = missing_paths()
    assert not missing, "paths named in comments or docs that do not exist:\n" + "\n".join(missing)


def test_the_scan_finds_a_stale_path_and_takes_real_ones(tmp_path):
    # The scanner itself: a stale path in a comment is reported, real ones are not.
    names = [(1, "# see csrc/library/schemas.cpp and cpu/kernels/partition.h, ../docs/api.md, tests/*/test_*.py")]
    assert all(_resolves(p, "tests") for _, text in names for t in _TOKEN.findall(text)
               for p in _spellings(t.rstrip(".,:;")) if _is_path(t))
    for stale in ("csrc/no_such_file.h", "cuda/no_such_kernels.cuh", "no_such_module.py", "docs/no_such.md"):
        assert _is_path(stale) and not _resolves(stale, "tests"), stale
    assert not _is_path("torch/_decomp/decompositions.py")  # torch's own file
    assert _TOKEN.findall("config.cpp.enable_kernel_profile and https://example.org/docs/x.md") == []
    assert _spellings("cpu/environment.h/.cpp") == ["cpu/environment.h", "cpu/environment.cpp"]
    assert [p for _, text in _python_text('"""Doc: a.py."""\nx = "b.py"  # c.py\n') for p in _TOKEN.findall(text)] \
        == ["c.py", "a.py"]


# A time in microseconds or nanoseconds, or a machine of the project's, in a code comment.
_TIMING_OR_MACHINE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:us|µs|ns)\b|\b(?:this|that|the \w+) machine\b|\bused to be\b")
CODE_FOLDERS = ("csrc", "torch_bn_grad", "tests", "benchmarks", "scripts")


def test_no_timings_or_machine_names_in_code_comments():
    found = []
    for name in FILES:
        if name.split("/")[0] not in CODE_FOLDERS or name.endswith(".md") or not name.endswith(
                tuple(f".{s}" for s in SUFFIXES)):
            continue
        for first_line, text in commented_text(name, (ROOT / name).read_text(encoding="utf-8")):
            for offset, line in enumerate(text.splitlines()):
                if _TIMING_OR_MACHINE.search(line):
                    found.append(f"{name}:{first_line + offset}: {line.strip()}")
    assert not found, "timings or machine names in code comments:\n" + "\n".join(found)
    assert _TIMING_OR_MACHINE.search("// paid about 5.6 us a call") and _TIMING_OR_MACHINE.search(
        "# (2.11 on the H200 machine)")
