"""The autograd formula of the masked operators ``batch_norm_masked_forward`` and
``batch_norm_masked_backward`` (the operators' handles: ``_forward/masked_operators.py``;
their fake implementations: ``_library/fake.py``).

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

from torch_bn_grad._library.autograd import backward_backward
from torch_bn_grad._library.autograd_kernel import register_autograd
from torch_bn_grad._forward.masked_operators import BACKWARD, valid_positions


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
