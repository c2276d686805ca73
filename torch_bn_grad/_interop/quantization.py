"""torch.fx and torch.ao.quantization see this library's BatchNorms as torch's.

torch's tools recognize a BatchNorm by its exact type (``type(m)``), and FX's
tracers keep a module as one ``call_module`` node (a leaf) only when its class
lives in ``torch.nn``/``torch.ao.nn``. :func:`register` (run on import) makes
each tool treat ``torch_bn_grad.nn.BatchNorm1d/2d/3d`` exactly as it treats
the torch class of the same name:

* FX (``torch.fx.Tracer`` and quantization's ``QuantizationTracer``): the
  modules are leaves, so ``torch.fx.symbolic_trace`` gives one ``call_module``
  node per BatchNorm, which runs this library's forward.
* Fusion (``fuse_modules``, ``fuse_modules_qat`` and FX's ``prepare_fx``,
  ``prepare_qat_fx``, ``fuse_fx``, through every ``BackendConfig``): each
  fusion pattern naming a torch BatchNorm gets a twin naming ours, whose fuser
  method is handed a torch BatchNorm sharing the Parameter and buffer tensors
  (torch's fused modules, such as ``ConvBn2d``, accept torch's classes only).
  The fused modules are therefore exactly torch's.
* Standalone quantized BatchNorms (eager ``convert`` and FX lowering) map
  ours to ``torch.ao.nn.quantized.BatchNorm2d/3d`` as torch's are.

These tables are private to torch; ``_compat.quantization_internals`` reaches
them in one place (with the other private APIs) and raises a clear error naming the torch version when they change. On
import, such an error becomes a warning (everything else in the library
works); ``tests/interop/test_interop_quantization.py`` calls :func:`register` directly.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Callable

import torch
from torch import nn

from torch_bn_grad import _compat
from torch_bn_grad import nn as _ours

__all__ = ["register", "as_torch_batchnorm"]

# Ours -> torch's, exact types.
TORCH_CLASS: dict[type, type] = {
    _ours.BatchNorm1d: nn.BatchNorm1d,
    _ours.BatchNorm2d: nn.BatchNorm2d,
    _ours.BatchNorm3d: nn.BatchNorm3d,
}
OURS_FOR_TORCH: dict[type, type] = {torch_cls: ours for ours, torch_cls in TORCH_CLASS.items()}

_MARK = "_torch_bn_grad_wrapped"


def as_torch_batchnorm(module: Any) -> Any:
    """A torch BatchNorm in place of one of ours (sharing its Parameters and
    buffers, keeping ``training``), anything else as it is."""
    torch_cls = TORCH_CLASS.get(type(module))
    if torch_cls is None:
        return module
    twin = torch_cls(
        module.num_features,
        eps=module.eps,
        momentum=module.momentum,
        affine=module.affine,
        track_running_stats=module.track_running_stats,
        device="meta",
    )
    for name, param in module._parameters.items():
        twin._parameters[name] = param
    for name, buf in module._buffers.items():
        twin._buffers[name] = buf
    twin.train(module.training)
    return twin


def _with_torch_batchnorms(fuser_method: Callable) -> Callable:
    """``fuser_method(is_qat, *modules)`` that is handed torch BatchNorms in place of ours."""

    @functools.wraps(fuser_method)
    def fuser(is_qat: bool, *modules: Any) -> Any:
        return fuser_method(is_qat, *(as_torch_batchnorm(m) for m in modules))

    return fuser


def _mirror(pattern: Any) -> Any:
    """``pattern`` with torch's BatchNorm classes replaced by ours (nested tuples walked)."""
    if isinstance(pattern, tuple):
        return tuple(_mirror(p) for p in pattern)
    if isinstance(pattern, type):
        return OURS_FOR_TORCH.get(pattern, pattern)
    return pattern


def _names_torch_batchnorm(pattern: Any) -> bool:
    return _mirror(pattern) != pattern


# ------------------------------------------------------------------ FX leaves
def _leaf_rule(is_leaf_module: Callable) -> Callable:
    """A tracer's ``is_leaf_module`` that also keeps this library's BatchNorms whole."""
    if getattr(is_leaf_module, _MARK, False):
        return is_leaf_module

    @functools.wraps(is_leaf_module)
    def wrapped(self: Any, m: nn.Module, module_qualified_name: str) -> bool:
        # The rule torch's tracers apply to torch.nn classes: exact types only,
        # as a user's subclass of a torch BatchNorm is not a leaf either.
        if type(m) in TORCH_CLASS or type(m) is _ours.SyncBatchNorm or isinstance(m, _ours.BatchNormActBase):
            return True
        return is_leaf_module(self, m, module_qualified_name)

    setattr(wrapped, _MARK, True)
    return wrapped


# ------------------------------------------------------------------ backend configs
def _set_backend_pattern_config_with_twins(set_backend_pattern_config: Callable) -> Callable:
    """``BackendConfig.set_backend_pattern_config`` that also registers, for a
    pattern naming a torch BatchNorm, the same config naming ours."""
    if getattr(set_backend_pattern_config, _MARK, False):
        return set_backend_pattern_config

    @functools.wraps(set_backend_pattern_config)
    def wrapped(self: Any, config: Any) -> Any:
        result = set_backend_pattern_config(self, config)
        pattern, complex_format = config.pattern, config._pattern_complex_format
        if _names_torch_batchnorm(pattern) or _names_torch_batchnorm(complex_format):
            twin = copy.copy(config)
            twin.pattern = _mirror(pattern)
            twin._pattern_complex_format = _mirror(complex_format)
            if config.fuser_method is not None:
                twin.fuser_method = _with_torch_batchnorms(config.fuser_method)
            set_backend_pattern_config(self, twin)
        return result

    setattr(wrapped, _MARK, True)
    return wrapped


def register() -> None:
    """Make FX and quantization treat this library's BatchNorms as torch's. Idempotent."""
    torch.fx.Tracer.is_leaf_module = _leaf_rule(torch.fx.Tracer.is_leaf_module)  # type: ignore[method-assign]
    internals = _compat.quantization_internals()
    tracer = internals["QuantizationTracer"]
    tracer.is_leaf_module = _leaf_rule(tracer.is_leaf_module)
    backend_config = internals["BackendConfig"]
    backend_config.set_backend_pattern_config = _set_backend_pattern_config_with_twins(
        backend_config.set_backend_pattern_config
    )
    fuser_methods = internals["fuser_methods"]
    for pattern, fuser in list(fuser_methods.items()):
        if _names_torch_batchnorm(pattern) and _mirror(pattern) not in fuser_methods:
            fuser_methods[_mirror(pattern)] = _with_torch_batchnorms(fuser)
    for table in (internals["static_quant_modules"], internals["lower_modules"]):
        for torch_cls, ours in OURS_FOR_TORCH.items():
            if torch_cls in table:
                table.setdefault(ours, table[torch_cls])


def register_or_warn() -> None:
    """:func:`register`, turning a changed torch into a warning (the import must not fail)."""
    try:
        register()
    except _compat.PrivateAPIMissing as error:
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)
