"""``convert_batchnorm``'s work: which modules are replaced, and by what.

* A module whose type is exactly torch's ``BatchNorm1d/2d/3d`` becomes this
  library's class of that name; torch's ``SyncBatchNorm`` (and every one of
  them with ``sync=True``) becomes :class:`torch_bn_grad.nn.SyncBatchNorm`.
* timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` (``timm.layers.norm_act``,
  with timm's own forward: batch norm, then ``drop``, then ``act``) become
  classes derived from them whose forward is this library's batch norm, then
  the module's ``drop``, then its ``act``: always, as their semantics are known.
* With ``subclasses=True``, a subclass of torch's BatchNorm whose ``forward``
  is torch's own becomes an instance of a class derived from it with this
  library's forward in front (so ``isinstance`` and the subclass's other
  methods and attributes stay).
* Any other subclass and the Lazy variants stay as they are, all named in one
  ``UserWarning``.

A replacement takes over the original's whole state: the same Parameter and
buffer objects, ``training``, submodules (timm's ``act``/``drop``), the
subclass's attributes and every hook (forward, forward-pre, backward,
state_dict and load_state_dict), whose handles keep working.

The classes it produces are :mod:`torch_bn_grad.nn`'s, which that module
passes in (:class:`Targets`): this module sits below it.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.batchnorm import SyncBatchNorm as _TorchSyncBatchNorm  # bound here: programs rebind torch.nn's
from torch.nn.modules.lazy import LazyModuleMixin

TIMM_NORM_ACT = "timm.layers.norm_act"
_TIMM_CLASSES = ("BatchNormAct2d", "SyncBatchNormAct")


@dataclass(frozen=True)
class Targets:
    """This library's module classes (defined in :mod:`torch_bn_grad.nn`)."""

    plain: Mapping[type, type]  # torch's BatchNorm1d/2d/3d -> this library's
    sync: type  # SyncBatchNorm
    forward: type  # the forward every converted module has (BatchNormBase)
    act_forward: type  # the fused modules' forward (BatchNormActBase)
    fused: Mapping[type, type]  # BatchNorm1d/2d/3d, SyncBatchNorm -> their fused BatchNormAct
    home: str  # the module whose ``__getattr__`` rebuilds derived classes by name (pickle)


class Skipped:
    """The modules a conversion leaves alone, for one warning at the end."""

    def __init__(self) -> None:
        self.lazy: list[str] = []
        self.subclasses: list[str] = []
        self.own_forward: list[str] = []

    def warn(self, stacklevel: int) -> None:
        parts = []
        if self.subclasses:
            parts.append(f"subclasses of torch's BatchNorm (pass subclasses=True to convert those whose forward "
                         f"is torch's own): {', '.join(self.subclasses)}")
        if self.own_forward:
            parts.append(f"subclasses of torch's BatchNorm with a forward of their own: {', '.join(self.own_forward)}")
        if self.lazy:
            parts.append(f"Lazy BatchNorms (run one forward pass, which makes them BatchNorms, before converting): "
                         f"{', '.join(self.lazy)}")
        if parts:
            warnings.warn("convert_batchnorm left these unconverted:\n  " + "\n  ".join(parts), UserWarning,
                          stacklevel=stacklevel + 1)


class _ActAfter:
    """Forward of timm's BatchNormAct2d / SyncBatchNormAct on this library's
    batch norm: the normalization, then ``drop``, then ``act``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = super().forward(input)  # type: ignore[misc]
        if hasattr(self, "drop"):
            x = self.drop(x)  # type: ignore[attr-defined]
        if hasattr(self, "act"):
            x = self.act(x)  # type: ignore[attr-defined]
        return x


@dataclass
class Conversion:
    """One ``convert_batchnorm`` call's choices, and what it left alone."""

    targets: Targets
    sync: bool
    process_group: Optional[dist.ProcessGroup]
    subclasses: bool
    skipped: Skipped = field(default_factory=Skipped)

    def tree(self, module: torch.nn.Module, name: str = "") -> torch.nn.Module:
        """``module`` with its BatchNorms replaced (children in place); the root's replacement if it is one."""
        replaced = self._replacement(module, name or "the root module")
        if replaced is not None:
            return replaced
        for child_name, child in module.named_children():
            new_child = self.tree(child, f"{name}.{child_name}" if name else child_name)
            if new_child is not child:
                setattr(module, child_name, new_child)
        return module

    def _replacement(self, module: torch.nn.Module, name: str) -> Optional[torch.nn.Module]:
        """This library's module in place of a torch BatchNorm (sharing its state); None to keep it."""
        targets, skipped = self.targets, self.skipped
        if not isinstance(module, _BatchNorm) or isinstance(module, targets.forward):
            return None
        kind = type(module)
        described = f"{name} ({_describe(kind)})"
        if isinstance(module, LazyModuleMixin):
            skipped.lazy.append(described)
            return None
        to_sync = self.sync or isinstance(module, _TorchSyncBatchNorm)
        base = targets.sync if to_sync else targets.forward
        if kind in targets.plain or kind is _TorchSyncBatchNorm:
            target = targets.sync if to_sync else targets.plain[kind]
        elif is_timm_norm_act(kind):
            target = derived(kind, base, True, targets.home)
        elif not self.subclasses:
            skipped.subclasses.append(described)
            return None
        elif kind.forward in (_BatchNorm.forward, _TorchSyncBatchNorm.forward):
            target = derived(kind, base, False, targets.home)
        else:
            skipped.own_forward.append(described)
            return None
        return adopt(module, target, targets, to_sync, self.process_group)


def _describe(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def is_timm_norm_act(kind: type) -> bool:
    """Whether ``kind`` is timm's BatchNormAct2d or SyncBatchNormAct with timm's forward."""
    norm_act = sys.modules.get(TIMM_NORM_ACT)
    if norm_act is None:
        return False
    return any(
        getattr(norm_act, cls_name, None) is not None
        and issubclass(kind, getattr(norm_act, cls_name))
        and kind.forward is getattr(norm_act, cls_name).forward
        for cls_name in _TIMM_CLASSES
    )


# Derived classes, one per (original class, this library's base, act).
_DERIVED: dict[tuple[type, type, bool], type] = {}


def derived(kind: type, base: type, act: bool, home: str) -> type:
    """A class derived from ``kind`` with ``base``'s forward in front (then timm's drop and act if ``act``).
    It lives in the module ``home``, whose ``__getattr__`` rebuilds it by name (:func:`rebuild`) for pickle."""
    key = (kind, base, act)
    if key not in _DERIVED:
        bases = ((_ActAfter,) if act else ()) + (base, kind)
        cls = type(kind.__name__, bases, {"__module__": home})
        cls.__qualname__ = _pickle_name(kind, base, act)
        _DERIVED[key] = cls
    return _DERIVED[key]


def _pickle_name(kind: type, base: type, act: bool) -> str:
    # No dots: pickle looks a qualified name up attribute by attribute, at each dot.
    return "|".join(("converted", kind.__module__.replace(".", "/"), kind.__qualname__.replace(".", "/"),
                     base.__name__, str(int(act))))


# Other names of the bases that pickles of converted models hold (0.1.0 development builds).
_EARLIER_BASE_NAMES = {"FusedForward": "BatchNormBase", "ActForward": "BatchNormActBase"}


def rebuild(name: str, targets: Targets, module_name: str) -> type:
    """The derived class named ``name`` (see :func:`derived`), for a module's ``__getattr__``."""
    parts = name.split("|")
    if len(parts) != 5 or parts[0] != "converted":
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    kind: Any = importlib.import_module(parts[1].replace("/", "."))
    for attr in parts[2].split("/"):
        kind = getattr(kind, attr)
    bases = {cls.__name__: cls for cls in (targets.sync, targets.forward, targets.act_forward)}
    bases.update({old: bases[new] for old, new in _EARLIER_BASE_NAMES.items()})
    return derived(kind, bases[parts[3]], parts[4] == "1", module_name)


def _template(module: _BatchNorm, targets: Targets, to_sync: bool,
              process_group: Optional[dist.ProcessGroup]) -> torch.nn.Module:
    """A fresh module of this library's matching class, on the meta device: the
    attributes its constructor sets that the original may lack."""
    extra: dict[str, Any] = {}
    cls: type = targets.sync
    if to_sync:
        extra["process_group"] = process_group if process_group is not None else getattr(
            module, "process_group", None)
    else:
        cls = next((ours for theirs, ours in targets.plain.items() if isinstance(module, theirs)), targets.sync)
    return cls(module.num_features, eps=module.eps, momentum=module.momentum, affine=module.affine,
               track_running_stats=module.track_running_stats, device="meta", **extra)


def adopt(
    module: _BatchNorm, target: type, targets: Targets, to_sync: bool, process_group: Optional[dist.ProcessGroup]
) -> torch.nn.Module:
    """An instance of ``target`` that takes over ``module``'s state."""
    template = _template(module, targets, to_sync, process_group)
    new = target.__new__(target)
    state = dict(template.__dict__)
    state.update(module.__dict__)  # parameters, buffers, submodules, hooks, training, the subclass's attributes
    # Own containers (the same tensors and modules), so that later assignments do not alias.
    for key in ("_parameters", "_buffers", "_modules"):
        state[key] = type(module.__dict__[key])(module.__dict__[key])
    state["_non_persistent_buffers_set"] = set(module.__dict__["_non_persistent_buffers_set"])
    if to_sync:
        state["process_group"] = template.process_group
    new.__dict__.update(state)
    return new
