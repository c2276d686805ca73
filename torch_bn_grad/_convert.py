"""``convert_batchnorm``'s work: which modules are replaced, and by what.

* A module whose type is exactly torch's ``BatchNorm1d/2d/3d`` becomes this
  library's class of that name; torch's ``SyncBatchNorm`` (and every one of
  them with ``sync=True``) becomes :class:`torch_bn_grad.nn.SyncBatchNorm`.
* A subclass of torch's BatchNorm whose ``forward`` is torch's own becomes an
  instance of a class derived from it with this library's forward in front
  (so ``isinstance`` and the subclass's other methods and attributes stay).
* timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` (``timm.layers.norm_act``)
  become likewise derived classes whose forward is this library's batch norm,
  then the module's ``drop``, then its ``act``, as timm's forward does.
* Any other subclass (its own ``forward``) and the Lazy variants stay as they
  are, each named in a ``UserWarning``.

A replacement takes over the original's whole state: the same Parameter and
buffer objects, ``training``, submodules (timm's ``act``/``drop``), the
subclass's attributes and every hook (forward, forward-pre, backward,
state_dict and load_state_dict), whose handles keep working.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

_TIMM_NORM_ACT = "timm.layers.norm_act"
_TIMM_CLASSES = ("BatchNormAct2d", "SyncBatchNormAct")


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


def convert(
    module: torch.nn.Module,
    sync: bool,
    process_group: Optional[dist.ProcessGroup],
    subclasses: bool = False,
    name: str = "",
    norm_act: bool = False,
) -> torch.nn.Module:
    """The body of :func:`torch_bn_grad.nn.convert_batchnorm`; ``norm_act``
    converts timm's norm-act classes even when ``subclasses`` is false (``fuse=True``)."""
    replaced = _replacement(module, sync, process_group, subclasses, name or "the root module", norm_act)
    if replaced is not None:
        return replaced
    for child_name, child in module.named_children():
        new_child = convert(child, sync, process_group, subclasses, f"{name}.{child_name}" if name else child_name,
                            norm_act)
        if new_child is not child:
            setattr(module, child_name, new_child)
    return module


def _replacement(
    module: torch.nn.Module, sync: bool, process_group: Optional[dist.ProcessGroup], subclasses: bool, name: str,
    norm_act: bool = False,
) -> Optional[torch.nn.Module]:
    """This library's module in place of a torch BatchNorm (sharing its state); None to keep it."""
    from torch_bn_grad import nn as ours

    if not isinstance(module, _BatchNorm) or isinstance(module, ours._FusedForward):
        return None
    kind = type(module)
    if isinstance(module, LazyModuleMixin):
        warnings.warn(
            f"convert_batchnorm: {name} ({_describe(kind)}) is a Lazy BatchNorm and was left unconverted; "
            "run one forward pass (which makes it a BatchNorm) before converting", UserWarning, stacklevel=3)
        return None
    exact = {torch.nn.BatchNorm1d: ours.BatchNorm1d, torch.nn.BatchNorm2d: ours.BatchNorm2d,
             torch.nn.BatchNorm3d: ours.BatchNorm3d}
    to_sync = sync or isinstance(module, torch.nn.SyncBatchNorm)
    if kind in exact or kind is torch.nn.SyncBatchNorm:
        target = ours.SyncBatchNorm if to_sync else exact[kind]
    elif not subclasses and not (norm_act and _is_timm_norm_act(kind)):
        # The contract: subclasses stay as they are unless asked for; never silently.
        warnings.warn(
            f"convert_batchnorm: {name} ({_describe(kind)}) is a subclass of torch's BatchNorm and was left "
            "unconverted; pass subclasses=True to convert subclasses whose forward is torch's own and timm's "
            "BatchNormAct2d", UserWarning, stacklevel=3)
        return None
    elif _is_timm_norm_act(kind):
        target = _derived(kind, ours.SyncBatchNorm if to_sync else ours._FusedForward, act=True)
    elif kind.forward in (_BatchNorm.forward, torch.nn.SyncBatchNorm.forward):
        target = _derived(kind, ours.SyncBatchNorm if to_sync else ours._FusedForward, act=False)
    else:
        warnings.warn(
            f"convert_batchnorm: {name} ({_describe(kind)}) subclasses torch's BatchNorm with a forward of "
            "its own, so it was left unconverted (only subclasses whose forward is torch's, and timm's "
            "BatchNormAct2d, are converted)", UserWarning, stacklevel=3)
        return None
    return _adopt(module, target, to_sync, process_group)


def _describe(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_timm_norm_act(kind: type) -> bool:
    norm_act = sys.modules.get(_TIMM_NORM_ACT)
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


def _derived(kind: type, base: type, act: bool) -> type:
    key = (kind, base, act)
    if key not in _DERIVED:
        bases = ((_ActAfter,) if act else ()) + (base, kind)
        cls = type(kind.__name__, bases, {"__module__": __name__})
        # A name that pickle can look up again (see __getattr__ below).
        cls.__qualname__ = _pickle_name(kind, base, act)
        _DERIVED[key] = cls
    return _DERIVED[key]


def _pickle_name(kind: type, base: type, act: bool) -> str:
    # No dots: pickle looks a qualified name up attribute by attribute, at each dot.
    return "|".join(("converted", kind.__module__.replace(".", "/"), kind.__qualname__.replace(".", "/"),
                     base.__name__, str(int(act))))


def __getattr__(name: str) -> Any:
    """Rebuild a derived class from its name when unpickling in a new process."""
    parts = name.split("|")
    if len(parts) != 5 or parts[0] != "converted":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from torch_bn_grad import nn as ours

    kind: Any = importlib.import_module(parts[1].replace("/", "."))
    for attr in parts[2].split("/"):
        kind = getattr(kind, attr)
    base = {"SyncBatchNorm": ours.SyncBatchNorm, "_FusedForward": ours._FusedForward,
            "_ActForward": ours._ActForward}[parts[3]]
    return _derived(kind, base, parts[4] == "1")


def _template(module: _BatchNorm, to_sync: bool, process_group: Optional[dist.ProcessGroup]) -> torch.nn.Module:
    """A fresh module of this library's matching class, on the meta device: the
    attributes its constructor sets that the original may lack."""
    from torch_bn_grad import nn as ours

    extra: dict[str, Any] = {}
    if to_sync:
        cls: type = ours.SyncBatchNorm
        extra["process_group"] = process_group if process_group is not None else getattr(
            module, "process_group", None)
    elif isinstance(module, torch.nn.BatchNorm1d):
        cls = ours.BatchNorm1d
    elif isinstance(module, torch.nn.BatchNorm3d):
        cls = ours.BatchNorm3d
    elif isinstance(module, torch.nn.BatchNorm2d):
        cls = ours.BatchNorm2d
    else:
        cls = ours.SyncBatchNorm
    return cls(module.num_features, eps=module.eps, momentum=module.momentum, affine=module.affine,
               track_running_stats=module.track_running_stats, device="meta", **extra)


def _adopt(
    module: _BatchNorm, target: type, to_sync: bool, process_group: Optional[dist.ProcessGroup]
) -> torch.nn.Module:
    """An instance of ``target`` that takes over ``module``'s state."""
    template = _template(module, to_sync, process_group)
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
