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
"""

from __future__ import annotations

import os
import sys
import types
from typing import Callable

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


class _Config(types.ModuleType):
    """The module's class: setting ``compile_lowering`` also updates the compile cache key;
    the settings are type-checked."""

    _compile_lowering: bool = _env_flag("TORCH_BN_GRAD_COMPILE_LOWERING", True)
    _skip_nonfinite_stats: bool = _env_flag("TORCH_BN_GRAD_SKIP_NONFINITE_STATS", False)

    compile_lowering = _switch("compile_lowering")
    skip_nonfinite_stats = _switch("skip_nonfinite_stats")

    def on_change(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` after every change of a setting."""
        if observer not in _observers:
            _observers.append(observer)


sys.modules[__name__].__class__ = _Config
