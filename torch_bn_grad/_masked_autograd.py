"""The masked operators ``batch_norm_masked_forward`` and ``batch_norm_masked_backward``
as Python sees them (their fake implementations are in ``_fake.py``), and the
backward's autograd formula.

The forward's gradient is the backward operator, recorded by a C++ Autograd
kernel (``csrc/autograd/batch_norm_masked_autograd.cpp``; padded positions get 0 and are
never read), and so is the fused forward's (``batch_norm_masked_act_forward``,
through ``batch_norm_masked_act_backward``; under double backward its gate in
differentiable ops, then the backward operator). The backward's own gradient is ``_autograd.backward_backward``
over the valid positions, made of differentiable torch operators, so that
gradients of any order flow. Forward-mode AD of both forwards is C++'s too
(``batch_norm_masked_forward_jvp``); a backward after a forward with tangents
(forward over reverse) is not provided.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_bn_grad import _channels
from torch_bn_grad._autograd import backward_backward
from torch_bn_grad._autograd_kernel import register_autograd

FORWARD = torch.ops.torch_bn_grad.batch_norm_masked_forward.default
BACKWARD = torch.ops.torch_bn_grad.batch_norm_masked_backward.default
FORWARD_ACT = torch.ops.torch_bn_grad.batch_norm_masked_act_forward.default


def valid_positions(mask: Tensor) -> Tensor:
    """The mask (N, *X) broadcast against its input (N, C, *X)."""
    return mask.unsqueeze(1)


def per_channel(stats: Tensor, src: Tensor) -> Tensor:
    """A (C,) tensor viewed to broadcast against ``src`` (N, C, *X)."""
    return _channels.broadcastable(stats, src, "NCX")


# ---------------------------------------------------------------- the backward's gradient
def _backward_setup_context(ctx, inputs, output) -> None:
    src, mask, diff_dst, mean, variance, gamma, epsilon, training, output_mask = inputs
    ctx.save_for_backward(src, mask, diff_dst, mean, variance, gamma)
    ctx.set_materialize_grads(False)
    ctx.epsilon = epsilon
    ctx.training = training
    ctx.output_mask = list(output_mask)


def _backward_backward(ctx, grad_diff_src, grad_diff_gamma, grad_diff_beta):
    src, mask, dy, mean, variance, gamma = ctx.saved_tensors
    grad_x, grad_dy, grad_mean, grad_variance, grad_gamma = backward_backward(
        src, dy, mean, variance, gamma, (grad_diff_src, grad_diff_gamma, grad_diff_beta), epsilon=ctx.epsilon,
        data_format="NCX", training=ctx.training, output_mask=ctx.output_mask, valid=valid_positions(mask),
    )
    return grad_x, None, grad_dy, grad_mean, grad_variance, grad_gamma, None, None, None


register_autograd(BACKWARD, _backward_backward, _backward_setup_context)
