"""``fold_conv_batchnorm``: an eval model's batch norms folded into the convolutions before them.

``torch.fx`` traces the model (every batch norm a leaf) and finds each
``Conv1d/2d/3d -> batch norm`` call whose convolution output has no other
use, for torch's ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` and this
library's batch norms and fused modules (exact classes; the batch norm's rank
matching the convolution's, running statistics tracked). The convolution
takes the batch norm's scale and shift into its weight and bias
(``torch.nn.utils.fusion.fuse_conv_bn_eval``, torch's formula); a fused
module leaves its residual add and activation as graph nodes after it.
Everything else stays as it is, this library's batch norms included.

``Linear -> BatchNorm1d`` is not folded: which of the Linear's output
dimensions the batch norm normalizes depends on the input's rank, which a
symbolic trace does not know.
"""

from __future__ import annotations

import copy
import operator
from typing import Optional

from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.fusion import fuse_conv_bn_eval

from torch_bn_grad._conversion import revert as _revert
from torch_bn_grad import nn as ours

__all__ = ["fold_conv_batchnorm"]

_CONV_RANK = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
# A batch norm class (torch's, after TORCH_CLASS) -> the convolution rank it follows (None: any).
_BN_RANK: dict[type, Optional[int]] = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3, nn.SyncBatchNorm: None}


class _Tracer(fx.Tracer):
    """torch.nn modules and every batch norm are leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, _BatchNorm) or super().is_leaf_module(m, module_qualified_name)


def _folds_after(conv: nn.Module, bn: nn.Module) -> bool:
    kind = _revert.TORCH_CLASS.get(type(bn), type(bn))
    if kind not in _BN_RANK:
        return False  # a subclass: its forward may differ
    rank = _BN_RANK[kind]
    return type(conv) in _CONV_RANK and rank in (None, _CONV_RANK[type(conv)]) and bn.track_running_stats \
        and bn.running_mean is not None and bn.running_var is not None


def _site(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[tuple[fx.Node, Optional[fx.Node]]]:
    """(the convolution's node, the residual) when the batch norm call ``node`` folds into the convolution before it."""
    bn = modules[node.target]  # type: ignore[index]
    residual = None
    if isinstance(bn, ours.BatchNormActBase):
        call = _revert.fused_call(node)
        if call is None:
            return None
        conv_node, residual = call
    elif len(node.args) != 1 or node.kwargs:
        return None
    else:
        conv_node = node.args[0]
    if not isinstance(conv_node, fx.Node) or conv_node.op != "call_module" or len(conv_node.users) != 1 \
            or residual is conv_node:
        return None
    if not _folds_after(modules[conv_node.target], bn):  # type: ignore[index]
        return None
    return conv_node, residual


def fold_conv_batchnorm(model: nn.Module) -> fx.GraphModule:
    """A copy of the eval-mode ``model`` with each batch norm after a convolution folded into it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold_conv_batchnorm: model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        graph = _Tracer().trace(model)
    except Exception as error:  # noqa: BLE001 (the reason is passed on)
        raise RuntimeError(f"fold_conv_batchnorm: torch.fx cannot trace the model ({type(error).__name__}: "
                           f"{error})") from error
    modules = dict(model.named_modules())
    sites = [(found[0], node) for node in graph.nodes
             if node.op == "call_module" and isinstance(modules[node.target], _BatchNorm)  # type: ignore[index]
             and (found := _site(node, modules)) is not None]
    training = [f"{conv.target} -> {bn.target}" for conv, bn in sites
                if modules[conv.target].training or modules[bn.target].training]  # type: ignore[index]
    if training:
        raise ValueError("fold_conv_batchnorm: model must be in eval mode (folding uses the running statistics; "
                         f"call model.eval()), got these in training mode: {', '.join(training)}")
    folded = copy.deepcopy(model)
    for conv_node, bn_node in sites:
        # Read now: an earlier site's rewrite may have replaced the residual's node.
        residual = _site(bn_node, modules)[1]  # type: ignore[index]
        conv, bn = folded.get_submodule(conv_node.target), folded.get_submodule(bn_node.target)
        parent, _, leaf = str(conv_node.target).rpartition(".")
        setattr(folded.get_submodule(parent), leaf, fuse_conv_bn_eval(conv, bn))
        with graph.inserting_before(bn_node):
            y: fx.Node = conv_node
            if residual is not None:
                y = graph.call_function(operator.add, (y, residual))
            if isinstance(bn, ours.BatchNormActBase):
                y = _revert.activation_node(graph, y, bn.activation, bn.negative_slope)
        bn_node.replace_all_uses_with(y)
        graph.erase_node(bn_node)
    graph.lint()
    return fx.GraphModule(folded, graph, class_name=type(model).__name__)

