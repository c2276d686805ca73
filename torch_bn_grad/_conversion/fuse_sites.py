"""The sites ``convert_batchnorm(model, fuse=True)`` fuses, found in a traced graph:
``bn -> act`` and ``bn -> add(residual) -> act`` where each output has no other
use and the activation is one the fused operators take (``fuse.py`` says which
forms count); for a site that cannot be fused, the reason the warning gives."""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from torch_bn_grad._rules import activation as _activation

__all__ = ["ACT_MODULES", "Site", "has_hooks", "match", "unfusable"]

ACT_MODULES = {module: name for name, module in _activation.TORCH_MODULES.items()}
_ACT_FUNCTIONS = {F.relu: "relu", F.relu_: "relu", torch.relu: "relu", torch.relu_: "relu",
                  F.leaky_relu: "leaky_relu", F.leaky_relu_: "leaky_relu", F.silu: "silu"}
_ACT_METHODS = {"relu": "relu", "relu_": "relu"}
# Activations that are recognized (so that the warning names the site) but not fused.
_OTHER_FUNCTIONS = {F.relu6, F.hardswish, F.hardsigmoid, F.gelu, F.elu, F.selu, F.celu, F.mish, F.hardtanh,
                    F.softplus, F.sigmoid, F.tanh, torch.sigmoid, torch.tanh}
_OTHER_METHODS = {"sigmoid", "sigmoid_", "tanh", "tanh_"}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@dataclass
class Site:
    bn: fx.Node
    act: fx.Node
    add: Optional[fx.Node]  # bn + residual
    activation: str
    negative_slope: float


def activation_of(node: fx.Node, input: fx.Node, modules: dict[str, nn.Module]) -> Optional[tuple[str, Any]]:
    """("relu"|"leaky_relu"|"silu", slope) when ``node`` applies a fusable activation to ``input``,
    ("other", description) for another activation, None for anything else."""
    if not node.args or node.args[0] is not input:
        return None
    if node.op == "call_module":
        m = modules[node.target]  # type: ignore[index]
        if type(m) in ACT_MODULES and len(node.args) == 1 and not node.kwargs:
            return ACT_MODULES[type(m)], float(getattr(m, "negative_slope", 0.01))
        if type(m).__module__ == "torch.nn.modules.activation":
            return "other", f"{type(m).__name__} module"
        return None
    if node.op == "call_function" and node.target in _ACT_FUNCTIONS:
        name = _ACT_FUNCTIONS[node.target]  # type: ignore[index]
        slope: Any = 0.01
        if name == "leaky_relu":
            slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01)
            if isinstance(slope, bool) or not isinstance(slope, (int, float)):
                return "other", "leaky_relu with a computed slope"
        return name, float(slope)
    if node.op == "call_method" and node.target in _ACT_METHODS and len(node.args) == 1:
        return _ACT_METHODS[node.target], 0.01  # type: ignore[index]
    if (node.op == "call_function" and node.target in _OTHER_FUNCTIONS) or (
            node.op == "call_method" and node.target in _OTHER_METHODS):
        return "other", getattr(node.target, "__name__", str(node.target))
    return None


def residual_of(node: fx.Node, bn: fx.Node) -> Optional[fx.Node]:
    """The other operand when ``node`` is ``bn + residual`` (or ``residual + bn``), else None."""
    is_add = (node.op == "call_function" and node.target in _ADD_FUNCTIONS) or (
        node.op == "call_method" and node.target in _ADD_METHODS)
    if not is_add or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    in_place = node.target in (operator.iadd, "add_")
    if a is bn and isinstance(b, fx.Node) and b is not bn:
        return b
    if b is bn and isinstance(a, fx.Node) and a is not bn and not in_place:  # never drop a mutation of a
        return a
    return None


def match(node: fx.Node, modules: dict[str, nn.Module], calls: Counter) -> Union[Site, str, None]:
    """The site starting at the BatchNorm call ``node``; a reason string when it is one
    that cannot be fused; None when no activation follows."""
    users = list(node.users)
    if len(users) != 1:
        acts = [u for u in users if activation_of(u, node, modules) is not None]
        return "its output has other uses than the activation" if acts else None
    act_node, add = users[0], None
    act = activation_of(act_node, node, modules)
    if act is None:
        if residual_of(act_node, node) is None:
            return None
        add = act_node
        after = list(add.users)
        acts = [u for u in after if activation_of(u, add, modules) is not None]
        if len(after) != 1:
            return "the sum with the residual has other uses than the activation" if acts else None
        act_node = after[0]
        act = activation_of(act_node, add, modules)
        if act is None:
            return None
    if act[0] == "other":
        return f"the activation ({act[1]}) is not fusable (ReLU, LeakyReLU, SiLU)"
    why = unfusable(f"the activation ({act[0]})", act[0], act[1])
    if why:
        return why
    bn = modules[node.target]  # type: ignore[index]
    if len(node.args) != 1 or node.kwargs:
        return "the BatchNorm is called with more than its input"
    if has_hooks(bn) or (act_node.op == "call_module" and has_hooks(modules[act_node.target])):  # type: ignore[index]
        return "the BatchNorm or the activation module has hooks"
    if calls[id(bn)] > 1:
        return "the BatchNorm module is called more than once"
    return Site(node, act_node, add, act[0], act[1])


def has_hooks(module: Optional[nn.Module]) -> bool:
    return module is not None and any(getattr(module, key, None) for key in _HOOKS)


def unfusable(what: str, activation: str, negative_slope: float) -> str:
    """Why the fused operators refuse these activation arguments (their check's
    message, naming ``what``: a LeakyReLU's negative slope), or "" when they take them."""
    try:
        _activation.check(what, activation, negative_slope)
    except (TypeError, ValueError) as error:
        return str(error)
    return ""
