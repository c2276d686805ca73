"""The eval forward as ``torch.export`` records it: CompositeImplicitAutograd
overloads that ``ExportedProgram.run_decompositions()`` turns into core ATen.

``batch_norm_forward.frozen_composite`` and ``batch_norm_act_forward.frozen_composite``
(frozen statistics, channel axis 1, optional mask, ``dst`` alone) are what
``functional.batch_norm``, ``functional.batch_norm_act``, the masked batch
norm and so the modules call in eval mode under ``torch.export``. Such an
overload has no backend kernel, only a Python CompositeImplicitAutograd
kernel:

* ``torch.export.export`` keeps it in the graph (export preserves functional
  CompositeImplicitAutograd operators), and run eagerly (``ep.module()``) it
  is the library's eval forward, its kernels included;
* ``run_decompositions()`` with ``torch.export.default_decompositions()``
  (which lists every such operator) traces its body, which, traced, is
  ``torch.nn.functional.batch_norm`` (core ATen
  ``_native_batch_norm_legit_no_training``) and torch operators for the mask,
  residual and activation: a program that runs without this library;
* traced for inductor (``torch.compile`` of a program holding it,
  AOTInductor), its body takes the entry that ``_compile/inductor.py`` puts in
  inductor's decomposition table (``inductor_rewrites``): the plain operator
  with frozen statistics, whose lowering ``config.compile_lowering``
  governs, as in a model compiled directly.

Training-mode programs keep the plain operators (batch statistics and the
running statistics' update have no core ATen form that matches this
library's numbers).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from torch_bn_grad import _compat, functional
from torch_bn_grad._rules import activation as _activation
from torch_bn_grad._rules import channels as _channels
from torch_bn_grad._interop import onnx as _onnx
from torch_bn_grad._rules.eager import is_eager
from torch_bn_grad._forward.masked import fused_masked_act, masked_add_activate

_LIBRARY = torch.library.Library("torch_bn_grad", "FRAGMENT")
_LIBRARY.define(
    "batch_norm_forward.frozen_composite(Tensor src, Tensor? gamma, Tensor? beta, Tensor mean, Tensor variance, "
    "float epsilon, Tensor? mask=None) -> Tensor")
_LIBRARY.define(
    "batch_norm_act_forward.frozen_composite(Tensor src, Tensor? gamma, Tensor? beta, Tensor mean, "
    "Tensor variance, Tensor? residual, float epsilon, str activation, float negative_slope, Tensor? mask=None) "
    "-> Tensor")

FORWARD = torch.ops.torch_bn_grad.batch_norm_forward.frozen_composite
ACT_FORWARD = torch.ops.torch_bn_grad.batch_norm_act_forward.frozen_composite


def _forward(src: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], mean: Tensor, variance: Tensor,
             epsilon: float, mask: Optional[Tensor] = None) -> Tensor:
    """The kernel: eagerly the library's eval forward; traced, the tracer's entry for the
    overload (inductor's), else the forward in torch operators (run_decompositions)."""
    if is_eager(src):
        return functional.batch_norm(src, mean, variance, gamma, beta, False, 0.0, epsilon, mask=mask)
    rewrite = _compat.tracer_decomposition(FORWARD)
    if rewrite is not None:
        return rewrite(src, gamma, beta, mean, variance, epsilon, mask)
    return composed(src, gamma, beta, mean, variance, None, epsilon, "identity", 0.0, mask)


def _act_forward(src: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], mean: Tensor, variance: Tensor,
                 residual: Optional[Tensor], epsilon: float, activation: str, negative_slope: float,
                 mask: Optional[Tensor] = None) -> Tensor:
    """As ``_forward``."""
    if is_eager(src):
        return functional.batch_norm_act(src, mean, variance, gamma, beta, False, 0.0, epsilon, residual=residual,
                                         activation=activation, negative_slope=negative_slope, mask=mask)
    rewrite = _compat.tracer_decomposition(ACT_FORWARD)
    if rewrite is not None:
        return rewrite(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, mask)
    return composed(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, mask)


def composed(src: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], mean: Tensor, variance: Tensor,
             residual: Optional[Tensor], epsilon: float, activation: str, negative_slope: float,
             mask: Optional[Tensor]) -> Tensor:
    """The eval forward in torch operators: torch's batch norm (per-channel tensors in
    the operators' accumulation dtype, so half-precision data meets float32
    statistics as under autocast), then the mask, residual and activation."""
    gamma, beta, mean, variance = _channels.to_accumulation_dtype(src, gamma, beta, mean, variance)
    if mask is not None:
        y = _onnx.masked_batch_norm(src, mask, (mean, variance, gamma, beta, False, 0.0, epsilon))
        return masked_add_activate(y, mask, residual, activation, negative_slope)
    y = torch.nn.functional.batch_norm(src, mean, variance, gamma, beta, False, 0.0, epsilon)
    if residual is not None:
        y = y + residual
    return _activation.activate(y, activation, negative_slope)


_LIBRARY.impl("batch_norm_forward.frozen_composite", _forward, "CompositeImplicitAutograd")
_LIBRARY.impl("batch_norm_act_forward.frozen_composite", _act_forward, "CompositeImplicitAutograd")


def _inductor_forward(src, gamma, beta, mean, variance, epsilon, mask=None):
    if mask is not None:
        return torch.ops.torch_bn_grad.batch_norm_masked_forward.default(
            src, mask, gamma, beta, mean, variance, epsilon)[0]
    return torch.ops.torch_bn_grad.batch_norm_forward.default(src, gamma, beta, mean, variance, epsilon, "NCX")[0]


def _inductor_act_forward(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope,
                          mask=None):
    if mask is not None:
        return _masked_act(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, mask)
    return torch.ops.torch_bn_grad.batch_norm_act_forward.default(
        src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, "NCX", False)[0]


def _masked_act(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, mask):
    """The masked fused forward as ``_forward/masked.py``'s ``batch_norm_act`` runs it: one
    operator where that operator takes the residual, else composed."""
    if fused_masked_act(src, residual):
        return torch.ops.torch_bn_grad.batch_norm_masked_act_forward.default(
            src, mask, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope)[0]
    y = _inductor_forward(src, gamma, beta, mean, variance, epsilon, mask)
    return masked_add_activate(y, mask, residual, activation, negative_slope)


def inductor_rewrites() -> dict[Any, Any]:
    """The overloads for inductor's decomposition table: the plain operators with frozen
    statistics, which inductor then lowers (or keeps) as in a model compiled directly."""
    return {FORWARD: _inductor_forward, ACT_FORWARD: _inductor_act_forward}
