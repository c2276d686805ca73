"""Settings of torch_bn_grad.

``compile_lowering`` (bool, default True; environment variable
``TORCH_BN_GRAD_COMPILE_LOWERING=0`` makes the default False): under
``torch.compile`` with the inductor backend, rewrite this library's forward
and backward operators into ATen operations (the ones torch's own BatchNorm
lowers to) that inductor fuses with their neighbours. False keeps the opaque
fused kernels under inductor too, with their accuracy and reproducibility
guarantees (see docs/api.md, "torch_bn_grad.config"). Eager mode, ``torch.export`` and
other backends always run the kernels. Set it before compiling: a model
already compiled keeps what it was compiled with until ``torch._dynamo.reset()``;
compile caches on disk are keyed by it.

``skip_nonfinite_stats`` (bool, default False; environment variable
``TORCH_BN_GRAD_SKIP_NONFINITE_STATS=1`` makes the default True): the default
of the modules' ``skip_nonfinite_stats`` argument (and ``convert_batchnorm``'s
new modules'), read when a module is built: a training batch whose statistics
are not finite leaves the running statistics and ``num_batches_tracked`` as
they were. False is torch's behaviour.

``cuda_variants`` (frozenset of str, default empty; environment variable
``TORCH_BN_GRAD_CUDA_VARIANTS``, names separated by commas): the CUDA code
paths to run instead of the default ones, by name, among
``cuda_variant_names()``. A variant is compiled into every CUDA build before a
GPU run has confirmed its speed; its results equal the default path's
(tests/cuda/test_cuda_variants.py), and the GPU check times each against the
default (docs/design.md, "CUDA variants"). Read at each call, so it may change
at any time; no effect on the CPU.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Callable, Iterable

from torch_bn_grad import _C

# Called after every change of a setting: the inductor registration keeps
# inductor's compile-cache key in step with ``compile_lowering`` (_compile/inductor.py).
_observers: list[Callable[[], None]] = []


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"torch_bn_grad.config.{name} must be a bool, got {value!r}")


def _switch(name: str) -> property:
    """A bool setting kept on the class as ``_<name>``, type-checked when set, its
    observers called after every change."""
    stored = "_" + name

    def read(self: types.ModuleType) -> bool:
        return getattr(type(self), stored)

    def write(self: types.ModuleType, value: bool) -> None:
        _check_bool(name, value)
        setattr(type(self), stored, value)
        for observer in _observers:
            observer()

    return property(read, write)


_CUDA_VARIANTS_ENV = "TORCH_BN_GRAD_CUDA_VARIANTS"


def cuda_variant_names() -> tuple[str, ...]:
    """Every CUDA variant this build knows (``cuda_variants`` takes names among them)."""
    return _C.cuda_variant_names()


def _variant_set(names: Iterable[str], source: str) -> frozenset[str]:
    """`names` as a set, checked: str each, known each (`source` names the setting in errors)."""
    try:
        items = None if isinstance(names, (str, bytes)) else list(names)
    except TypeError:  # not iterable
        items = None
    if items is None or not all(isinstance(n, str) for n in items):
        raise TypeError(f"{source} must be a set of str (names among {', '.join(cuda_variant_names())}), "
                        f"got {names!r}")
    chosen = frozenset(items)
    unknown = sorted(chosen - set(cuda_variant_names()))
    if unknown:
        raise ValueError(f"{source}: unknown CUDA variant {', '.join(map(repr, unknown))}; expected names among "
                         f"{', '.join(cuda_variant_names())}")
    return chosen


def _variants_from_environment() -> frozenset[str]:
    value = os.environ.get(_CUDA_VARIANTS_ENV, "")
    return _variant_set([part.strip() for part in value.split(",") if part.strip()], _CUDA_VARIANTS_ENV)


class _Config(types.ModuleType):
    """The module's class: setting ``compile_lowering`` also updates the compile cache key;
    the settings are type-checked."""

    _compile_lowering: bool = _env_flag("TORCH_BN_GRAD_COMPILE_LOWERING", True)
    _skip_nonfinite_stats: bool = _env_flag("TORCH_BN_GRAD_SKIP_NONFINITE_STATS", False)

    compile_lowering = _switch("compile_lowering")
    skip_nonfinite_stats = _switch("skip_nonfinite_stats")

    @property
    def cuda_variants(self) -> frozenset[str]:
        return frozenset(_C.cuda_variants_on())

    @cuda_variants.setter
    def cuda_variants(self, names: Iterable[str]) -> None:
        chosen = _variant_set(names, "torch_bn_grad.config.cuda_variants")
        _C.set_cuda_variants(sorted(chosen))
        for observer in _observers:
            observer()

    def on_change(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` after every change of a setting."""
        if observer not in _observers:
            _observers.append(observer)


sys.modules[__name__].__class__ = _Config
_C.set_cuda_variants(sorted(_variants_from_environment()))
