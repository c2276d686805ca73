// The Autograd node of a fused backward operator, which is not differentiable
// itself (its forward operator's formula differentiates to any order): a
// gradient flowing into it raises instead of being dropped silently.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <string>

namespace torch_bn_grad {

struct BackwardRefusal : public torch::autograd::Node {
  std::string op, forward;  // e.g. "batch_norm_act_backward", "batch_norm_act_forward"
  std::string name() const override { return "BackwardRefusal(" + op + ")"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override {
    TORCH_CHECK_NOT_IMPLEMENTED(false, op, " is not differentiable itself; differentiate ", forward,
                                " instead, whose autograd formula supports double backward");
  }
};

}  // namespace torch_bn_grad
