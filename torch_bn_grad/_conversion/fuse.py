"""``convert_batchnorm(model, fuse=True)``: BatchNorm + activation (+ residual) fusion.

1. timm's ``BatchNormAct2d`` (norm, drop, act in one module) becomes a class
   derived from it with :class:`torch_bn_grad.nn.BatchNormAct2d`'s forward when
   its ``drop`` is ``Identity`` and its ``act`` is ReLU, LeakyReLU (slope >= 0),
   SiLU or Identity; otherwise it is converted unfused (its drop and act kept).
2. Every other torch BatchNorm is converted as ``convert_batchnorm`` does.
3. ``torch.fx`` symbolically traces the model (BatchNorms and torch.nn modules
   are leaves) and finds ``bn -> act`` and ``bn -> add(residual) -> act``
   where the BatchNorm's output has no other use, the sum (if any) no other
   use than the activation, and the activation is an ``nn.ReLU``/``LeakyReLU``/
   ``SiLU`` module or an ``F.relu``/``F.leaky_relu``/``F.silu``/``torch.relu``
   call or ``Tensor.relu`` method (in place or not) whose arguments the fused
   operators take (``_activation.check``: a LeakyReLU's slope >= 0). Each
   becomes one call of a fused module that shares the BatchNorm's tensors:

   * a pair of adjacent children of a plain ``nn.Sequential`` (each called
     once) is fused in place: the BatchNorm's slot gets the fused module, the
     activation's slot an ``nn.Identity`` (as torch's ``fuse_modules`` does),
     and the model keeps its class;
   * any other site rewrites the traced module's graph, and that module is
     returned as a ``torch.fx.GraphModule`` (same class name, same state_dict:
     every original submodule is kept; the containers on the way to a fused
     module become :class:`_FusedContainer`, whose own forward raises, since
     their original forward would no longer be right).

   A module that cannot be traced (tracing raises, its forward takes optional
   arguments, it has hooks, or its graph depends on ``self.training``) is not
   rewritten; its children are tried one by one instead.

Everything not fused keeps working unfused, and one ``UserWarning`` names
each BatchNorm that sits before an activation but was left unfused, with the
reason (and the BatchNorms of modules that could not be traced).
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections import Counter, OrderedDict
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from torch_bn_grad._rules import activation as _activation
from torch_bn_grad._conversion import convert as _convert
from torch_bn_grad._conversion.convert import Targets
from torch_bn_grad._conversion.fuse_sites import ACT_MODULES, Site, has_hooks, match, unfusable

def fuse(
    module: nn.Module, targets: Targets, sync: bool, process_group: Optional[dist.ProcessGroup], subclasses: bool,
    memory_saving: bool,
) -> nn.Module:
    """The body of ``convert_batchnorm(module, fuse=True)``."""
    unfused: list[tuple[str, str]] = []
    module = _fuse_timm(module, targets, "", sync, memory_saving, unfused)
    conversion = _convert.Conversion(targets, sync, process_group, subclasses)
    module = conversion.tree(module)
    conversion.skipped.warn(stacklevel=3)
    module = _fuse_tree(module, targets, "", memory_saving, unfused)
    unfused = list(dict.fromkeys(unfused))  # a BatchNorm called twice is named once
    if unfused:
        by_reason: dict[str, list[str]] = {}
        for name, why in unfused:
            by_reason.setdefault(why, []).append(name or "the root module")
        lines = "\n".join(f"  {why}: {', '.join(names)}" for why, names in by_reason.items())
        warnings.warn(f"convert_batchnorm(fuse=True): {len(unfused)} BatchNorm(s) left unfused (converted, "
                      f"computing as before):\n{lines}", UserWarning, stacklevel=3)
    return module


# ------------------------------------------------------------------ timm's BatchNormAct2d
def _fuse_timm(module: nn.Module, targets: Targets, name: str, sync: bool, memory_saving: bool,
               unfused: list[tuple[str, str]]) -> nn.Module:
    kind = type(module)
    if _convert.is_timm_norm_act(kind) and not isinstance(module, targets.forward):
        activation, why = _timm_activation(module, sync)
        if activation is None:
            unfused.append((name, f"timm {kind.__name__}: {why}; converted with its drop and act kept"))
            return module
        new = _convert.adopt(module, _convert.derived(kind, targets.act_forward, False, targets.home), targets, False, None)
        new._set_activation(activation[0], activation[1], memory_saving and _activation.invertible(*activation))
        return new
    for child_name, child in module.named_children():
        new_child = _fuse_timm(child, targets, f"{name}.{child_name}" if name else child_name, sync, memory_saving,
                               unfused)
        if new_child is not child:
            setattr(module, child_name, new_child)
    return module


def _timm_activation(module: nn.Module, sync: bool) -> tuple[Optional[tuple[str, float]], str]:
    """(activation, negative_slope) of a timm norm-act module, or None and why it cannot be fused."""
    norm_act = sys.modules[_convert.TIMM_NORM_ACT]
    if not isinstance(module, norm_act.BatchNormAct2d):
        return None, "only BatchNormAct2d is fused"
    if sync:
        return None, "sync=True"
    drop, act = getattr(module, "drop", None), getattr(module, "act", None)
    if drop is not None and type(drop) is not nn.Identity:
        return None, f"its drop is {type(drop).__name__}, not Identity"
    if has_hooks(drop) or has_hooks(act):
        return None, "its drop or act has hooks"
    if act is None or type(act) is nn.Identity:
        return ("identity", 0.01), ""
    if type(act) not in ACT_MODULES:
        return None, f"its act {type(act).__name__} is not one of ReLU, LeakyReLU, SiLU, Identity"
    activation = (ACT_MODULES[type(act)], float(getattr(act, "negative_slope", 0.01)))
    why = unfusable(f"its act {type(act).__name__}", *activation)
    return (None, why) if why else (activation, "")


# ------------------------------------------------------------------ tracing
class _Tracer(fx.Tracer):
    """torch.nn modules and every BatchNorm (torch's, ours, timm's) are leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, _BatchNorm) or super().is_leaf_module(m, module_qualified_name)


def _fuse_tree(module: nn.Module, targets: Targets, path: str, memory_saving: bool,
               unfused: list[tuple[str, str]]) -> nn.Module:
    """``module`` with its sites fused: itself (fused in place, or nothing to fuse) or a GraphModule."""
    if type(module) in targets.fused or not any(type(m) in targets.fused for m in module.modules()):
        return module
    graph, problem = _trace(module)
    if graph is not None:
        return _rewrite(module, targets, graph, path, memory_saving, unfused)
    for child_name, child in list(module.named_children()):
        child_path = f"{path}.{child_name}" if path else child_name
        if type(child) in targets.fused:
            unfused.append((child_path, f"not examined: {path or 'the root module'} cannot be traced ({problem})"))
            continue
        new_child = _fuse_tree(child, targets, child_path, memory_saving, unfused)
        if new_child is not child:
            setattr(module, child_name, new_child)
    return module


def _trace(module: nn.Module) -> tuple[Optional[fx.Graph], str]:
    """``module``'s graph, or None and why it cannot be used."""
    if has_hooks(module):
        return None, "it has hooks"
    params = list(inspect.signature(module.forward).parameters.values())
    if any(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None, "its forward takes optional arguments"
    flags = {m: m.training for m in module.modules()}
    try:
        graph = _Tracer().trace(module)
        for m, training in flags.items():
            m.training = not training
        flipped = _Tracer().trace(module)
    except Exception as error:  # noqa: BLE001 (any tracing failure leaves the module unfused)
        return None, f"torch.fx: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        for m, training in flags.items():
            m.training = training
    if graph.python_code("self").src != flipped.python_code("self").src:
        return None, "its traced graph depends on self.training"
    return graph, ""


# ------------------------------------------------------------------ rewriting
def _rewrite(module: nn.Module, targets: Targets, graph: fx.Graph, path: str, memory_saving: bool,
             unfused: list[tuple[str, str]]) -> nn.Module:
    modules = dict(module.named_modules())
    calls = Counter(id(modules[n.target]) for n in graph.nodes if n.op == "call_module")  # type: ignore[index]
    sites = []
    for node in list(graph.nodes):
        if node.op != "call_module" or type(modules[node.target]) not in targets.fused:  # type: ignore[index]
            continue
        found = match(node, modules, calls)
        if isinstance(found, str):
            unfused.append((f"{path}.{node.target}" if path else str(node.target), found))
        elif found is not None and all(found.act is not site.act for site in sites):
            sites.append(found)  # (bn1 + bn2 -> act: the first fuses, the other is its residual)
    replaced: dict[str, nn.Module] = {}
    for site in sites:
        target = str(site.bn.target)
        fused = _fused_module(modules[target], targets, site.activation, site.negative_slope, memory_saving)
        if _in_sequential(site, modules, calls):
            parent, bn_name = _split(target)
            setattr(modules[parent], bn_name, fused)
            setattr(modules[parent], _split(str(site.act.target))[1], nn.Identity().train(fused.training))
        else:
            replaced[target] = fused
        # Read now: an earlier site's rewrite may have replaced the input or the residual node.
        args: tuple = (site.bn.args[0],)
        if site.add is not None:
            args += (site.add.args[1] if site.add.args[0] is site.bn else site.add.args[0],)
        with graph.inserting_before(site.act):
            call = graph.call_module(target, args)
        site.act.replace_all_uses_with(call)
        for node in (site.act, site.add, site.bn):
            if node is not None:
                graph.erase_node(node)
    if not replaced:
        return module  # nothing, or only in-place pairs: the model keeps its class
    graph.lint()
    gm = _FusedGraphModule(module, graph, class_name=type(module).__name__)
    gm.__dict__["_modules"] = OrderedDict(
        (name, _container(child, name, replaced) if child is not None else None)
        for name, child in module._modules.items())
    gm._parameters.update(module._parameters)
    gm._buffers.update(module._buffers)
    gm._non_persistent_buffers_set |= module._non_persistent_buffers_set
    gm.training = module.training
    return gm


def _fused_module(bn: nn.Module, targets: Targets, activation: str, negative_slope: float,
                  memory_saving: bool) -> nn.Module:
    """The fused module in place of ``bn``, sharing its tensors, training flag and attributes."""
    fused = _convert.adopt(bn, targets.fused[type(bn)], targets, False, None)  # type: ignore[arg-type]
    fused._set_activation(activation, negative_slope,
                          memory_saving and _activation.invertible(activation, negative_slope))
    return fused


def _in_sequential(site: Site, modules: dict[str, nn.Module], calls: Counter) -> bool:
    """Whether the site is a BatchNorm and its activation module, adjacent in a plain ``nn.Sequential``."""
    if site.add is not None or site.act.op != "call_module":
        return False
    parent, bn_name = _split(str(site.bn.target))
    act_parent, act_name = _split(str(site.act.target))
    container = modules[parent]
    if act_parent != parent or type(container).forward is not nn.Sequential.forward:
        return False
    if not isinstance(container, nn.Sequential) or calls[id(modules[str(site.act.target)])] != 1:
        return False
    names = list(container._modules)
    return names.index(act_name) == names.index(bn_name) + 1


class _FusedContainer(nn.Module):
    """A container of a fused GraphModule: the original's submodules, parameters and
    buffers, without its forward (which the graph replaced)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original_class = f"{type(original).__module__}.{type(original).__qualname__}"

    def _get_name(self) -> str:
        return f"{self.original_class.rsplit('.', 1)[-1]}[fused into the GraphModule]"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"this {self.original_class} is part of a GraphModule made by convert_batchnorm("
                           "fuse=True), whose graph runs its submodules; call the GraphModule instead")


def _container(module: nn.Module, path: str, replaced: dict[str, nn.Module]) -> nn.Module:
    """``module`` as the GraphModule holds it: the fused module, itself, or a container of its children."""
    if path in replaced:
        return replaced[path]
    if not any(p.startswith(path + ".") for p in replaced):
        return module
    holder = _FusedContainer(module)
    holder.training = module.training
    holder._parameters.update(module._parameters)
    holder._buffers.update(module._buffers)
    holder._non_persistent_buffers_set |= module._non_persistent_buffers_set
    for key, value in module.__dict__.items():  # plain tensor attributes (the graph may read them)
        if isinstance(value, torch.Tensor) and not key.startswith("_"):
            holder.__dict__[key] = value
    for name, child in module._modules.items():
        holder._modules[name] = _container(child, f"{path}.{name}", replaced) if child is not None else None
    return holder


class _FusedGraphModule(fx.GraphModule):
    """A GraphModule whose deep copy keeps every submodule (torch.fx's keeps only those the graph calls)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> fx.GraphModule:
        res = super().__deepcopy__(memo)
        for key in ("_modules", "_parameters", "_buffers"):
            res.__dict__[key] = memo[id(self.__dict__[key])]
        return res


def _split(target: str) -> tuple[str, str]:
    parent, _, name = target.rpartition(".")
    return parent, name


