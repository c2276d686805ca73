"""``revert_batchnorm``: this library's batch norms back to torch's, the inverse of ``convert_batchnorm``.

Tools that recognize a batch norm by its exact type (``type(m) is
nn.BatchNorm2d``: ``torch.fx.experimental.optimization.fuse``, the patterns of
``torch.jit.freeze``, which look for ``aten::batch_norm``) see torch's modules
again:

* ``nn.BatchNorm1d/2d/3d`` become torch's class of the same name,
  ``nn.SyncBatchNorm`` becomes ``torch.nn.SyncBatchNorm``; a class that
  ``convert_batchnorm`` derived from another (timm's ``BatchNormAct2d``, a
  subclass with ``subclasses=True``) becomes that class again, with its own
  ``drop`` and ``act``.
* A fused module (``BatchNormAct1d/2d/3d``, ``SyncBatchNormAct``) becomes
  torch's batch norm and its activation module (``nn.ReLU``, ``nn.LeakyReLU``
  with the slope, ``nn.SiLU``, ``nn.Identity``):

  - as a child of a plain ``nn.Sequential`` whose next child is an
    ``nn.Identity`` (what ``convert_batchnorm(fuse=True)`` leaves there), the
    batch norm takes the fused module's slot and the activation the Identity's;
  - where a ``torch.fx.GraphModule``'s graph calls it (the residual fusions of
    ``fuse=True``), the call becomes three nodes (the batch norm, ``+``
    residual, the activation function) and the batch norm takes its path;
  - anywhere else, or when it has forward or backward hooks (which see the
    activation's output), a :class:`BatchNormActSequential` of the two takes
    its slot: its forward takes the residual too, and the hooks move to it.

  The first two keep every state_dict key; the third adds ``0.`` after the
  module's name.

The batch norms take over the original's whole state through
``_convert.adopt``, as ``convert_batchnorm``'s replacements do: the same
Parameter and buffer objects, ``training``, attributes and hooks.
"""

from __future__ import annotations

import operator
import warnings
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import Tensor, fx
from torch import nn as torch_nn

from torch_bn_grad._rules import activation as _activation
from torch_bn_grad._conversion import convert as _convert
from torch_bn_grad import nn as ours

__all__ = ["TORCH_CLASS", "activation_node", "fused_call",
           "revert_batchnorm"]


def _torch_classes() -> dict[type, type]:
    targets = ours.TARGETS
    classes = {mine: theirs for theirs, mine in targets.plain.items()}
    classes[targets.sync] = torch_nn.SyncBatchNorm
    classes.update({fused: classes[plain] for plain, fused in targets.fused.items()})
    return classes


# This library's classes -> torch's (the fused ones -> the batch norm they fuse).
TORCH_CLASS: dict[type, type] = _torch_classes()

# What a module's forward and backward hooks live in (state_dict hooks stay with the batch norm).
_CALL_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
               "_is_full_backward_hook")


def activation_node(graph: fx.Graph, x: fx.Node, activation: str, negative_slope: float) -> fx.Node:
    """``x`` through torch's function for ``activation``, added to ``graph`` (``x`` itself for identity)."""
    if activation == "identity":
        return x
    function = _activation.TORCH_FUNCTIONS[activation]
    args: tuple = (x, negative_slope) if activation == "leaky_relu" else (x,)
    return graph.call_function(function, args)


def _act_attributes() -> frozenset[str]:
    """The attributes a fused module has beyond its batch norm's (its activation's)."""
    fused, plain = ours.BatchNormAct1d(1, device="meta"), ours.BatchNorm1d(1, device="meta")
    return frozenset(fused.__dict__) - frozenset(plain.__dict__)


_ACT_ATTRIBUTES = _act_attributes()


def original_class(kind: type) -> Optional[type]:
    """The class a module of class ``kind`` reverts to; None when ``kind`` is not this library's
    (a user's subclass of ours is not: its own methods would be lost)."""
    if kind in TORCH_CLASS:
        return TORCH_CLASS[kind]
    if kind.__module__ != ours.__name__ or not issubclass(kind, ours.BatchNormBase):
        return None
    # A class _convert.derived made: this library's bases, then the original class.
    return next(b for b in reversed(kind.__bases__) if not b.__module__.startswith("torch_bn_grad"))


def _splits(module: torch_nn.Module) -> bool:
    """Whether ``module`` reverts to a batch norm and an activation (a fused module of this library's classes)."""
    return isinstance(module, ours.BatchNormActBase) and type(module) in TORCH_CLASS


def _has_call_hooks(module: torch_nn.Module) -> bool:
    return any(module.__dict__.get(key) for key in _CALL_HOOKS)


class _Reversion:
    """One ``revert_batchnorm`` call: the replacements made, and what it left alone."""

    def __init__(self) -> None:
        self.done: dict[int, torch_nn.Module] = {}  # id(ours) -> its batch norm, once per module
        self.kept: set[int] = set()
        self.skipped: list[str] = []

    def tree(self, module: torch_nn.Module, name: str = "") -> torch_nn.Module:
        """``module`` with this library's batch norms reverted (children in place); the root's replacement."""
        replaced = self._replacement(module, name or "the root module")
        if replaced is not None:
            return replaced
        if isinstance(module, fx.GraphModule):
            self._graph(module, name)
        sequential = type(module).forward is torch_nn.Sequential.forward
        children = list(module._modules.items())
        for index, (child_name, child) in enumerate(children):
            if child is None:
                continue
            path = f"{name}.{child_name}" if name else child_name
            after = children[index + 1][1] if index + 1 < len(children) else None
            if sequential and _splits(child) and id(child) not in self.kept and not _has_call_hooks(child) \
                    and type(after) is torch_nn.Identity and not _has_call_hooks(after):
                setattr(module, child_name, self._batch_norm(child))
                act = _activation.torch_module(child.activation, child.negative_slope).train(after.training)
                setattr(module, children[index + 1][0], act)
                continue
            new_child = self.tree(child, path)
            if new_child is not child:
                setattr(module, child_name, new_child)
        return module

    def _batch_norm(self, module: torch_nn.Module) -> torch_nn.Module:
        """The module of the original class that takes over ``module``'s state (no activation attributes)."""
        if id(module) not in self.done:
            to_sync = isinstance(module, ours.SyncBatchNorm)
            new = _convert.adopt(module, original_class(type(module)), ours.TARGETS, to_sync, None)  # type: ignore
            if isinstance(module, ours.BatchNormActBase):
                for key in _ACT_ATTRIBUTES:
                    new.__dict__.pop(key, None)
            self.done[id(module)] = new
        return self.done[id(module)]

    def _replacement(self, module: torch_nn.Module, name: str) -> Optional[torch_nn.Module]:
        if not isinstance(module, ours.BatchNormBase) or id(module) in self.kept:
            return None
        if original_class(type(module)) is None:
            self.skipped.append(f"{name} ({type(module).__module__}.{type(module).__qualname__}, "
                                "a subclass of this library's class)")
            return None
        bn = self._batch_norm(module)
        if not _splits(module):
            return bn
        act = _activation.torch_module(module.activation, module.negative_slope).train(module.training)
        pair = ours.BatchNormActSequential(bn, act).train(module.training)
        for key in _CALL_HOOKS:  # they saw the activation's output: the pair's
            if key in bn.__dict__:
                value = bn.__dict__[key]
                pair.__dict__[key] = value
                bn.__dict__[key] = OrderedDict() if isinstance(value, OrderedDict) else None
        return pair

    def _graph(self, gm: fx.GraphModule, name: str) -> None:
        """Each call of a fused module in ``gm``'s graph as the batch norm's call, the add and the activation."""
        modules = dict(gm.named_modules())
        graph, changed = gm.graph, False
        for node in list(graph.nodes):
            module = modules.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
            if module is None or not _splits(module) or _has_call_hooks(module):
                continue
            call = fused_call(node)
            path = f"{name}.{node.target}" if name else str(node.target)
            if call is None:
                self.kept.add(id(module))
                self.skipped.append(f"{path} (called with a mask, which torch's batch norm does not take)")
                continue
            x, residual = call
            parent, _, leaf = str(node.target).rpartition(".")
            setattr(gm.get_submodule(parent), leaf, self._batch_norm(module))
            with graph.inserting_before(node):
                y = graph.call_module(node.target, (x,))  # type: ignore[arg-type]
                if residual is not None:
                    y = graph.call_function(operator.add, (y, residual))
                y = activation_node(graph, y, module.activation, module.negative_slope)
            node.replace_all_uses_with(y)
            graph.erase_node(node)
            changed = True
        if changed:
            graph.lint()
            gm.recompile()

    def warn(self, stacklevel: int) -> None:
        if self.skipped:
            warnings.warn("revert_batchnorm left these as this library's modules:\n  " + "\n  ".join(self.skipped),
                          UserWarning, stacklevel=stacklevel + 1)


def fused_call(node: fx.Node) -> Optional[tuple[Any, Any]]:
    """(input, residual) of a graph's call of a fused module's ``forward(input, residual=None, mask=None)``;
    None with a mask (torch's batch norm takes none) or arguments it does not take."""
    args, kwargs = list(node.args), dict(node.kwargs)
    names = ("input", "residual", "mask")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    if bound.get("mask") is not None or set(bound) - set(names):
        return None
    return bound.get("input"), bound.get("residual")


def revert_batchnorm(module: torch_nn.Module) -> torch_nn.Module:
    """Replace this library's batch norms in ``module`` with torch's (see the module docstring)."""
    if not isinstance(module, torch_nn.Module):
        raise TypeError(f"revert_batchnorm: module must be a torch.nn.Module, got {type(module).__name__}")
    reversion = _Reversion()
    module = reversion.tree(module)
    reversion.warn(stacklevel=2)
    return module
