"""The one home of the private torch APIs this package uses, behind a version check.

Each is looked up once, here; a torch release that moves or drops one fails
at import with a message naming it, instead of somewhere deep in a training
step. The versions below are those the project is tested with (README).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

TESTED_TORCH = ((2, 13), (2, 14))  # (major, minor) releases the test suite runs on
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _lookup(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"torch_bn_grad needs {module}.{name}, which torch {torch.__version__} does not have "
            f"(tested with torch {', '.join('.'.join(map(str, v)) for v in TESTED_TORCH)})"
        ) from error


# Autograd kernels that also work under torch.func (see _autograd_kernel.py).
enable_single_level_autograd_function = _lookup("torch._functorch.utils", "enable_single_level_autograd_function")
AutoDispatchBelowAutograd = _lookup("torch._C", "_AutoDispatchBelowAutograd")
after_autograd_keyset = _lookup("torch._C", "_after_autograd_keyset")
any_requires_grad = _lookup("torch._C", "_any_requires_grad")
DispatchKeySet = _lookup("torch._C", "DispatchKeySet")
OpOverload = _lookup("torch._ops", "OpOverload")
# An autograd.Function whose apply records one node and never reroutes to
# torch.func's custom_function_call (torch >= 2.14 reroutes the C++ apply too).
SingleLevelFunction = _lookup("torch.autograd.function", "_SingleLevelFunction")
_forward_ad = importlib.import_module("torch.autograd.forward_ad")
_lookup("torch.autograd.forward_ad", "_current_level")


# A tensor that torch.func wraps (vmap's BatchedTensor, grad's GradTrackingTensor).
is_functorch_wrapped_tensor = _lookup("torch._C._functorch", "is_functorch_wrapped_tensor")


def forward_ad_level() -> int:
    """The innermost active forward-mode AD level (-1: none)."""
    return _forward_ad._current_level


# Traceable collectives for SyncBatchNorm (distributed.py).
functional_collectives = (
    importlib.import_module("torch.distributed._functional_collectives") if torch.distributed.is_available() else None
)


def _onnx_export_flags():
    """The two exporters' "exporting now" flags, or None where this torch keeps them elsewhere."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:
        return None
    if not hasattr(GLOBALS, "in_onnx_export") or not hasattr(_flags, "_is_onnx_exporting"):
        return None
    return GLOBALS, _flags


_ONNX_FLAGS = _onnx_export_flags()


def in_onnx_export() -> bool:
    """``torch.onnx.is_in_onnx_export()`` without its two imports per call (a
    microsecond, on every BatchNorm forward); the public function where this
    torch keeps the flags elsewhere."""
    if _ONNX_FLAGS is None or torch.compiler.is_compiling():  # dynamo skips torch.onnx's internals
        return torch.onnx.is_in_onnx_export()
    return _ONNX_FLAGS[0].in_onnx_export or _ONNX_FLAGS[1]._is_onnx_exporting
