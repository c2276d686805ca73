"""Loading saved programs that call this library's operators.

A program saved with ``torch.export.save`` or packaged by AOTInductor
(``torch._inductor.aoti_compile_and_package``) names the operators
``torch_bn_grad::*``; they exist in a process only once ``torch_bn_grad`` is
imported. Without it torch says ``We failed to resolve
torch.ops.torch_bn_grad...`` (``torch.export.load``) or ``Could not find schema
for torch_bn_grad::...`` (``aoti_load_package``).

:func:`load` and :func:`load_package` import the library (importing this
module does) and then load; if the artifact needs an operator that this
installation lacks, they raise a ``RuntimeError`` that names it.
:func:`required_operators` lists what an artifact needs.
"""

from __future__ import annotations

import os
import re
import zipfile
from typing import IO, Any, Union

import torch

import torch_bn_grad  # noqa: F401  (registers the operators)
from torch_bn_grad import _compat

__all__ = ["load", "load_package", "required_operators"]

# A call's target (``torch.ops.torch_bn_grad.<name>`` in a program, ``torch_bn_grad::<name>`` in a
# package), not the provenance metadata of a decomposed program, which names the operator it came from.
_NAME = re.compile(rb"(?:torch\.ops\.torch_bn_grad\.|torch_bn_grad::)(batch_norm_[a-z_]+)")

PathOrFile = Union[str, os.PathLike, IO[bytes]]


def required_operators(f: PathOrFile) -> set[str]:
    """The ``torch_bn_grad::`` operators that a saved program or AOTInductor package calls."""
    names: set[str] = set()
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            if info.filename.endswith((".json", ".cpp")):
                names.update(m.decode() for m in _NAME.findall(archive.read(info)))
    if not isinstance(f, (str, os.PathLike)):
        f.seek(0)
    return {f"torch_bn_grad::{n}" for n in names}


def _check_available(f: PathOrFile) -> None:
    missing = sorted(op for op in required_operators(f) if not _registered(op))
    if missing:
        raise RuntimeError(
            f"{getattr(f, 'name', f)} calls {', '.join(missing)}, which this torch_bn_grad "
            f"({torch_bn_grad.__version__}, at {os.path.dirname(torch_bn_grad.__file__)}) does not have: "
            "install the torch_bn_grad version that saved it")


def _registered(op: str) -> bool:
    namespace, name = op.split("::")
    return hasattr(getattr(torch.ops, namespace), name)


def load(f: PathOrFile, **kwargs: Any) -> torch.export.ExportedProgram:
    """``torch.export.load(f, **kwargs)`` with this library's operators registered."""
    _check_available(f)
    return torch.export.load(f, **kwargs)


def load_package(path: Union[str, os.PathLike], *args: Any, **kwargs: Any) -> Any:
    """``torch._inductor.aoti_load_package(path, ...)`` with this library's operators registered."""
    _check_available(path)
    return _compat.aoti_load_package()(os.fspath(path), *args, **kwargs)
